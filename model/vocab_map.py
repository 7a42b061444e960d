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
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

VMAP_FILE = "vmap.txt"  # a checkpoint's vocabulary map, next to its weights
MAX_NGRAM = 3  # longest source n-gram a map may key (CTranslate2 reads any; longer ones are rare)


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
    """:meth:`VocabularyMap.parse` of the file at ``path`` (UTF-8)."""
    return VocabularyMap.parse(Path(path).read_text(encoding="utf-8"), source_id, target_id, always, copy_source)
