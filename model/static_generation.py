"""Offline generation through a :class:`model.static_step.StaticDecoder`: the prompt (or the encoder and BOS) runs
eagerly into a KVCache as today, its rows are copied into the static buffers, and every decoding step after runs the
static step (a CUDA graph replay on CUDA). Same searches, same results as model.generation's.

What a static step does not hold decodes eagerly through model.generation (:func:`fits`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.causal_lm import CausalLM
from model.decoding import make_search
from model.generation import generate_causal, generate_seq2seq
from model.generation_config import GenerationConfig
from model.lora import AdapterSelection, use_adapters
from model.search import Hypothesis, run_search
from model.seq2seq import Seq2SeqTransformer
from model.static_step import StaticDecoder
from model.tokenizer import pad_batch


def fits(decoder: StaticDecoder, config: GenerationConfig, inputs: int, longest: int) -> bool:
    """Whether ``decoder`` holds a search of ``config`` over ``inputs`` inputs whose longest start is ``longest``
    tokens (its rows, all their positions): the model's adapters read again first (they may have changed)."""
    decoder.refresh()
    return (decoder.holds_model() and inputs * config.rows_per_input <= decoder.rows
            and longest + config.max_new_tokens <= decoder.cache.capacity)


def _per_row(adapters: AdapterSelection, inputs: int) -> list[str | None]:
    return list(adapters) if isinstance(adapters, (list, tuple)) else [adapters] * inputs


def generate_causal_static(model: CausalLM, decoder: StaticDecoder, prompts: Sequence[Sequence[int]],
                           config: GenerationConfig, adapters: AdapterSelection = None) -> list[list[Hypothesis]]:
    """:func:`model.generation.generate_causal`, its decoding steps through ``decoder``."""
    if not prompts or not fits(decoder, config, len(prompts), max(map(len, prompts))):
        return generate_causal(model, prompts, config, adapters)
    ids, lengths = (t.to(decoder.device) for t in pad_batch(prompts, model.config.pad_id))
    search = make_search(config, len(prompts), prefixes=prompts)
    with torch.inference_mode():
        with use_adapters(model, adapters):
            cache = model.new_cache(len(prompts), capacity=ids.shape[1])
            first = model.prefill(ids, lengths, cache)
        decoder.load(cache, _per_row(adapters, len(prompts)))
        return run_search(search, first, decoder.step, decoder.select)


def generate_seq2seq_static(model: Seq2SeqTransformer, decoder: StaticDecoder, sources: Sequence[Sequence[int]],
                            config: GenerationConfig, adapters: AdapterSelection = None) -> list[list[Hypothesis]]:
    """:func:`model.generation.generate_seq2seq` (no target prefixes, vocabulary maps or forced first tokens), its
    decoding steps after BOS through ``decoder``."""
    longest = max(map(len, sources), default=0)
    if not sources or longest > decoder.cache.cross.mask.shape[-1] or not fits(decoder, config, len(sources), 1):
        return generate_seq2seq(model, sources, config, adapters)
    src, _ = pad_batch(sources, model.config.pad_id)
    search = make_search(config, len(sources), prefixes=[[model.config.bos_id]] * len(sources))
    with torch.inference_mode():
        with use_adapters(model, adapters):
            first, cache = model.start(src.to(decoder.device), capacity=1)
        decoder.load(cache, _per_row(adapters, len(sources)))
        return run_search(search, first, decoder.step, decoder.select)
