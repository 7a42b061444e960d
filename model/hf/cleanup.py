"""transformers' ``clean_up_tokenization_spaces``: decoded text loses the space before punctuation and English
contractions (" ," -> ","), where tokenizer_config.json asks for it, for every tokenizer class (transformers 5's
default: off). Its tokenizers-backed classes skip it over a BPE model (GPT-2's, RoBERTa's, Llama's, NLLB's) unless
``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` is set; its Python classes
(M2M100Tokenizer) apply it whatever the model.

Streamed text stays a prefix of the whole (model.detokenize): a later token can still remove the space of a text that
ends in the start of a replaced pattern (" n" of " n't", " '" of " 's"), so :class:`CleanedUpTokenizer` holds back the
tokens after which its text may end so (``held_ids``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import models

from model.tokenizer import Tokenizer

# in transformers' order (clean_up_tokenization): each replacement sees the text the ones before it left
REPLACEMENTS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
FORCE_BPE = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
# what a text may end in that a later token can still make one of REPLACEMENTS (the patterns' proper prefixes)
UNSETTLED = frozenset(before[:n] for before, _ in REPLACEMENTS for n in range(1, len(before)))
ANCHOR_TEXT = "the a x"  # a token of these, decoded before another, gives that token's text within a sequence


def clean_up_tokenization(text: str) -> str:
    """``text`` without the spaces transformers' clean_up_tokenization removes."""
    for before, after in REPLACEMENTS:
        text = text.replace(before, after)
    return text


def cleans_up(settings: dict[str, Any], bpe: bool) -> bool:
    """Whether transformers cleans up decoded text for tokenizer_config.json ``settings`` (``bpe``: a tokenizers-backed
    class over a BPE model)."""
    return bool(settings.get("clean_up_tokenization_spaces")) and (not bpe or bool(settings.get(FORCE_BPE)))


def tokenizer_class(settings: dict[str, Any], backend: tokenizers.Tokenizer) -> type[Tokenizer]:
    """The Tokenizer class of a tokenizers-backed transformers class over ``backend`` with tokenizer_config.json
    ``settings``: :class:`CleanedUpTokenizer` where it cleans decoded text up."""
    return CleanedUpTokenizer if cleans_up(settings, bpe=isinstance(backend.model, models.BPE)) else Tokenizer


class CleanedUpTokenizer(Tokenizer):
    """A Tokenizer whose decoded text is cleaned up as transformers does (:func:`clean_up_tokenization`)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return clean_up_tokenization(super().decode(ids, skip_special_tokens))

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [clean_up_tokenization(text) for text in super().decode_batch(seqs, skip_special_tokens)]

    @functools.cached_property
    def held_ids(self) -> frozenset[int]:
        """Tokenizer's, and the ids after which the text may end in one of :data:`UNSETTLED` (those whose text within a
        sequence ends so, or could with the text before it: an empty text, "n", "'"), whose clean-up waits for the
        next token."""
        return super().held_ids | unsettled_ids(self.backend)


def unsettled_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    """The ids after which ``backend``'s decoded text (special tokens skipped) may end in one of :data:`UNSETTLED`;
    every id where no token decodes to a text to read the others after."""
    ids = range(backend.get_vocab_size(with_added_tokens=True))
    anchor = next((i for i in backend.encode(ANCHOR_TEXT, add_special_tokens=False).ids
                   if backend.decode([i]).strip()), None)
    if anchor is None:
        return frozenset(ids)
    first = backend.decode([anchor])
    suffixes = {tail[n:] for tail in UNSETTLED for n in range(len(tail) + 1)}  # "" included
    held = set()
    for i, text in zip(ids, backend.decode_batch([[anchor, i] for i in ids]), strict=True):
        within = text[len(first):] if text.startswith(first) else None  # None: read as unknown, held
        if within is None or within in suffixes or within.endswith(tuple(UNSETTLED)):
            held.add(i)
    return frozenset(held)
