"""Per-token label probabilities -> entities, as transformers' ``TokenClassificationPipeline`` (5.x) post-processes
them: ``aggregation_strategy`` none / simple / first / average / max, ``ignore_labels``, and windows of a long text
(``stride``) merged where their entities overlap.

The pipeline's rules, mirrored (quirks included, so that outputs are equal):

- Special tokens are skipped. A token continues the previous word ("subword") when the tokenizer's model prefixes
  continuing pieces (WordPiece's "##") and its piece is not as long as its text; otherwise (byte-level BPE, Unigram)
  when it starts after a character other than a space (``" " not in text[start - 1:start + 1]``). The unknown token
  starts a word and shows its text. Word ids are not read.
- none: one entity per token, ``word`` the raw piece ("##an", "Ġthe"); simple: tokens; first / average / max: words
  (the first token's label, the mean scores' best label, the most confident token's label) grouped into entities:
  a token joins the group before it when its tag (label without "B-" / "I-") is the same and it is not "B-"; the
  group's label is its first label after the first "-", its score the mean, its word the decoder over its pieces
  (for words, over words already decoded once, as the pipeline does).
- Entities whose label is in ``ignore_labels`` are dropped, per window; with several windows, of entities that
  overlap the longest (then the most confident) is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from model.tokenizer import Tokenizer, TokenSpans

STRATEGIES = ("none", "simple", "first", "average", "max")
WORD_STRATEGIES = ("first", "average", "max")  # need character offsets to find words
IGNORE_LABELS = ("O",)


@dataclass(frozen=True)
class Entity:
    """One entity (or token, for strategy none) of a text; ``start``/``end`` are character offsets into it."""

    label: str
    score: float
    word: str
    start: int | None
    end: int | None
    index: int | None = None  # the token's position in its window: strategy none only

    def as_dict(self) -> dict[str, Any]:
        """The pipeline's dict: ``entity`` and ``index`` for strategy none, ``entity_group`` for the others."""
        if self.index is not None:
            return {"entity": self.label, "score": self.score, "index": self.index, "word": self.word,
                    "start": self.start, "end": self.end}
        return {"entity_group": self.label, "score": self.score, "word": self.word, "start": self.start,
                "end": self.end}


@dataclass(frozen=True)
class Window:
    """One model input: per token its piece (the vocabulary's string), its character span in the text (``offsets``
    None where the tokenizer gives none), whether it is a special token, whether it is the unknown token, and its
    label probabilities ``scores`` (T, L)."""

    pieces: Sequence[str]
    offsets: Sequence[tuple[int, int]] | None
    special: Sequence[bool]
    unknown: Sequence[bool]
    scores: np.ndarray

    @classmethod
    def of(cls, spans: TokenSpans, scores: np.ndarray, unk_id: int | None) -> Window:
        """A window of ``Tokenizer.encode_windows`` with its probabilities (T, L)."""
        return cls(spans.pieces, spans.offsets, spans.special, [i == unk_id for i in spans.ids], scores)


@dataclass(frozen=True)
class WordRules:
    """What the pipeline reads from its tokenizer to make words of pieces."""

    join: Callable[[list[str]], str]  # pieces -> text: convert_tokens_to_string (the tokenizer's decoder)
    marks_subwords: bool  # the model prefixes continuing pieces ("##"): see the module docstring

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> WordRules:
        """``tokenizer``'s rules, as transformers' fast tokenizer over the same tokenizer.json has them."""
        backend = tokenizer.backend
        decoder = backend.decoder
        join = decoder.decode if decoder is not None else " ".join
        return cls(join, bool(getattr(backend.model, "continuing_subword_prefix", None)))


@dataclass
class _Token:
    word: str
    scores: np.ndarray  # (L,)
    start: int | None
    end: int | None
    index: int
    is_subword: bool


@dataclass
class _Tagged:
    label: str
    score: float
    word: str
    start: int | None
    end: int | None
    index: int | None = None


