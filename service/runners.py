"""Model runners: the one interface the generation scheduler calls, whatever the family.

A runner prefills rows (a causal LM's prompts, a translator's sources) into logits for their first new token
and a KV cache, decodes one step for the running rows, and knows the family's limits: how many input tokens
it takes, how many new tokens fit after an input, and which tokens a search's output continues (what
``no_repeat_ngram_size`` counts). The scheduler only schedules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from model.causal_lm import CausalLM
from model.kv_cache import KVCache
from model.seq2seq import Seq2SeqTransformer
from model.tokenizer import pad_batch

# Cache positions a prefill reserves for new tokens; the cache grows by itself beyond them (KVCache.begin_step).
DECODE_HEADROOM = 16


class GenerationRunner(ABC):
    """Prefill and decode for one generative model (on its device)."""

    family: str

    def __init__(self, model: CausalLM | Seq2SeqTransformer) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device

    @property
    @abstractmethod
    def max_input_tokens(self) -> int:
        """Most tokens one input may have."""

    @abstractmethod
    def room(self, input_tokens: int) -> int:
        """Most new tokens that fit after an input of ``input_tokens`` tokens."""

    @abstractmethod
    def prefixes(self, inputs: list[list[int]]) -> list[list[int]]:
        """The tokens each input's output continues."""

    @abstractmethod
    def prefill(self, inputs: list[list[int]]) -> tuple[torch.Tensor, KVCache]:
        """(rows, V) logits of every input's first new token, and the rows' cache."""

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """(rows, V) logits of the next token after ``tokens`` (rows,), appended to ``cache``."""
        return self.model.decode_step(tokens, cache)

    def _padded(self, inputs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, lengths = pad_batch(inputs, self.config.pad_id)
        return ids.to(self.device), lengths.to(self.device)


class CausalRunner(GenerationRunner):
    """A decoder-only LM: prompts are prefilled, and outputs continue them within max_len."""

    family = "causal_lm"

    @property
    def max_input_tokens(self) -> int:
        return self.config.max_len - 1  # room for one new token

    def room(self, input_tokens: int) -> int:
        return self.config.max_len - input_tokens

    def prefixes(self, inputs: list[list[int]]) -> list[list[int]]:
        return inputs

    def prefill(self, inputs: list[list[int]]) -> tuple[torch.Tensor, KVCache]:
        ids, lengths = self._padded(inputs)
        cache = self.model.new_cache(len(inputs), capacity=ids.shape[1] + DECODE_HEADROOM)
        return self.model.prefill(ids, lengths, cache), cache


class Seq2SeqRunner(GenerationRunner):
    """An encoder-decoder: sources are encoded, and outputs start from the decoder's start token."""

    family = "seq2seq"

    @property
    def max_input_tokens(self) -> int:
        return self.config.max_src_len

    def room(self, input_tokens: int) -> int:
        return self.config.max_len - 1  # the decoder start token takes one position

    def prefixes(self, inputs: list[list[int]]) -> list[list[int]]:
        return [[self.config.bos_id] for _ in inputs]

    def prefill(self, inputs: list[list[int]]) -> tuple[torch.Tensor, KVCache]:
        ids, _ = self._padded(inputs)
        return self.model.start(ids, capacity=DECODE_HEADROOM)


RUNNERS: dict[str, type[GenerationRunner]] = {"causal_lm": CausalRunner, "seq2seq": Seq2SeqRunner}
