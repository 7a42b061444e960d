"""Vocabulary maps: which target tokens a translation of a source may use (CTranslate2's ``use_vmap``).

A translator with a large target vocabulary (OPUS-MT: 58k tokens) spends much of a decoding step in the output
projection and in the search over its logits. A vocabulary map lists, per source n-gram, the target tokens it
may produce; a batch then scores only the union of its sources' candidates (model.restricted_vocab). The file is
CTranslate2's format, one entry per line, tokens as the vocabularies spell them::

    <TAB>always included target tokens
    source n-gram tokens<TAB>target tokens

A line with an empty source lists tokens every source may use (specials, punctuation, frequent words). Where
source and target share one vocabulary the source's own tokens are candidates too (names, numbers, paths and
placeholders are copied), and every special and placeholder sentinel is always a candidate.
:func:`build_vocabulary_map` makes one from a parallel corpus by co-occurrence; a checkpoint keeps its map in
VMAP_FILE (model.checkpoint.checkpoint_vocabulary_map reads it).

A multilingual translator (NLLB-200, M2M100, mBART-50) picks its target language per row, and what a source may
become differs per language: one map for 200 languages would have to allow nearly everything. Such a model keeps
one map per target language instead, ``VMAPS_DIR/<code>.txt`` (``vmaps/fra_Latn.txt``; the codes are the model's
own, as ``target_lang`` names them: model.hf.languages), each in the same format: every file stays a CTranslate2
map for that language (CTranslate2 takes one map per translator, so it would be one translator per language), a
language is added or dropped by a file, and a builder writes one language from that language's corpus alone. (One
file with the target language token in its keys would break the format and make every map's reader parse all
languages.) :class:`LanguageMaps` holds them by the language token's id; a row's language is the token its
translation starts with (:func:`target_languages`: the forced first token, else its target prefix's first), and its
candidates are its language's map's plus that token. A row whose language has no map (or that has no language) is
unrestricted; the batch then projects onto the whole vocabulary (model.restricted_vocab's one rule), its restricted
rows still masked to their own candidates.
"""

from __future__ import annotations

import bisect
import heapq
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from model.files import UnreadableFile, read_regular

VMAP_FILE = "vmap.txt"  # a checkpoint's vocabulary map, next to its weights
VMAPS_DIR = "vmaps"  # a multilingual checkpoint's maps, one per target language: vmaps/<code>.txt
VMAP_SUFFIX = ".txt"
MAX_NGRAM = 3  # longest source n-gram a map may key (CTranslate2 reads any; longer ones are rare)
MAX_VMAP_BYTES = 256 << 20  # one map file (OPUS-MT's from 1M pairs: ~15 MB)
_CODE = re.compile(r"[A-Za-z0-9_-]{1,32}")  # how a language code may be spelled in a file name


class VocabularyMapError(ValueError):
    """A vocabulary map that does not fit the model (unknown tokens, bad lines)."""


