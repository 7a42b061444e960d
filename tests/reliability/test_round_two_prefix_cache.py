"""Issue 33, item 7: a workload of distinct prompts, which the prefix cache can never serve, must not cost everyone.

The attack (100 s of distinct ~860-token prompts at a tiny random LM) served 3x fewer requests with the cache on,
and the server's RSS grew ~2.5x the budget. Both had one cause per stored block: eviction copied the whole LRU
into a list to take its oldest entry (each of a prompt's ~53 blocks rehashed every key), and every block was its
own small allocation made between a prefill's temporaries (fragmenting the heap). Now a block is copied once into a
slot of the cache's block pool, and eviction looks at the oldest entry only, so a full cache allocates nothing.
These tests count that against a real server; the speed and RSS are measured by ``python -m
benchmarks.prefix_cache --distinct`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from model.causal_lm import CausalLM
from model.checkpoint import save_checkpoint
from model.config import CausalLMConfig
from model.prefix_cache import BLOCK_TOKENS, SLAB_BYTES, PrefixCache
from model.tokenizer import Tokenizer
from tests.reliability.helpers import inprocess_server

MODEL = "distinct-lm"
PROMPT_TOKENS = 860  # the attack's prompts, in a model of 1024 positions
BUDGET_MB = 1.0  # a 16 KiB block each: 64 blocks, a prompt and a bit


@pytest.fixture(scope="module")
def distinct_lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer]:
    """A tiny random-weight causal LM of 1024 positions (the attack's kind of model) and its tokenizer."""
    models = tmp_path_factory.mktemp("distinct") / "models"
    texts = [Path(module.__file__).read_text() for module in (os, argparse)]
    tokenizer = Tokenizer.train(texts, vocab_size=600)
    torch.manual_seed(0)
    config = CausalLMConfig(d_model=64, n_heads=4, d_ff=128, n_layers=2, vocab_size=tokenizer.vocab_size,
                            max_len=1024, dropout=0.0)
    save_checkpoint(models / MODEL, CausalLM(config).eval(), tokenizer)
    return models, tokenizer


def distinct_prompts(tokenizer: Tokenizer, count: int) -> list[str]:
    """``count`` prompts of about PROMPT_TOKENS tokens that share no block: each starts with its own number."""
    ids = tokenizer.encode(" ".join(Path(argparse.__file__).read_text().split()))
    body = tokenizer.decode(ids[: PROMPT_TOKENS - 8])
    return [f"{i:06d} {body}" for i in range(count)]


class CountingEntries(OrderedDict):
    """The cache's LRU, counting the entries its eviction looks at (through ``items()``)."""

    visited = 0

    def items(self):  # noqa: ANN201 (an OrderedDict's items view, as a generator)
        for item in super().items():
            self.visited += 1
            yield item


def held_storages(store: PrefixCache) -> dict[int, int]:
    """Bytes of each storage the cache's entries keep alive (a view keeps its whole storage), by data pointer."""
    return {entry.kv.untyped_storage().data_ptr(): entry.kv.untyped_storage().nbytes()
            for entry in store._entries.values()}


def test_distinct_prompts_cycle_through_one_pool_within_the_budget_and_evict_in_constant_work(distinct_lm):
    models, tokenizer = distinct_lm
    budget = int(BUDGET_MB * 2**20)
    prompts = distinct_prompts(tokenizer, 12)
    blocks = [(len(tokenizer.encode(p)) + 1) // BLOCK_TOKENS for p in prompts]  # full blocks, BOS included
    with inprocess_server(models, prefix_cache_mb=BUDGET_MB) as server, server.client(timeout=300) as client:
        def serve(texts: list[str], new_tokens: int = 1) -> list[str]:
            out = []
            for text in texts:  # one at a time: the cache is idle between requests, so the test may read it
                response = client.post(f"/v1/models/{MODEL}/generate", json={"inputs": [text],
                                                                             "max_new_tokens": new_tokens})
                assert response.status_code == 200, response.text
                out.append(response.json()["outputs"][0]["text"])
            return out

        store = server.engine.get(MODEL).runner.prefix_cache
        serve(prompts[:3])  # about 2.5 budgets of blocks: the cache is full
        kept = held_storages(store)
        assert len(store) == budget // (16 << 10)  # 2 layers x K, V x 64 dims x 16 positions x 4 bytes a block
        assert store.nbytes <= budget and sum(kept.values()) <= budget
        # Its blocks live in a slab or a few, not one allocation per block (64 of them, among a prefill's temporaries).
        assert len(kept) <= math.ceil(budget / SLAB_BYTES)

        store._entries = CountingEntries(store._entries)
        serve(prompts[3:-1])  # eight more budgets' worth of new blocks
        # Every new block went into a slot an eviction freed (nothing allocated), and each eviction looked at the
        # oldest entry only: at most one entry per stored block (the whole LRU per block before).
        assert held_storages(store) == kept and store.nbytes <= budget
        assert store._entries.visited <= sum(blocks[3:-1])
        assert server.metric("tserve_prefix_cache_hits_total") == 0  # distinct: nothing to reuse

        # Reused slots hold the right K/V: a prompt seen again reuses its blocks and continues as it did the first
        # time (computed without the cache's help).
        fresh, again = serve(prompts[-1:], 8), serve(prompts[-1:], 8)
        assert server.metric("tserve_prefix_cache_hits_total") >= (blocks[-1] - 1) * BLOCK_TOKENS
        assert again == fresh
