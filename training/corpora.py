"""Embedded corpora built from data already on the machine: gettext catalogs and the Python stdlib.

Three corpora:
- translation: (English msgid, translated msgstr) pairs from `<locale_dir>/<lang>/LC_MESSAGES/*.mo`;
- langid: texts labelled with their language (msgstrs per language, msgids as `en`);
- code: whole Python files of the standard library.

Splits are a pure function of the text (a SHA-1 of it), so they are stable across runs and machines,
and since records are deduplicated on that same text, valid and test never overlap train.
"""

from __future__ import annotations

import gettext
import hashlib
import logging
import os
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from training.data import LabeledText, Pair
from training.errors import UserError

logger = logging.getLogger(__name__)

Split = Literal["train", "valid", "test"]
SPLITS: tuple[Split, ...] = ("train", "valid", "test")
CodeSubset = Literal["all", "tests", "nontests"]

DEFAULT_LOCALE_DIR = Path("/usr/share/locale")
# Languages langid may pick from; the ones with the most data on the machine win.
LANGID_CANDIDATES = ("de", "es", "fr", "it", "pt_BR", "ru", "pl", "nl", "sv", "ja", "zh_CN", "cs")
ENGLISH = "en"
CATALOG_HINT = (
    "on Debian the catalogs ship with each package's own translations (no extra -l10n package needed), "
    "or pass --locale-dir"
)
STDLIB_HINT = "install python3 (Debian: libpython3.11-stdlib) or pass --stdlib-dir"
# What a malformed .mo can raise from GNUTranslations (bad magic, undecodable text, odd header).
CATALOG_ERRORS = (OSError, UnicodeError, LookupError, IndexError, ValueError, struct.error)
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# printf (%s, %-5d, %1$s, %(name)s, %<PRIu64>) and str.format ({}, {0}, {name:>4}) placeholders.
PLACEHOLDER = re.compile(
    r"%(?:\(\w+\))?(?:\d+\$)?[-+ #0']*(?:\*|\d+)?(?:\.(?:\*|\d+))?(?:hh|ll|[hlLqjzt])?[a-zA-Z%]"
    r"|%<\w+>|\{\w*(?:[.:!][^{}]*)?\}"
)
# Line breaks for str.splitlines(), plus tab: none may survive inside a TSV field.
_BREAKS = re.compile(r"\s*[\t\n\r\v\f\x1c-\x1e\x85\u2028\u2029]\s*")

T = TypeVar("T")


@dataclass(frozen=True)
class CodeFile:
    """One source file: its path relative to the stdlib root (POSIX separators) and its text."""

    path: str
    text: str


@dataclass(frozen=True)
class PackageFilter:
    """Which catalogs (by package name) to read: all of `include` (or all if empty), minus `exclude`."""

    include: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()

    def accepts(self, package: str) -> bool:
        return (not self.include or package in self.include) and package not in self.exclude

    def check_known(self, available: Iterable[str], where: Path | str) -> None:
        """Raise UserError if a requested package has no catalog at all."""
        missing = sorted(self.include - set(available))
        if missing:
            raise UserError(f"no catalog for package(s) {', '.join(missing)} under {where}")


