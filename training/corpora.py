"""Embedded corpora built from data already on the machine: gettext catalogs and the Python stdlib.

Three corpora:
- translation: (English msgid, translated msgstr) pairs from `<locale_dir>/<lang>/LC_MESSAGES/*.mo`;
- langid: texts labelled with their language (msgstrs per language, msgids as `en`);
- code: whole Python files of the standard library.

Splits are a pure function of the text (a SHA-1 of it), so they are stable across runs and machines,
and since records are deduplicated on that same text, valid and test never overlap train. The catalog
corpora also hold whole packages out (:class:`PackageHoldout`, a SHA-1 of the package's group name): their
records go to valid-heldout and test-heldout, never to train, valid or test.
"""

from __future__ import annotations

import gettext
import hashlib
import logging
import os
import re
import struct
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from training.data import LabeledText, Pair
from training.errors import UserError

logger = logging.getLogger(__name__)

Split = Literal["train", "valid", "test"]
SPLITS: tuple[Split, ...] = ("train", "valid", "test")
HeldOutSplit = Literal["valid-heldout", "test-heldout"]
HELDOUT_SPLITS: tuple[HeldOutSplit, ...] = ("valid-heldout", "test-heldout")
HELDOUT_VALID, HELDOUT_TEST = HELDOUT_SPLITS
OUT_OF_LABEL = "out-of-label"  # the file (stem) of a langid corpus's texts in languages outside its labels
CodeSubset = Literal["all", "tests", "nontests"]

DEFAULT_LOCALE_DIR = Path("/usr/share/locale")
# Languages langid may pick from; the ones with the most data on the machine win.
LANGID_CANDIDATES = ("de", "es", "fr", "it", "pt_BR", "ru", "pl", "nl", "sv", "ja", "zh_CN", "cs")
ENGLISH = "en"
# Languages whose texts test langid on languages outside its labels, besides the candidates it does not choose:
# close to a label (nl, pt_BR, uk) or in a script the labels share (tr) or do not (ko, ar).
OUT_OF_LABEL_LANGUAGES = ("nl", "pt_BR", "uk", "tr", "ko", "ar")
OUT_OF_LABEL_PER_LANGUAGE = 500  # a stable hash-ordered sample of each one's texts
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
_GROUP = re.compile(r"[a-z]*")

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


def _bucket(u: float, valid_fraction: float, test_fraction: float) -> Split:
    """The split of a point ``u`` of [0, 1): test below ``test_fraction``, then valid, then train."""
    if valid_fraction < 0 or test_fraction < 0 or valid_fraction + test_fraction >= 1:
        raise ValueError(f"bad split fractions: valid={valid_fraction}, test={test_fraction}")
    if u < test_fraction:
        return "test"
    return "valid" if u < test_fraction + valid_fraction else "train"


def split_of(text: str, valid_fraction: float = 0.05, test_fraction: float = 0.05) -> Split:
    """The split `text` belongs to; deterministic, with the given valid/test fractions."""
    return _bucket(_unit_hash(text), valid_fraction, test_fraction)


def package_group(package: str) -> str:
    """The leading letters of a package's name, lowercased: gtk20, gtk30 and gtk30-properties are one group, as
    are the pg_* tools and the iso_* lists (related packages share near-duplicate messages)."""
    return _GROUP.match(package.lower()).group() or package


@dataclass(frozen=True)
class PackageHoldout:
    """Packages held out whole: the groups (:func:`package_group`) whose salted SHA-1 falls below
    ``test_fraction`` go to test-heldout, the next ``valid_fraction`` to valid-heldout. Shares of groups, not of
    records: a group's size plays no part, so the choice depends on its name alone."""

    valid_fraction: float = 0.05
    test_fraction: float = 0.05

    def split_of(self, package: str) -> HeldOutSplit | None:
        """The held-out split of ``package``'s records, None when it is not held out."""
        split = _bucket(_unit_hash(package_group(package), salt=b"package:"), self.valid_fraction, self.test_fraction)
        return {"valid": HELDOUT_VALID, "test": HELDOUT_TEST}.get(split)


def split_records(
    records: Iterable[T],
    key: Callable[[T], str],
    valid_fraction: float = 0.05,
    test_fraction: float = 0.05,
    held_out: Callable[[T], HeldOutSplit | None] | None = None,
) -> dict[str, list[T]]:
    """Group records by the split of `key(record)`, keeping their order; with `held_out`, a record it names a
    held-out split for goes there instead (and the result has the held-out splits too)."""
    splits: dict[str, list[T]] = {name: [] for name in (*SPLITS, *(HELDOUT_SPLITS if held_out else ()))}
    for record in records:
        name = held_out(record) if held_out else None
        splits[name or split_of(key(record), valid_fraction, test_fraction)].append(record)
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
    return [lang for lang in languages if any((Path(locale_dir) / lang / "LC_MESSAGES").glob("*.mo"))]


