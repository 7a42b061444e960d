"""Helpers shared by the model tests and the GPU path's (tests/cuda): generation prompts and an EOS-friendly head;
a KV cache filled by prefill and decoded one step at a time."""

from __future__ import annotations

import torch

from model.kv_cache import KVCache
from tests.model.conftest import random_ids

PROMPTS = [[9, 10, 11], [12, 13, 14, 15, 16, 17, 18], [19], [20, 21, 22, 23, 24]]
RAGGED_IDS = torch.tensor([[9, 10, 11, 12, 13], [14, 15, 16, 0, 0], [17, 18, 19, 20, 0]])  # right-padded
RAGGED_LENGTHS = torch.tensor([5, 3, 4])


def eos_friendly(model):
    """A large random EOS output row, so rows finish at different steps (some run to the limit)."""
    with torch.no_grad():
        head = model.lm_head.weight
        head[2] = 8 * head.std() * torch.randn(head.shape[1], generator=torch.Generator().manual_seed(3))
    return model


def decode(model, step, tokens: list[torch.Tensor], cache: KVCache) -> list[torch.Tensor]:
    """Hidden states of the decoder for each step's tokens, through ``step`` (fast or general)."""
    causal = hasattr(model, "embed")
    embed, memory_mask = (model.embed, None) if causal else (model.tgt_embed, cache.cross.mask)
    out = []
    for t in tokens:
        positions, mask = cache.begin_step(1)
        out.append(step(model.decoder, embed(t[:, None], positions), mask, cache, memory_mask))
        cache.end_step(1)
    return out


def causal_cache(model, ragged: bool) -> KVCache:
    cache = model.new_cache(3, 16)
    lengths = RAGGED_LENGTHS if ragged else torch.full((3,), 5)
    model.prefill(RAGGED_IDS if ragged else random_ids(3, 5), lengths, cache)
    return cache


def seq2seq_cache(model, ragged: bool) -> KVCache:
    src = RAGGED_IDS if ragged else random_ids(3, 5)
    _, cache = model.start(src, 16)
    return cache
