"""`python -m training prepare {translation,langid,code}`: the command line (work in training.prepare)."""

from __future__ import annotations

import argparse

from training.options import positive_int
from training.runs import (
    CatalogCorpus,
    CodeCorpus,
    LangidCorpus,
    SplitFractions,
    TranslationCorpus,
    command,
    default_stdlib_dir,
)


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _run(run: TranslationCorpus | LangidCorpus | CodeCorpus) -> None:
    from training.prepare import prepare

    prepare(run)


def _common(parser: argparse.ArgumentParser) -> None:
    fractions = SplitFractions()
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument(
        "--valid-fraction", type=float, default=fractions.valid_fraction, help="share of valid (default %(default)s)"
    )
    parser.add_argument(
        "--test-fraction", type=float, default=fractions.test_fraction, help="share of test (default %(default)s)"
    )


def _catalog_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--locale-dir", default=str(CatalogCorpus.locale_dir), help="gettext root (default %(default)s)"
    )
    parser.add_argument("--packages", type=_comma_list, default=(), help="keep only these packages (a,b)")
    parser.add_argument("--exclude-packages", type=_comma_list, default=(), help="drop these packages (a,b)")
    parser.add_argument(
        "--max-chars",
        type=positive_int,
        default=CatalogCorpus.max_chars,
        help="skip longer texts (default %(default)s)",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `prepare` and its three corpus subcommands."""
    parser = subparsers.add_parser("prepare", help="build a corpus from data on this machine")
    corpus = parser.add_subparsers(dest="corpus", required=True, metavar="{translation,langid,code}")

    p = corpus.add_parser("translation", help="English -> LANG pairs from gettext catalogs")
    _common(p)
    _catalog_options(p)
    p.add_argument("--lang", default=TranslationCorpus.lang, help="target language folder (default %(default)s)")
    p.set_defaults(func=command(TranslationCorpus, _run))

    p = corpus.add_parser("langid", help="text -> language code from gettext catalogs")
    _common(p)
    _catalog_options(p)
    p.add_argument(
        "--languages",
        type=_comma_list,
        default=",".join(LangidCorpus.languages),
        help="candidate languages (default %(default)s)",
    )
    p.add_argument(
        "--num-languages",
        type=positive_int,
        default=LangidCorpus.num_languages,
        help="keep the N with most data (default %(default)s)",
    )
    p.add_argument(
        "--max-per-language",
        type=positive_int,
        default=LangidCorpus.max_per_language,
        help="cap per label (default %(default)s)",
    )
    p.set_defaults(func=command(LangidCorpus, _run))

    p = corpus.add_parser("code", help="Python files of the standard library")
    _common(p)
    p.add_argument("--stdlib-dir", default=str(default_stdlib_dir()), help="stdlib root (default %(default)s)")
    p.add_argument("--subset", choices=("all", "tests", "nontests"), default=CodeCorpus.subset, help="which files")
    p.add_argument("--max-files", type=positive_int, default=None, help="keep at most N files (stable sample)")
    p.add_argument(
        "--max-file-bytes",
        type=positive_int,
        default=CodeCorpus.max_file_bytes,
        help="skip bigger files (default %(default)s)",
    )
    p.set_defaults(func=command(CodeCorpus, _run))