def _unit_hash(text: str, salt: bytes = b"") -> float:
    """Map text to [0, 1) with SHA-1: stable across processes, unlike hash()."""
    digest = hashlib.sha1(salt + text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _order_key(text: str) -> float:
    # Salted, so that ordering (and capping) is independent of the split assignment.
    return _unit_hash(text, salt=b"order:")


def split_of(text: str, valid_fraction: float = 0.05, test_fraction: float = 0.05) -> Split:
    """The split `text` belongs to; deterministic, with the given valid/test fractions."""
    if valid_fraction < 0 or test_fraction < 0 or valid_fraction + test_fraction >= 1:
        raise ValueError(f"bad split fractions: valid={valid_fraction}, test={test_fraction}")
    u = _unit_hash(text)
    if u < test_fraction:
        return "test"
    return "valid" if u < test_fraction + valid_fraction else "train"


def split_records(
    records: Iterable[T], key: Callable[[T], str], valid_fraction: float = 0.05, test_fraction: float = 0.05
) -> dict[Split, list[T]]:
    """Group records by the split of `key(record)`, keeping their order."""
    splits: dict[Split, list[T]] = {name: [] for name in SPLITS}
    for record in records:
        splits[split_of(key(record), valid_fraction, test_fraction)].append(record)
    return splits


def normalise(text: str) -> str:
    """Strip, and turn every line break or tab (with the spaces around it) into one space."""
    if text.isprintable():  # fast path: no tab or line break of any kind
        return text.strip()
    return _BREAKS.sub(" ", text).strip()


def has_words(text: str) -> bool:
    """Whether any letter is left once placeholders are removed (`%s: %s` has none)."""
    return any(c.isalpha() for c in PLACEHOLDER.sub("", text))


def catalog_paths(locale_dir: Path, lang: str) -> dict[str, Path]:
    """Map package name -> .mo path for one language; UserError if it has none."""
    folder = Path(locale_dir) / lang / "LC_MESSAGES"
    paths = {p.stem: p for p in sorted(folder.glob("*.mo"))}
    if not paths:
        raise UserError(f"no gettext catalogs for language '{lang}' in {folder}: {CATALOG_HINT}")
    return paths


def read_catalog_pairs(mo_path: Path) -> list[Pair]:
    """Singular (msgid, msgstr) pairs of one .mo catalog, normalised, context stripped from msgids.

    Skips the header, plural entries, and entries left untranslated or translated as themselves.
    """
    with open(mo_path, "rb") as f:
        catalog = gettext.GNUTranslations(f)._catalog
    package = Path(mo_path).stem
    pairs = []
    for msgid, msgstr in catalog.items():
        if isinstance(msgid, tuple) or not msgid:
            continue
        source, target = normalise(msgid.split("\x04", 1)[-1]), normalise(msgstr)
        if source and target and source != target:
            pairs.append(Pair(source, target, package=package))
    return pairs


def _language_pairs(locale_dir: Path, lang: str, packages: PackageFilter, max_chars: int) -> list[Pair]:
    """All pairs of one language's selected catalogs, in package order; bad catalogs are skipped."""
    pairs = []
    for package, path in catalog_paths(locale_dir, lang).items():
        if not packages.accepts(package):
            continue
        try:
            pairs.extend(
                p for p in read_catalog_pairs(path) if len(p.source) <= max_chars and len(p.target) <= max_chars
            )
        except CATALOG_ERRORS as e:
            logger.warning("skipping unreadable catalog %s: %s", path, e)
    return pairs


def build_translation(
    locale_dir: Path = DEFAULT_LOCALE_DIR,
    lang: str = "es",
    packages: PackageFilter = PackageFilter(),
    max_chars: int = 300,
) -> list[Pair]:
    """English -> `lang` pairs, deduplicated on the source (first package in name order wins)."""
    packages.check_known(catalog_paths(locale_dir, lang), Path(locale_dir) / lang / "LC_MESSAGES")
    seen: dict[str, Pair] = {}
    for pair in _language_pairs(locale_dir, lang, packages, max_chars):
        seen.setdefault(pair.source, pair)
    return sorted(seen.values(), key=lambda p: _order_key(p.source))


def _available_languages(locale_dir: Path, languages: Sequence[str]) -> list[str]:
    found = [lang for lang in languages if any((Path(locale_dir) / lang / "LC_MESSAGES").glob("*.mo"))]
    if not found:
        raise UserError(f"no gettext catalogs for any of {', '.join(languages)} under {locale_dir}: {CATALOG_HINT}")
    return found


def build_langid(
    locale_dir: Path = DEFAULT_LOCALE_DIR,
    languages: Sequence[str] = LANGID_CANDIDATES,
    num_languages: int = 10,
    packages: PackageFilter = PackageFilter(),
    max_per_language: int = 4000,
    max_chars: int = 300,
) -> list[LabeledText]:
    """Texts labelled with their language: the `num_languages` of `languages` with the most texts, plus `en`.

    English texts are the msgids of the chosen languages' catalogs. Texts without words, and texts
    seen under two labels, are dropped; each label keeps at most `max_per_language` texts (a stable
    hash-ordered sample).
    """
    found = _available_languages(locale_dir, languages)
    packages.check_known(
        {pkg for lang in found for pkg in catalog_paths(locale_dir, lang)}, f"{locale_dir}/*/LC_MESSAGES"
    )
    pairs = {lang: _language_pairs(locale_dir, lang, packages, max_chars) for lang in found}
    chosen = sorted(found, key=lambda lang: -len({p.target for p in pairs[lang]}))[:num_languages]
    logger.info("langid languages: %s (+%s)", ", ".join(chosen), ENGLISH)

    candidates: dict[tuple[str, str], str] = {}  # (text, label) -> first package it was seen in
    for lang in chosen:
        for pair in pairs[lang]:
            candidates.setdefault((pair.target, lang), pair.package)
            candidates.setdefault((pair.source, ENGLISH), pair.package)
    num_labels = Counter(text for text, _ in candidates)
    ambiguous = sum(n > 1 for n in num_labels.values())
    logger.info("langid: dropped %d texts seen under more than one label", ambiguous)

    by_label: dict[str, list[LabeledText]] = {}
    for (text, label), package in candidates.items():
        if num_labels[text] == 1 and has_words(text):
            by_label.setdefault(label, []).append(LabeledText(text, label, package=package))
    kept = [
        r for group in by_label.values() for r in sorted(group, key=lambda r: _order_key(r.text))[:max_per_language]
    ]
    return sorted(kept, key=lambda r: _order_key(r.text))


def is_test_file(path: str) -> bool:
    """Whether a relative path is test code: under a test/tests/*_test dir, or named test_*.py."""
    *dirs, name = path.split("/")
    return name.startswith("test_") or any(d in ("test", "tests") or d.endswith("_test") for d in dirs)


def _python_files(stdlib_dir: Path) -> list[str]:
    """Relative POSIX paths of the .py files under `stdlib_dir`, outside site-packages and caches."""
    paths = []
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        rel = Path(root).relative_to(stdlib_dir)
        paths.extend((rel / name).as_posix() for name in files if name.endswith(".py"))
    return paths


def build_code(
    stdlib_dir: Path,
    subset: CodeSubset = "all",
    max_files: int | None = None,
    max_file_bytes: int = 200_000,
) -> list[CodeFile]:
    """Python files of the stdlib, sorted by path; non-UTF-8, empty, huge and duplicate files skipped.

    With `max_files`, a stable hash-ordered sample of that many files is kept.
    """
    stdlib_dir = Path(stdlib_dir)
    if not stdlib_dir.is_dir():
        raise UserError(f"no Python standard library at {stdlib_dir}: {STDLIB_HINT}")
    candidates = [p for p in _python_files(stdlib_dir) if subset == "all" or is_test_file(p) == (subset == "tests")]
    if not candidates:
        raise UserError(f"no {subset} .py files under {stdlib_dir}: {STDLIB_HINT}")
    files: dict[str, CodeFile] = {}  # keyed by text, for deduplication
    skipped = 0
    for rel in sorted(candidates, key=_order_key):
        if max_files is not None and len(files) >= max_files:
            break
        path = stdlib_dir / rel
        try:
            if path.stat().st_size > max_file_bytes:
                skipped += 1
                continue
            text = path.read_bytes().decode("utf-8").replace("\r\n", "\n")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        if text.strip():
            files.setdefault(text, CodeFile(rel, text))
    logger.info("code: %d files kept, %d huge/unreadable/non-UTF-8 skipped", len(files), skipped)
    return sorted(files.values(), key=lambda f: f.path)