def probabilities(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in float32 numpy (half-precision logits widened first), as the pipeline does."""
    logits = np.asarray(logits)
    if logits.dtype != np.float64:
        logits = logits.astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def check_options(strategy: str, stride: int | None = None) -> None:
    """ValueError for an unknown strategy, or for a stride (windows of a long text) with strategy none."""
    if strategy not in STRATEGIES:
        raise ValueError(f"aggregation_strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if stride is not None and strategy == "none":
        raise ValueError('stride splits a long text into windows, which aggregation_strategy "none" cannot merge; '
                         "choose another strategy")


def aggregate(text: str, windows: Sequence[Window], id2label: Mapping[int, str], rules: WordRules,
              strategy: str = "none", ignore_labels: Sequence[str] = IGNORE_LABELS) -> list[Entity]:
    """The entities of ``text`` from its windows' probabilities (see the module docstring); ValueError for an
    unknown strategy, or a word strategy (first / average / max) over windows without character offsets."""
    check_options(strategy)
    entities: list[_Tagged] = []
    for window in windows:
        if strategy in WORD_STRATEGIES and window.offsets is None:
            raise ValueError(f'aggregation_strategy "{strategy}" needs the tokenizer\'s character offsets to find '
                             'words; use "simple" or "none"')
        tokens = _tokens(text, window, rules)
        if strategy in WORD_STRATEGIES:
            tagged = [_word(group, strategy, id2label, rules) for group in _words(tokens)]
        else:
            tagged = [_token(t, id2label) for t in tokens]
        if strategy != "none":
            tagged = [_group(group, rules) for group in _groups(tagged)]
        entities += [e for e in tagged if e.label not in ignore_labels]
    if len(windows) > 1:
        entities = _without_overlaps(entities)
    return [Entity(e.label, float(e.score), e.word, e.start, e.end, e.index if strategy == "none" else None)
            for e in entities]


def _tokens(text: str, window: Window, rules: WordRules) -> list[_Token]:
    """The pipeline's gather_pre_entities: the window's non-special tokens, each marked as continuing a word or not."""
    tokens = []
    for index, scores in enumerate(window.scores):
        if window.special[index]:
            continue
        word, start, end, is_subword = window.pieces[index], None, None, False
        if window.offsets is not None:
            start, end = window.offsets[index]
            ref = text[start:end]
            if rules.marks_subwords:
                is_subword = len(word) != len(ref)
            else:  # the pipeline's fallback for tokenizers that do not mark continuing pieces
                is_subword = start > 0 and " " not in text[start - 1:start + 1]
            if window.unknown[index]:
                word, is_subword = ref, False
        tokens.append(_Token(word, scores, start, end, index, is_subword))
    return tokens


def _token(token: _Token, id2label: Mapping[int, str]) -> _Tagged:
    best = int(token.scores.argmax())
    return _Tagged(id2label[best], token.scores[best], token.word, token.start, token.end, token.index)


def _words(tokens: list[_Token]) -> list[list[_Token]]:
    groups: list[list[_Token]] = []
    for token in tokens:
        if groups and token.is_subword:
            groups[-1].append(token)
        else:
            groups.append([token])
    return groups


def _word(tokens: list[_Token], strategy: str, id2label: Mapping[int, str], rules: WordRules) -> _Tagged:
    """The pipeline's aggregate_word: one label for a word's tokens."""
    if strategy == "first":
        scores = tokens[0].scores
    elif strategy == "max":
        scores = max(tokens, key=lambda t: t.scores.max()).scores  # the first of equals, as max() picks
    else:
        scores = np.nanmean(np.stack([t.scores for t in tokens]), axis=0)
    best = int(scores.argmax())
    return _Tagged(id2label[best], scores[best], rules.join([t.word for t in tokens]), tokens[0].start, tokens[-1].end)


def _tag(label: str) -> tuple[str, str]:
    """("B" or "I", tag): a label without a "B-" / "I-" prefix continues ("I") a group of its own tag."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _groups(tagged: list[_Tagged]) -> list[list[_Tagged]]:
    """The pipeline's group_entities: runs of one tag, a "B-" starting a new run."""
    groups: list[list[_Tagged]] = []
    for entity in tagged:
        bi, tag = _tag(entity.label)
        if groups and bi != "B" and tag == _tag(groups[-1][-1].label)[1]:
            groups[-1].append(entity)
        else:
            groups.append([entity])
    return groups


def _group(entities: list[_Tagged], rules: WordRules) -> _Tagged:
    """The pipeline's group_sub_entities."""
    score = np.mean(np.nanmean([e.score for e in entities]))
    return _Tagged(entities[0].label.split("-", 1)[-1], score, rules.join([e.word for e in entities]),
                   entities[0].start, entities[-1].end)


def _without_overlaps(entities: list[_Tagged]) -> list[_Tagged]:
    """The pipeline's aggregate_overlapping_entities: by start; of overlapping ones the longest, then the most
    confident, is kept."""
    if not entities:
        return entities
    entities = sorted(entities, key=lambda e: e.start)
    kept, previous = [], entities[0]
    for entity in entities:
        if previous.start <= entity.start < previous.end:
            length, previous_length = entity.end - entity.start, previous.end - previous.start
            if length > previous_length or length == previous_length and entity.score > previous.score:
                previous = entity
        else:
            kept.append(previous)
            previous = entity
    kept.append(previous)
    return kept