def read_languages(
    locale_dir: Path, languages: Sequence[str], packages: PackageFilter = PackageFilter(), max_chars: int = 300
) -> dict[str, list[Pair]]:
    """The pairs of each of `languages` that has catalogs (UserError if none has, or a package is unknown)."""
    found = _available_languages(locale_dir, languages)
    if not found:
        raise UserError(f"no gettext catalogs for any of {', '.join(languages)} under {locale_dir}: {CATALOG_HINT}")
    packages.check_known(
        {pkg for lang in found for pkg in catalog_paths(locale_dir, lang)}, f"{locale_dir}/*/LC_MESSAGES"
    )
    return {lang: _language_pairs(locale_dir, lang, packages, max_chars) for lang in found}


def _sample(records: Iterable[LabeledText], max_per_label: int) -> list[LabeledText]:
    """At most `max_per_label` records per label (a stable hash-ordered sample), all in hash order."""
    by_label: dict[str, list[LabeledText]] = {}
    for record in records:
        by_label.setdefault(record.label, []).append(record)
    kept = [r for group in by_label.values() for r in sorted(group, key=lambda r: _order_key(r.text))[:max_per_label]]
    return sorted(kept, key=lambda r: _order_key(r.text))


def _unambiguous(candidates: dict[tuple[str, str], str]) -> list[LabeledText]:
    """The (text, label) -> package candidates whose text has words and no second label."""
    num_labels = Counter(text for text, _ in candidates)
    logger.info("dropped %d texts seen under more than one label", sum(n > 1 for n in num_labels.values()))
    return [
        LabeledText(text, label, package=package)
        for (text, label), package in candidates.items()
        if num_labels[text] == 1 and has_words(text)
    ]


def langid_texts(
    pairs: dict[str, list[Pair]], num_languages: int = 10, max_per_language: int = 4000
) -> list[LabeledText]:
    """Texts labelled with their language: the `num_languages` languages of `pairs` with the most texts, plus `en`.

    English texts are the msgids of the chosen languages' catalogs. Texts without words, and texts
    seen under two labels, are dropped; each label keeps at most `max_per_language` texts (a stable
    hash-ordered sample).
    """
    chosen = sorted(pairs, key=lambda lang: -len({p.target for p in pairs[lang]}))[:num_languages]
    logger.info("langid languages: %s (+%s)", ", ".join(chosen), ENGLISH)
    candidates: dict[tuple[str, str], str] = {}  # (text, label) -> first package it was seen in
    for lang in chosen:
        for pair in pairs[lang]:
            candidates.setdefault((pair.target, lang), pair.package)
            candidates.setdefault((pair.source, ENGLISH), pair.package)
    return _sample(_unambiguous(candidates), max_per_language)


def build_langid(
    locale_dir: Path = DEFAULT_LOCALE_DIR,
    languages: Sequence[str] = LANGID_CANDIDATES,
    num_languages: int = 10,
    packages: PackageFilter = PackageFilter(),
    max_per_language: int = 4000,
    max_chars: int = 300,
) -> list[LabeledText]:
    """:func:`langid_texts` of the catalogs of `languages` under `locale_dir`."""
    return langid_texts(read_languages(locale_dir, languages, packages, max_chars), num_languages, max_per_language)


def out_of_label_texts(
    locale_dir: Path,
    pairs: dict[str, list[Pair]],
    labels: Collection[str],
    packages: PackageFilter = PackageFilter(),
    max_chars: int = 300,
    max_per_language: int = OUT_OF_LABEL_PER_LANGUAGE,
) -> list[LabeledText]:
    """Texts in languages outside `labels`, labelled with their language: those of `pairs` (the languages read
    for langid) and of OUT_OF_LABEL_LANGUAGES found under `locale_dir`, from the `packages` accepted.

    A text some catalog holds as a msgid, or as a msgstr of a label's language, is dropped (it is in-label
    too), as are texts of two outside languages and texts without words.
    """
    others = [lang for lang in _available_languages(locale_dir, OUT_OF_LABEL_LANGUAGES) if lang not in pairs]
    pairs = {**pairs, **{lang: _language_pairs(locale_dir, lang, packages, max_chars) for lang in others}}
    in_label = {p.source for group in pairs.values() for p in group}
    in_label |= {p.target for lang in labels for p in pairs.get(lang, ())}
    candidates: dict[tuple[str, str], str] = {}
    for lang, group in pairs.items():
        if lang not in labels:
            for pair in group:
                if pair.target not in in_label:
                    candidates.setdefault((pair.target, lang), pair.package)
    return _sample(_unambiguous(candidates), max_per_language)


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