@dataclass(frozen=True)
class VocabularyMap:
    """Target ids per source n-gram (ids of the model's vocabularies), and the ids always allowed."""

    always: frozenset[int]
    entries: dict[tuple[int, ...], tuple[int, ...]]
    copy_source: bool  # source ids are target ids too (one shared vocabulary)

    @property
    def longest(self) -> int:
        return max(map(len, self.entries), default=0)

    def candidates_in(self, source: Sequence[int], language: int | None = None) -> list[int] | None:
        """:meth:`candidates`: one map serves every target language (``language`` is for :class:`LanguageMaps`)."""
        return self.candidates(source)

    def candidates(self, source: Sequence[int]) -> list[int]:
        """The sorted target ids a translation of ``source`` may use."""
        allowed = set(self.always)
        if self.copy_source:
            allowed.update(source)
        for n in range(1, self.longest + 1):
            for start in range(len(source) - n + 1):
                allowed.update(self.entries.get(tuple(source[start: start + n]), ()))
        return sorted(allowed)

    @classmethod
    def parse(cls, text: str, source_id: Callable[[str], int | None], target_id: Callable[[str], int | None],
              always: Iterable[int], copy_source: bool) -> VocabularyMap:
        """Read the file's ``text`` with the vocabularies' token -> id lookups; ``always``: ids the model needs
        whatever the map says (specials, sentinels). Unknown tokens are an error naming the line."""
        allowed = set(always)
        entries: dict[tuple[int, ...], set[int]] = defaultdict(set)
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            if "\t" not in line:
                raise VocabularyMapError(f"line {number}: expected 'source tokens<TAB>target tokens'")
            source, target = line.split("\t", 1)
            sources = [_lookup(source_id, token, number, "source") for token in source.split()]
            targets = {_lookup(target_id, token, number, "target") for token in target.split()}
            if len(sources) > MAX_NGRAM:
                raise VocabularyMapError(f"line {number}: source n-grams of at most {MAX_NGRAM} tokens")
            if sources:
                entries[tuple(sources)].update(targets)
            else:
                allowed.update(targets)
        return cls(frozenset(allowed), {k: tuple(sorted(v)) for k, v in entries.items()}, copy_source)

    def dump(self, source_token: Callable[[int], str], target_token: Callable[[int], str]) -> str:
        """The map as file text (the inverse of :meth:`parse`, given id -> token lookups). A token spelled with
        whitespace, which the format cannot hold, is left out (an n-gram holding one: the whole line)."""
        def spelled(ids: Iterable[int], token: Callable[[int], str]) -> list[str] | None:
            words = [token(i) for i in ids]
            return None if any(not w or any(c.isspace() for c in w) for w in words) else words

        lines = ["\t" + " ".join(w for i in sorted(self.always) for w in spelled([i], target_token) or [])]
        for ngram, targets in sorted(self.entries.items()):
            source = spelled(ngram, source_token)
            if source is not None:
                kept = [w for i in targets for w in spelled([i], target_token) or []]
                lines.append(" ".join(source) + "\t" + " ".join(kept))
        return "\n".join(lines) + "\n"


def _lookup(vocabulary: Callable[[str], int | None], token: str, line: int, side: str) -> int:
    found = vocabulary(token)
    if found is None:
        raise VocabularyMapError(f"line {line}: {side} token {token!r} is not in the model's vocabulary")
    return found


def build_vocabulary_map(pairs: Iterable[tuple[Sequence[int], Sequence[int]]], per_token: int = 24,
                         always_frequent: int = 1000, always: Iterable[int] = (), copy_source: bool = True
                         ) -> VocabularyMap:
    """A map from a parallel corpus of (source ids, target ids): each source token's ``per_token`` target tokens
    most associated with it (Dice's coefficient over the sentence pairs: 2 c(s, t) / (c(s) + c(t)), so that a
    token's translations outrank words every sentence has), and the ``always_frequent`` target tokens found in the
    most sentences (plus ``always``) for every source."""
    joint: dict[int, Counter[int]] = defaultdict(Counter)
    source_count: Counter[int] = Counter()
    target_count: Counter[int] = Counter()
    for source, target in pairs:
        sources, targets = set(source), set(target)
        source_count.update(sources)
        target_count.update(targets)
        for token in sources:
            joint[token].update(targets)
    entries = {}
    for token, counts in joint.items():
        def dice(item: tuple[int, int], token: int = token) -> tuple[float, int]:
            return 2 * item[1] / (source_count[token] + target_count[item[0]]), -item[0]

        best = heapq.nlargest(per_token, counts.items(), key=dice)
        entries[(token,)] = tuple(sorted(t for t, _ in best))
    frequent = {t for t, _ in target_count.most_common(always_frequent)}
    return VocabularyMap(frozenset(frequent | set(always)), entries, copy_source)


