"""Model runners: the one interface the generation scheduler calls, whatever the family.

A runner prefills rows (a causal LM's prompts, a translator's sources) into logits for their first new token
and a KV cache, decodes one step for the running rows, and knows the family's limits: how many input tokens
it takes, how many new tokens fit after an input, and which tokens a search's output continues (what
``no_repeat_ngram_size`` counts). The scheduler only schedules.

With a prefix cache (model.prefix_cache) a prefill reuses what earlier or running requests computed: a causal
LM's rows start from their prompts' longest cached block chains, which they read in place for as long as they
run (model.shared_prefix), and compute only the rest (prefixes that several rows of the batch share are computed
once first); a translator's rows reuse identical sources' cross-attention K/V and encode only the others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from model.causal_lm import CausalLM
from model.kv_cache import CrossAttentionMemory, KVCache
from model.lora import use_adapters
from model.prefix_cache import BLOCK_TOKENS, Entry, PrefixCache, shared_prefixes
from model.restricted_vocab import VocabularyRestriction
from model.seq2seq import Seq2SeqTransformer
from model.shared_prefix import SharedPrefix
from model.tokenizer import pad_batch
from model.vocab_map import AnyVocabularyMap, target_languages

# Cache positions a prefill reserves for new tokens; the cache grows by itself beyond them (KVCache.begin_step).
DECODE_HEADROOM = 16


class GenerationRunner(ABC):
    """Prefill and decode for one generative model (on its device)."""

    family: str

    def __init__(self, model: CausalLM | Seq2SeqTransformer, prefix_cache: PrefixCache | None = None,
                 draft_model: CausalLM | None = None, vocab_map: AnyVocabularyMap | None = None) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.prefix_cache = prefix_cache
        self.draft_model = draft_model  # drafts for speculative method draft_model (model.speculative)
        self.vocab_map = vocab_map  # a translator's candidate target tokens per source (per language: model.vocab_map)

    @property
    @abstractmethod
    def max_input_tokens(self) -> int:
        """Most tokens one input may have."""

    @abstractmethod
    def room(self, input_tokens: int) -> int:
        """Most new tokens that fit after an input of ``input_tokens`` tokens."""

    @abstractmethod
    def prefixes(self, inputs: list[list[int]], targets: list[list[int]]) -> list[list[int]]:
        """The tokens each input's output continues (``targets``: a translation's target prefixes, else empty)."""

    @abstractmethod
    def prefill(self, inputs: list[list[int]], adapters: Sequence[str | None], targets: list[list[int]],
                vocabulary: VocabularyRestriction | None = None) -> tuple[torch.Tensor, KVCache]:
        """(rows, V) logits of every input's first new token, and the rows' cache. ``adapters``: each row's adapter
        (None: the base model), which the model is already set to; a prefix is reused only under the same one.
        ``targets``: per row, a translation's target prefix to continue (empty lists for a causal LM).
        ``vocabulary``: the rows' target vocabularies (:meth:`vocabulary`), or None."""

    def vocabulary(self, inputs: list[list[int]], restricted: Sequence[bool], targets: Sequence[Sequence[int]] | None
                   = None, forced: Sequence[int | None] | None = None) -> VocabularyRestriction | None:
        """The rows' target vocabularies: the map's candidates of each restricted row's source; None if no row is.
        Per-language maps pick each row's by the token its translation starts with (model.vocab_map.target_languages:
        its ``forced`` first token, else its target prefix's first, from ``targets``)."""
        if not any(restricted):
            return None
        if self.vocab_map is None:
            raise ValueError("this model has no vocabulary map")
        return VocabularyRestriction.of_sources(self.vocab_map, inputs, self.config.vocab_size, self.device,
                                                restricted, target_languages(forced, targets, len(inputs)))

    def decode(self, tokens: torch.Tensor, cache: KVCache, vocabulary: VocabularyRestriction | None = None
               ) -> torch.Tensor:
        """(rows, V) logits of the next token after ``tokens`` (rows,), appended to ``cache``; ``vocabulary``: the
        rows' target vocabularies (a translator's only: a causal LM's prefill refuses them)."""
        return self.model.decode_step(tokens, cache)

    def verify(self, tokens: torch.Tensor, cache: KVCache, vocabulary: VocabularyRestriction | None = None
               ) -> torch.Tensor:
        """(rows, t, V) logits after each of ``tokens`` (rows, t): the fed token and a draft (model.speculative);
        the cache keeps all t positions until it is truncated."""
        return self.model.verify_step(tokens, cache)

    @abstractmethod
    def draft_source(self, input_ids: list[int], target: list[int]) -> list[int]:
        """The tokens an n-gram drafter starts from, before the output's own (in the output's vocabulary)."""

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

    def prefixes(self, inputs: list[list[int]], targets: list[list[int]]) -> list[list[int]]:
        return inputs

    def draft_source(self, input_ids: list[int], target: list[int]) -> list[int]:
        return list(input_ids)

    def prefill(self, inputs: list[list[int]], adapters: Sequence[str | None], targets: list[list[int]],
                vocabulary: VocabularyRestriction | None = None) -> tuple[torch.Tensor, KVCache]:
        if any(targets) or vocabulary is not None:
            raise ValueError("a causal LM continues its prompt: target prefixes and vocabulary maps are for seq2seq")
        if self.prefix_cache is None:
            return self._prefill(inputs, [[] for _ in inputs])
        self._prefill_shared(inputs, adapters)
        chains = self._reused(inputs, adapters, count=True)
        logits, cache = self._prefill(inputs, chains)
        self._store(inputs, adapters, cache)
        return logits, cache

    def _prefill(self, inputs: list[list[int]], chains: list[list[Entry]]) -> tuple[torch.Tensor, KVCache]:
        """Prefill each input after the cached blocks of its chain (read in place), or from the start ([])."""
        reused = [len(chain) * BLOCK_TOKENS for chain in chains]
        ids, lengths = self._padded([tokens[n:] for tokens, n in zip(inputs, reused, strict=True)])
        cache = self.model.new_cache(len(inputs), capacity=ids.shape[1] + DECODE_HEADROOM)
        cache.prefix = SharedPrefix.of_chains([[entry.kv for entry in chain] for chain in chains])
        return self.model.prefill(ids, lengths, cache), cache

    def _reused(self, inputs: list[list[int]], adapters: Sequence[str | None], count: bool) -> list[list[Entry]]:
        """Each input's longest chain of cached blocks ([] when nothing is cached)."""
        return [self.prefix_cache.match(adapter, tokens, count=count)
                for tokens, adapter in zip(inputs, adapters, strict=True)]

    def _prefill_shared(self, inputs: list[list[int]], adapters: Sequence[str | None]) -> None:
        """Compute and cache, once, the prefixes several rows share that the cache lacks."""
        wanted = [(list(inputs[row][:n]), adapters[row]) for row, n in shared_prefixes(inputs, adapters)
                  if self.prefix_cache.cached_tokens(adapters[row], inputs[row]) < n]
        if not wanted:
            return
        prompts, names = [p for p, _ in wanted], [a for _, a in wanted]
        with use_adapters(self.model, _selection(names)):
            _, cache = self._prefill(prompts, self._reused(prompts, names, count=False))
        self._store(prompts, names, cache)

    def _store(self, inputs: list[list[int]], adapters: Sequence[str | None], cache: KVCache) -> None:
        """Keep the prompts' new full blocks (the rows' own buffers start after the prefix each read)."""
        offsets = cache.prefix.lengths.tolist() if cache.prefix is not None else [0] * len(inputs)
        for row, (tokens, adapter) in enumerate(zip(inputs, adapters, strict=True)):
            keys, values = [k[row] for k in cache.keys], [v[row] for v in cache.values]
            self.prefix_cache.store_prompt(adapter, tokens, keys, values, offset=offsets[row])


