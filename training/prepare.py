"""`prepare`: write a corpus's train/valid/test files and manifest.json (command line in training.prepare_cmd)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from training import corpora
from training.corpora import HELDOUT_SPLITS, OUT_OF_LABEL, CodeFile
from training.data import LabeledText, Pair
from training.errors import UserError
from training.runs import CatalogCorpus, CodeCorpus, CorpusRun, LangidCorpus, TranslationCorpus

logger = logging.getLogger(__name__)

T = TypeVar("T")
C = TypeVar("C", Pair, LabeledText)  # a record of a catalog corpus: it knows its package
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


def _split(records: list[T], key: Callable[[T], str], run: CorpusRun) -> dict[str, list[T]]:
    return corpora.split_records(records, key, run.fractions.valid_fraction, run.fractions.test_fraction)


def holds_out_packages(run: CorpusRun) -> bool:
    """Whether ``run``'s corpus holds packages out: a catalog corpus, unless ``run.packages`` names its packages
    (a domain corpus, whose packages are the point)."""
    return isinstance(run, CatalogCorpus) and not run.packages


def is_current(run: CorpusRun, manifest: dict) -> bool:
    """Whether ``manifest`` holds what `prepare` now writes for ``run``: a corpus prepared before the held-out
    packages and the out-of-label texts lacks them, and must be prepared again."""
    wanted = {"heldout"} if holds_out_packages(run) else set()
    wanted |= {"out_of_label"} if isinstance(run, LangidCorpus) else set()
    return wanted <= manifest.keys()


def _split_catalog(records: list[C], key: Callable[[C], str], run: CatalogCorpus) -> tuple[dict[str, list[C]], dict]:
    """The hash split of ``records``, and the held-out packages' splits where the corpus holds packages out; and
    the manifest's entry for those."""
    if not holds_out_packages(run):
        return _split(records, key, run), {}
    holdout = corpora.PackageHoldout()
    splits = corpora.split_records(
        records, key, run.fractions.valid_fraction, run.fractions.test_fraction, lambda r: holdout.split_of(r.package)
    )
    packages = {name: sorted({r.package for r in splits[name]}) for name in HELDOUT_SPLITS}
    logger.info("held-out packages: %s", "; ".join(f"{name}: {', '.join(p)}" for name, p in packages.items()))
    for name in HELDOUT_SPLITS:
        if not splits[name]:
            logger.warning("no package of this corpus is held out to %s: its evaluation will fail", name)
    return splits, {"heldout": {**dataclasses.asdict(holdout), "packages": packages}}


def _write_manifest(out: Path, kind: str, splits: dict[str, list], extra: dict) -> None:
    counts = {name: len(records) for name, records in splits.items()}
    write_atomic(out / "manifest.json", json.dumps({"corpus": kind, "counts": counts, **extra}, indent=2) + "\n")
    logger.info("%s: %s -> %s", kind, ", ".join(f"{n} {name}" for name, n in counts.items()), out)


def _top(counter: Counter[str]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counter.most_common(TOP_PACKAGES))


def write_labelled(
    out: Path, kind: str, splits: dict[str, list[C]], columns: Callable[[C], tuple[str, str]]
) -> Counter[str]:
    """Write `<split>.tsv` (two columns) and the line-aligned `<split>.packages.txt`; count packages."""
    for name, records in splits.items():
        write_atomic(out / f"{name}.tsv", _tsv(columns(r) for r in records))
        write_atomic(out / f"{name}.packages.txt", "".join(f"{r.package}\n" for r in records))
    packages = Counter(r.package for records in splits.values() for r in records)
    logger.info("%s: top packages: %s", kind, _top(packages))
    return packages


def _text_label(record: LabeledText) -> tuple[str, str]:
    return record.text, record.label


def _package_filter(run: CatalogCorpus) -> corpora.PackageFilter:
    return corpora.PackageFilter(frozenset(run.packages), frozenset(run.exclude_packages))


