"""`python -m training prepare {translation,langid,code}`: write a corpus's train/valid/test files."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from training import corpora
from training.corpora import SPLITS, CodeFile, Split
from training.errors import UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")
TOP_PACKAGES = 10  # how many of the biggest packages the summary names


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _tsv(rows: Iterable[tuple[str, str]]) -> str:
    return "".join(f"{a}\t{b}\n" for a, b in rows)


def code_text(files: Sequence[CodeFile]) -> str:
    """Concatenate whole files, each after a `# file: <path>` line, separated by blank lines."""
    return "\n".join(f"# file: {f.path}\n" + f.text.rstrip("\n") + "\n" for f in files)


def _split(records: list[T], key: Callable[[T], str], args: argparse.Namespace) -> dict[Split, list[T]]:
    return corpora.split_records(records, key, args.valid_fraction, args.test_fraction)


def _write_manifest(out: Path, kind: str, splits: dict[Split, list], extra: dict) -> None:
    counts = {name: len(splits[name]) for name in SPLITS}
    write_atomic(out / "manifest.json", json.dumps({"corpus": kind, "counts": counts, **extra}, indent=2) + "\n")
    logger.info("%s: %s -> %s", kind, ", ".join(f"{n} {name}" for name, n in counts.items()), out)


def _top(counter: Counter[str]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counter.most_common(TOP_PACKAGES))


def write_labelled(
    out: Path, kind: str, splits: dict[Split, list[T]], columns: Callable[[T], tuple[str, str]]
) -> Counter[str]:
    """Write `<split>.tsv` (two columns) and the line-aligned `<split>.packages.txt`; count packages."""
    for name, records in splits.items():
        write_atomic(out / f"{name}.tsv", _tsv(columns(r) for r in records))
        write_atomic(out / f"{name}.packages.txt", "".join(f"{r.package}\n" for r in records))
    packages = Counter(r.package for records in splits.values() for r in records)
    logger.info("top packages: %s", _top(packages))
    return packages


def _package_filter(args: argparse.Namespace) -> corpora.PackageFilter:
    return corpora.PackageFilter(frozenset(args.packages), frozenset(args.exclude_packages))


def _check_fractions(args: argparse.Namespace) -> None:
    if args.valid_fraction < 0 or args.test_fraction < 0 or args.valid_fraction + args.test_fraction >= 1:
        raise UserError("--valid-fraction and --test-fraction must be >= 0 and sum to less than 1")


def _make_out(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {out}: {e.strerror}") from e
    return out


def run_translation(args: argparse.Namespace) -> None:
    _check_fractions(args)
    pairs = corpora.build_translation(Path(args.locale_dir), args.lang, _package_filter(args), args.max_chars)
    if not pairs:
        raise UserError("no translation pairs left after filtering")
    out = _make_out(args)
    splits = _split(pairs, lambda p: p.source, args)
    packages = write_labelled(out, "translation", splits, lambda p: (p.source, p.target))
    _write_manifest(out, "translation", splits, {"lang": args.lang, "packages": dict(packages.most_common())})


def run_langid(args: argparse.Namespace) -> None:
    _check_fractions(args)
    texts = corpora.build_langid(
        Path(args.locale_dir),
        args.languages,
        args.num_languages,
        _package_filter(args),
        args.max_per_language,
        args.max_chars,
    )
    if not texts:
        raise UserError("no langid texts left after filtering")
    out = _make_out(args)
    splits = _split(texts, lambda t: t.text, args)
    packages = write_labelled(out, "langid", splits, lambda t: (t.text, t.label))
    labels = Counter(t.label for t in texts)
    logger.info("langid labels: %s", ", ".join(f"{name} {n}" for name, n in labels.most_common()))
    _write_manifest(
        out,
        "langid",
        splits,
        {"labels": dict(labels.most_common()), "packages": dict(packages.most_common())},
    )


def run_code(args: argparse.Namespace) -> None:
    _check_fractions(args)
    files = corpora.build_code(Path(args.stdlib_dir), args.subset, args.max_files, args.max_file_bytes)
    out = _make_out(args)
    splits = _split(files, lambda f: f.text, args)
    for name, records in splits.items():
        write_atomic(out / f"{name}.txt", code_text(records))
    chars = {name: sum(len(f.text) for f in records) for name, records in splits.items()}
    logger.info("code characters per split: %s", chars)
    _write_manifest(out, "code", splits, {"subset": args.subset, "chars": chars})


def _comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _positive_int(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--valid-fraction", type=float, default=0.05, help="share of valid (default 0.05)")
    parser.add_argument("--test-fraction", type=float, default=0.05, help="share of test (default 0.05)")


def _catalog_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--locale-dir", default=str(corpora.DEFAULT_LOCALE_DIR), help="gettext root (default %(default)s)"
    )
    parser.add_argument("--packages", type=_comma_list, default=[], help="keep only these packages (a,b)")
    parser.add_argument("--exclude-packages", type=_comma_list, default=[], help="drop these packages (a,b)")
    parser.add_argument("--max-chars", type=_positive_int, default=300, help="skip longer texts (default %(default)s)")


def _timed(run: Callable[[argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    def wrapper(args: argparse.Namespace) -> None:
        start = time.perf_counter()
        run(args)
        logger.info("prepare %s took %.1f s", args.corpus, time.perf_counter() - start)

    return wrapper


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `prepare` and its three corpus subcommands."""
    parser = subparsers.add_parser("prepare", help="build a corpus from data on this machine")
    corpus = parser.add_subparsers(dest="corpus", required=True, metavar="{translation,langid,code}")

    p = corpus.add_parser("translation", help="English -> LANG pairs from gettext catalogs")
    _common(p)
    _catalog_options(p)
    p.add_argument("--lang", default="es", help="target language folder (default %(default)s)")
    p.set_defaults(func=_timed(run_translation))

    p = corpus.add_parser("langid", help="text -> language code from gettext catalogs")
    _common(p)
    _catalog_options(p)
    p.add_argument(
        "--languages",
        type=_comma_list,
        default=",".join(corpora.LANGID_CANDIDATES),
        help="candidate languages (default %(default)s)",
    )
    p.add_argument(
        "--num-languages",
        type=_positive_int,
        default=10,
        help="keep the N with most data (default %(default)s)",
    )
    p.add_argument("--max-per-language", type=_positive_int, default=4000, help="cap per label (default %(default)s)")
    p.set_defaults(func=_timed(run_langid))

    p = corpus.add_parser("code", help="Python files of the standard library")
    _common(p)
    p.add_argument("--stdlib-dir", default=sysconfig.get_paths()["stdlib"], help="stdlib root (default %(default)s)")
    p.add_argument("--subset", choices=("all", "tests", "nontests"), default="all", help="which files")
    p.add_argument("--max-files", type=_positive_int, default=None, help="keep at most N files (stable sample)")
    p.add_argument(
        "--max-file-bytes",
        type=_positive_int,
        default=200_000,
        help="skip bigger files (default %(default)s)",
    )
    p.set_defaults(func=_timed(run_code))