class Seq2SeqRunner(GenerationRunner):
    """An encoder-decoder: sources are encoded, and outputs start from the decoder's start token."""

    family = "seq2seq"

    @property
    def max_input_tokens(self) -> int:
        return self.config.max_src_len

    def room(self, input_tokens: int) -> int:
        return self.config.max_len - 1  # the decoder start token takes one position

    def prefixes(self, inputs: list[list[int]], targets: list[list[int]]) -> list[list[int]]:
        return [[self.config.bos_id, *t] for t in targets]

    def draft_source(self, input_ids: list[int], target: list[int]) -> list[int]:
        """The source too where it shares the target's vocabulary (names, numbers, placeholders are copied)."""
        source = list(input_ids) if self.config.src_vocab_size is None else []
        return [*source, self.config.bos_id, *target]

    def prefill(self, inputs: list[list[int]], adapters: Sequence[str | None], targets: list[list[int]],
                vocabulary: VocabularyRestriction | None = None) -> tuple[torch.Tensor, KVCache]:
        capacity = DECODE_HEADROOM + max(map(len, targets))
        if self.prefix_cache is None:
            ids, _ = self._padded(inputs)
            return self.model.start(ids, capacity=capacity, targets=targets, vocabulary=vocabulary)
        entries = [self.prefix_cache.match_source(a, tokens) for tokens, a in zip(inputs, adapters, strict=True)]
        missing: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}  # identical sources are encoded once
        for row, entry in enumerate(entries):
            if entry is None:
                missing.setdefault((adapters[row], tuple(inputs[row])), []).append(row)
        if missing:
            for entry, rows in zip(self._encode(list(missing)), missing.values(), strict=True):
                for row in rows:
                    entries[row] = entry
        cache = self.model.cache_for(CrossAttentionMemory.of_sources([e.kv for e in entries]), capacity)
        return self.model.start_from(cache, targets, vocabulary)

    def decode(self, tokens: torch.Tensor, cache: KVCache, vocabulary: VocabularyRestriction | None = None
               ) -> torch.Tensor:
        return self.model.decode_step(tokens, cache, vocabulary)

    def verify(self, tokens: torch.Tensor, cache: KVCache, vocabulary: VocabularyRestriction | None = None
               ) -> torch.Tensor:
        return self.model.verify_step(tokens, cache, vocabulary)

    def _encode(self, sources: list[tuple[str | None, tuple[int, ...]]]) -> list[Entry]:
        """Encode (adapter, source) pairs in one batch and cache each one's cross-attention K/V."""
        with use_adapters(self.model, _selection([a for a, _ in sources])):
            ids, _ = self._padded([list(tokens) for _, tokens in sources])
            memory, _, _ = self.model.encode(ids)
            keys, values = self.model.cross_kv(memory)
        entries = []
        for row, (adapter, tokens) in enumerate(sources):
            kv = torch.stack([torch.stack((k[row, :, : len(tokens)], v[row, :, : len(tokens)]))
                              for k, v in zip(keys, values, strict=True)])
            entries.append(self.prefix_cache.store_source(adapter, tokens, kv))
        return entries


def _selection(adapters: Sequence[str | None]) -> list[str | None] | None:
    """The per-row adapter selection for ``adapters`` (None when every row runs the base model)."""
    return list(adapters) if any(a is not None for a in adapters) else None


RUNNERS: dict[str, type[GenerationRunner]] = {"causal_lm": CausalRunner, "seq2seq": Seq2SeqRunner}