def _check_fractions(run: CorpusRun) -> None:
    valid, test = run.fractions.valid_fraction, run.fractions.test_fraction
    if valid < 0 or test < 0 or valid + test >= 1:
        raise UserError("--valid-fraction and --test-fraction must be >= 0 and sum to less than 1")


def _make_out(run: CorpusRun) -> Path:
    try:
        run.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {run.out}: {e.strerror}") from e
    return run.out


def prepare_translation(run: TranslationCorpus) -> None:
    """English -> ``run.lang`` pairs from gettext catalogs, split by their English text (and by package)."""
    _check_fractions(run)
    pairs = corpora.build_translation(run.locale_dir, run.lang, _package_filter(run), run.max_chars)
    if not pairs:
        raise UserError("no translation pairs left after filtering")
    out = _make_out(run)
    splits, heldout = _split_catalog(pairs, lambda p: p.source, run)
    packages = write_labelled(out, "translation", splits, lambda p: (p.source, p.target))
    _write_manifest(out, "translation", splits, {"lang": run.lang, **heldout, "packages": dict(packages.most_common())})


def prepare_langid(run: LangidCorpus) -> None:
    """Texts labelled with their language from gettext catalogs (split by text and by package), and texts of
    languages outside the labels from the same packages (out-of-label.tsv, labelled with their language)."""
    _check_fractions(run)
    packages = _package_filter(run)
    pairs = corpora.read_languages(run.locale_dir, run.languages, packages, run.max_chars)
    texts = corpora.langid_texts(pairs, run.num_languages, run.max_per_language)
    if not texts:
        raise UserError("no langid texts left after filtering")
    labels = Counter(t.label for t in texts)
    outside = corpora.out_of_label_texts(run.locale_dir, pairs, labels, packages, run.max_chars)
    out = _make_out(run)
    splits, heldout = _split_catalog(texts, lambda t: t.text, run)
    counts = write_labelled(out, "langid", splits, _text_label)
    write_labelled(out, OUT_OF_LABEL, {OUT_OF_LABEL: outside}, _text_label)
    logger.info("langid labels: %s", ", ".join(f"{name} {n}" for name, n in labels.most_common()))
    outside_counts = Counter(t.label for t in outside)
    logger.info("out of label: %s", ", ".join(f"{name} {n}" for name, n in outside_counts.most_common()))
    if not outside:
        logger.warning("no texts outside the labels (%s): the out-of-label evaluation will fail", OUT_OF_LABEL)
    _write_manifest(
        out,
        "langid",
        splits,
        {
            "labels": dict(labels.most_common()),
            **heldout,
            "out_of_label": dict(outside_counts.most_common()),
            "packages": dict(counts.most_common()),
        },
    )


def prepare_code(run: CodeCorpus) -> None:
    """Whole standard-library files, each after a ``# file:`` line."""
    _check_fractions(run)
    files = corpora.build_code(run.stdlib_dir, run.subset, run.max_files, run.max_file_bytes)
    out = _make_out(run)
    splits = _split(files, lambda f: f.text, run)
    for name, records in splits.items():
        write_atomic(out / f"{name}.txt", code_text(records))
    chars = {name: sum(len(f.text) for f in records) for name, records in splits.items()}
    logger.info("code characters per split: %s", chars)
    _write_manifest(out, "code", splits, {"subset": run.subset, "chars": chars})


# The corpus kind (prepare's subcommand) of each run type, and what writes it.
KINDS: dict[type, tuple[str, Callable[..., None]]] = {
    TranslationCorpus: ("translation", prepare_translation),
    LangidCorpus: ("langid", prepare_langid),
    CodeCorpus: ("code", prepare_code),
}


def prepare(run: CorpusRun) -> None:
    """Write the corpus ``run`` describes (its type says which kind) and log how long that took."""
    kind, write = KINDS[type(run)]
    start = time.perf_counter()
    write(run)
    logger.info("prepare %s took %.1f s", kind, time.perf_counter() - start)
