"""Readers for training files; every rejection names the file and line.

Formats are chosen by extension:
- seq2seq: ``.tsv`` (``source<TAB>target``) or ``.jsonl`` (``{"source": .., "target": ..}``);
- classifier: ``.tsv`` (``text<TAB>label``) or ``.jsonl`` (``{"text", "label"}`` or ``{"text_a", "text_b", "label"}``);
- causal_lm: a ``.txt``/``.py`` file, or a directory of them (searched recursively, sorted by path).

Blank lines are ignored. A malformed line raises :class:`MalformedLineError` unless ``skip_malformed``
is set, in which case it is skipped and counted in ``ReadResult.skipped``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from training.errors import UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")
TEXT_SUFFIXES = (".txt", ".py")


class DataError(UserError):
    """A data file is missing, empty or in an unsupported format."""


class MalformedLineError(DataError):
    """One line of a data file cannot be parsed; the message starts with ``path:line:``."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason} (pass --skip-malformed to skip such lines)")
        self.path = path
        self.line = line


@dataclass(frozen=True)
class Pair:
    """A translation pair and where it came from: a data file's line, or a gettext catalog (training.corpora)."""

    source: str
    target: str
    line: int = 0  # 1-based line in a data file; 0 when not read from one
    package: str = ""  # the catalog's package (its .mo file stem) when built from catalogs


@dataclass(frozen=True)
class LabeledText:
    """A text (or a pair of texts) with its label, and where it came from (as for Pair)."""

    text: str
    label: str
    line: int = 0
    text_b: str | None = None
    package: str = ""


@dataclass(frozen=True)
class Document:
    """The whole text of one file."""

    text: str
    path: Path


@dataclass
class ReadResult(Generic[T]):
    """Records read from one file or directory and the number of malformed lines skipped."""

    records: list[T]
    skipped: int = 0


class _Malformed(ValueError):
    """Raised by a line parser; turned into MalformedLineError with the position."""


def check_exists(path: Path, what: str) -> None:
    """Raise DataError unless ``path`` exists."""
    if not path.exists():
        raise DataError(f"{path}: {what} not found")


def _lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line number, text) for each non-blank line; text is None when the line is not UTF-8."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                yield number, None
                continue
            if text.strip():
                yield number, text


def _read_lines(path: Path, parse: Callable[[str, int], T], skip_malformed: bool) -> ReadResult[T]:
    records: list[T] = []
    skipped = 0
    for number, text in _lines(path):
        try:
            if text is None:
                raise _Malformed("not valid UTF-8")
            records.append(parse(text, number))
        except _Malformed as e:
            if not skip_malformed:
                raise MalformedLineError(path, number, str(e)) from None
            skipped += 1
    if skipped:
        logger.warning("%s: skipped %d malformed line(s)", path, skipped)
    if not records:
        raise DataError(f"{path}: no examples found")
    return ReadResult(records, skipped)


def _tsv_fields(text: str, names: tuple[str, ...]) -> list[str]:
    fields = text.split("\t")
    if len(fields) != len(names):
        layout = "<TAB>".join(names)
        raise _Malformed(f"expected {len(names)} tab-separated fields ({layout}), found {len(fields)}")
    for name, value in zip(names, fields, strict=True):
        if not value.strip():
            raise _Malformed(f"empty {name}")
    return fields


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Malformed(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _Malformed(f"expected a JSON object, found {type(obj).__name__}")
    return obj


def _json_text(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _Malformed(f"field {key!r} must be a non-empty string, found {value!r}")
    return value


def _json_label(obj: dict[str, Any]) -> str:
    label = obj.get("label")
    if isinstance(label, bool) or not isinstance(label, str | int) or str(label).strip() == "":
        raise _Malformed(f"field 'label' must be a non-empty string or an integer, found {label!r}")
    return str(label)


def _pair_from_tsv(text: str, line: int) -> Pair:
    source, target = _tsv_fields(text, ("source", "target"))
    return Pair(source, target, line)


def _pair_from_json(text: str, line: int) -> Pair:
    obj = _json_object(text)
    return Pair(_json_text(obj, "source"), _json_text(obj, "target"), line)


def _labeled_from_tsv(text: str, line: int) -> LabeledText:
    body, label = _tsv_fields(text, ("text", "label"))
    return LabeledText(body, label.strip(), line)


def _labeled_from_json(text: str, line: int) -> LabeledText:
    obj = _json_object(text)
    label = _json_label(obj)
    if "text_a" in obj or "text_b" in obj:
        return LabeledText(_json_text(obj, "text_a"), label, line, _json_text(obj, "text_b"))
    return LabeledText(_json_text(obj, "text"), label, line)


def _by_suffix(path: Path, parsers: dict[str, Callable[[str, int], T]], skip_malformed: bool) -> ReadResult[T]:
    check_exists(path, "data file")
    parse = parsers.get(path.suffix.lower())
    if parse is None or path.is_dir():
        raise DataError(f"{path}: unsupported format; expected one of {', '.join(parsers)}")
    return _read_lines(path, parse, skip_malformed)


def read_pairs(path: Path, skip_malformed: bool = False) -> ReadResult[Pair]:
    """Translation pairs from a .tsv or .jsonl file."""
    return _by_suffix(path, {".tsv": _pair_from_tsv, ".jsonl": _pair_from_json}, skip_malformed)


def read_labeled(path: Path, skip_malformed: bool = False) -> ReadResult[LabeledText]:
    """Labelled texts (or text pairs) from a .tsv or .jsonl file."""
    return _by_suffix(path, {".tsv": _labeled_from_tsv, ".jsonl": _labeled_from_json}, skip_malformed)


def read_lines(path: Path, skip_malformed: bool = False) -> ReadResult[str]:
    """Non-blank lines of a text file (the segments of MLM pre-training)."""
    check_exists(path, "text file")
    return _read_lines(path, lambda text, line: text, skip_malformed)


def text_files(path: Path) -> list[Path]:
    """``path`` itself, or the .txt/.py files under a directory, sorted."""
    check_exists(path, "text file or directory")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"{path}: no {'/'.join(TEXT_SUFFIXES)} files in this directory")
        return files
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise DataError(f"{path}: unsupported format; expected a {'/'.join(TEXT_SUFFIXES)} file or a directory")
    return [path]


def _decode_document(path: Path, skip_malformed: bool) -> tuple[str, int]:
    """The text of ``path``; lines that are not UTF-8 raise, or are dropped and counted."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    kept, skipped = [], 0
    for number, raw in enumerate(data.splitlines(keepends=True), 1):
        try:
            kept.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            if not skip_malformed:
                raise MalformedLineError(path, number, "not valid UTF-8") from None
            skipped += 1
    return "".join(kept), skipped


def read_documents(path: Path, skip_malformed: bool = False) -> ReadResult[Document]:
    """Whole files for language modelling: a text file or a directory of .txt/.py files."""
    documents, skipped = [], 0
    for file in text_files(path):
        text, bad = _decode_document(file, skip_malformed)
        skipped += bad
        if text.strip():
            documents.append(Document(text, file))
    if skipped:
        logger.warning("%s: skipped %d malformed line(s)", path, skipped)
    if not documents:
        raise DataError(f"{path}: no text found")
    return ReadResult(documents, skipped)