def load_vocabulary_map(path: str | Path, source_id: Callable[[str], int | None],
                        target_id: Callable[[str], int | None], always: Iterable[int],
                        copy_source: bool) -> VocabularyMap:
    """:meth:`VocabularyMap.parse` of the file at ``path`` (UTF-8, a regular file of at most MAX_VMAP_BYTES)."""
    try:
        text = read_regular(path, MAX_VMAP_BYTES).decode("utf-8")
    except (UnreadableFile, UnicodeDecodeError) as exc:
        raise VocabularyMapError(f"cannot read it: {exc}") from None
    return VocabularyMap.parse(text, source_id, target_id, always, copy_source)


@dataclass(frozen=True)
class LanguageMaps:
    """A multilingual translator's maps, one per target language, by the id of the language's token."""

    maps: dict[int, VocabularyMap]
    codes: dict[int, str]  # token id -> its language code, for messages

    def candidates_in(self, source: Sequence[int], language: int | None) -> list[int] | None:
        """The sorted target ids a translation of ``source`` into ``language`` (its token's id) may use, that token
        included; None (the whole vocabulary) for a language without a map, or none."""
        found = self.maps.get(language) if language is not None else None
        if found is None:
            return None
        allowed = found.candidates(source)
        place = bisect.bisect_left(allowed, language)
        if place == len(allowed) or allowed[place] != language:
            allowed.insert(place, language)
        return allowed

    def has(self, language: int | None) -> bool:
        return language in self.maps


AnyVocabularyMap = VocabularyMap | LanguageMaps


def language_map_path(directory: str | Path, code: str) -> Path:
    """Where a checkpoint ``directory`` keeps language ``code``'s map."""
    return Path(directory) / VMAPS_DIR / f"{code}{VMAP_SUFFIX}"


def load_language_maps(directory: str | Path, languages: dict[str, int], source_id: Callable[[str], int | None],
                       target_id: Callable[[str], int | None], always: Iterable[int], copy_source: bool
                       ) -> LanguageMaps:
    """The maps in ``directory`` (a checkpoint's VMAPS_DIR): one ``<code>.txt`` per target language, ``languages``
    the model's codes -> token ids (so at most one file per language of the model). Anything else there (a file of
    an unknown code, another name, a subdirectory) is a VocabularyMapError naming it, as is a bad map."""
    folder, always = Path(directory), set(always)
    maps: dict[int, VocabularyMap] = {}
    for entry in sorted(folder.iterdir()):
        code = entry.name[: -len(VMAP_SUFFIX)] if entry.name.endswith(VMAP_SUFFIX) else None
        if code is None or not _CODE.fullmatch(code):
            raise VocabularyMapError(f"{entry}: expected one <language code>{VMAP_SUFFIX} file per target language")
        if code not in languages:
            known = ", ".join(sorted(languages)[:12]) + (", ..." if len(languages) > 12 else "")
            raise VocabularyMapError(f"{entry}: {code!r} is not a language code of this model (codes: {known})")
        token = languages[code]
        try:
            maps[token] = load_vocabulary_map(entry, source_id, target_id, always | {token}, copy_source)
        except VocabularyMapError as exc:
            raise VocabularyMapError(f"{entry}: {exc}") from None
    if not maps:
        raise VocabularyMapError(f"{folder}: holds no map (one <language code>{VMAP_SUFFIX} per target language)")
    return LanguageMaps(maps, {token: code for code, token in languages.items() if token in maps})


def target_languages(forced: Sequence[int | None] | None, targets: Sequence[Sequence[int]] | None, rows: int
                     ) -> list[int | None]:
    """Each row's target language token: the token its translation starts with, i.e. its forced first token, else
    its target prefix's first token (a prefix starts with the language's token: generation.generate_seq2seq), else
    None. The one rule by which a row picks its map in :class:`LanguageMaps`."""
    forced = list(forced) if forced is not None else [None] * rows
    targets = list(targets) if targets is not None else [[] for _ in range(rows)]
    return [f if f is not None else (t[0] if t else None) for f, t in zip(forced, targets, strict=True)]
