"""Prefix caching in the engine: reused prompt prefixes (causal LM) and encoded sources (seq2seq) give the outputs
of decoding alone without any cache (model.generation, the reference), for greedy, beam and seeded sampling,
with and without adapters; the metrics count what was looked up and found; 0 MB turns it off; a burst's rows
read the cached blocks in place instead of copies."""

from __future__ import annotations

import asyncio

import torch

from model.checkpoint import load_checkpoint
from model.prefix_cache import BLOCK_TOKENS, PrefixCache
from service.engine.runners import DECODE_HEADROOM, CausalRunner
from tests.helpers import gather_queued
from tests.service.conftest import ADAPTERS, LM, MT, ask, assert_same, offline, running_engine

SYSTEM = "the quick brown fox jumps over the lazy dog and then the cat sat on the mat near the door, "
SUFFIXES = ["hello world", "i love this", "numbers 0 1 2 3", "what a terrible day"]
DECODINGS = [dict(max_new_tokens=8), dict(strategy="beam", num_beams=3, max_new_tokens=6),
             dict(strategy="sample", temperature=0.9, top_k=20, seed=7, max_new_tokens=8), dict(max_new_tokens=5)]


def counter(engine, name: str, model: str) -> float:
    return engine.metrics.registry.get_sample_value(name, {"model": model}) or 0.0


def prompt_tokens(engine, model: str, text: str) -> int:
    return len(engine.get(model).checkpoint.tokenizer.encode(text, add_bos=True))


def test_a_burst_sharing_a_prompt_prefix_computes_it_once_and_matches_offline(models_dir):
    prompts = [SYSTEM + s for s in SUFFIXES]

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            shared = prompt_tokens(engine, LM, SYSTEM) // BLOCK_TOKENS * BLOCK_TOKENS
            assert shared >= 2 * BLOCK_TOKENS  # the test's premise: the system prompt spans blocks
            first = await gather_queued(worker, [worker.generate(ask(p, **d), f"a{i}")
                                                 for i, (p, d) in enumerate(zip(prompts, DECODINGS, strict=True))])
            hits = counter(engine, "tserve_prefix_cache_hits_total", LM)
            queries = counter(engine, "tserve_prefix_cache_queries_total", LM)
            # One batch: the shared blocks were computed once, before it, and every row reused them.
            assert hits >= len(prompts) * (shared - BLOCK_TOKENS)
            assert queries == sum(prompt_tokens(engine, LM, p) for p in prompts)
            again = [await worker.generate(ask(p, **d), f"b{i}") for i, (p, d) in enumerate(zip(prompts, DECODINGS,
                                                                                                 strict=True))]
            assert counter(engine, "tserve_prefix_cache_hits_total", LM) - hits >= len(prompts) * shared
            assert counter(engine, "tserve_prefix_cache_bytes", LM) > 0
            return first, again

    first, again = asyncio.run(main())
    for prompt, decoding, got, repeated in zip(prompts, DECODINGS, first, again, strict=True):
        want = offline(models_dir / LM, [prompt], decoding)
        assert_same(got, want)
        assert_same(repeated, want)


def test_prefixes_are_reused_only_under_the_adapter_that_computed_them(models_dir, adapters_dir):
    adapter = ADAPTERS[LM]
    prompt = SYSTEM + "hello world"
    decoding = dict(max_new_tokens=8)

    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(LM)
            base = await worker.generate(ask(prompt, **decoding), "base")
            hits = counter(engine, "tserve_prefix_cache_hits_total", LM)
            tuned = await worker.generate(ask(prompt, adapter=adapter, **decoding), "tuned")
            assert counter(engine, "tserve_prefix_cache_hits_total", LM) == hits  # nothing of the base's reused
            mixed = await gather_queued(worker, [worker.generate(ask(prompt, adapter=adapter, **decoding), "t2"),
                                                 worker.generate(ask(prompt, **decoding), "b2")])
            assert counter(engine, "tserve_prefix_cache_hits_total", LM) > hits
            return base, tuned, mixed

    base, tuned, mixed = asyncio.run(main())
    want_base = offline(models_dir / LM, [prompt], decoding)
    want_tuned = offline(models_dir / LM, [prompt], decoding, adapters_dir / LM / adapter)
    assert want_base[0].tokens != want_tuned[0].tokens  # the premise: the adapter changes this output
    assert_same(base, want_base)
    assert_same(tuned, want_tuned)
    assert_same(mixed[0], want_tuned)
    assert_same(mixed[1], want_base)


def test_an_identical_source_reuses_its_encoding(models_dir, adapters_dir):
    source = "delete the file and open the folder"
    greedy, beam = dict(max_new_tokens=10), dict(strategy="beam", num_beams=3, max_new_tokens=10)

    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(MT)
            source_tokens = len(engine.get(MT).checkpoint.src_tokenizer.encode(source, add_eos=True))
            first = await worker.generate(ask(source, **greedy), "first")
            assert counter(engine, "tserve_prefix_cache_hits_total", MT) == 0
            # Within one batch, identical sources are encoded once (not counted as hits).
            both = await gather_queued(worker, [worker.generate(ask(source, **beam), "beam"),
                                                worker.generate(ask(source, adapter=ADAPTERS[MT], **greedy), "tuned")])
            assert counter(engine, "tserve_prefix_cache_hits_total", MT) == source_tokens  # the base row only
            return first, both

    first, (beamed, tuned) = asyncio.run(main())
    assert_same(first, offline(models_dir / MT, [source], greedy))
    assert_same(beamed, offline(models_dir / MT, [source], beam))
    assert_same(tuned, offline(models_dir / MT, [source], greedy, adapters_dir / MT / ADAPTERS[MT]))


def test_zero_megabytes_turns_prefix_caching_off(models_dir):
    prompt = SYSTEM + "hello world"

    async def main():
        async with running_engine(models_dir, None, prefix_cache_mb=0) as engine:
            worker = engine.get(LM)
            assert worker.runner.prefix_cache is None
            outputs = [await worker.generate(ask(prompt, max_new_tokens=6), f"r{i}") for i in range(2)]
            assert counter(engine, "tserve_prefix_cache_queries_total", LM) == 0
            return outputs

    outputs = asyncio.run(main())
    want = offline(models_dir / LM, [prompt], dict(max_new_tokens=6))
    for output in outputs:
        assert_same(output, want)


def test_a_bursts_rows_read_the_cached_prefix_blocks_in_place_not_copies(models_dir):
    ckpt = load_checkpoint(models_dir / LM, device="cpu")
    prompts = [ckpt.tokenizer.encode(SYSTEM + s, add_bos=True) for s in SUFFIXES]
    runner, plain = CausalRunner(ckpt.model, PrefixCache(budget_bytes=64 << 20)), CausalRunner(ckpt.model)
    with torch.no_grad():
        logits, cache = runner.prefill(prompts, [None] * len(prompts), [[] for _ in prompts])
        want, copied = plain.prefill(prompts, [None] * len(prompts), [[] for _ in prompts])
    chain = runner.prefix_cache.match(None, prompts[0], count=False)
    assert len(chain) >= 2 and cache.prefix is not None
    # Every row reads the one chain the burst computed first: the cache's own tensors, held once.
    assert [len(row) for row in cache.prefix.rows] == [len(chain)] * len(prompts)
    assert {id(block) for block in cache.prefix.blocks} == {id(entry.kv) for entry in chain}
    assert cache.capacity <= max(map(len, prompts)) - len(chain) * BLOCK_TOKENS + DECODE_HEADROOM
    assert cache.nbytes < copied.nbytes * 0.75
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_slots_that_eviction_frees_never_overwrite_a_block_a_running_batch_reads(models_dir):
    """A full cache writes new blocks into the slots evictions free (model.prefix_cache.BlockPool): the blocks a
    running batch reads in place are never among them, so after distinct prompts churned every other slot the batch
    still holds its prefix's K/V and decodes like the same rows without a cache."""
    ckpt = load_checkpoint(models_dir / LM, device="cpu")
    prompts = [ckpt.tokenizer.encode(SYSTEM + s, add_bos=True) for s in SUFFIXES[:2]]
    block_bytes = ckpt.config.n_layers * 2 * ckpt.config.d_model * BLOCK_TOKENS * 4  # fp32 K and V per layer
    spare = 3
    budget = (sum(len(p) // BLOCK_TOKENS for p in prompts) + spare) * block_bytes
    runner, plain = CausalRunner(ckpt.model, PrefixCache(budget)), CausalRunner(ckpt.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        runner.prefill(prompts, [None] * 2, [[], []])  # caches the prompts' blocks (the shared ones once)
        logits, cache = runner.prefill(prompts, [None] * 2, [[], []])  # its rows read them in place
        want_logits, want = plain.prefill(prompts, [None] * 2, [[], []])
        assert cache.prefix is not None and len(cache.prefix.blocks) >= 2
        held = [block.clone() for block in cache.prefix.blocks]
        pool = runner.prefix_cache.pool
        slabs = list(pool.slabs)
        for _ in range(2 * spare):  # distinct prompts of `spare` blocks and a token: each refills every free slot
            other = torch.randint(7, ckpt.config.vocab_size, (spare * BLOCK_TOKENS + 1,), generator=generator)
            runner.prefill([other.tolist()], [None], [[]])
        assert pool.slabs == slabs and not pool.free and pool.block_bytes == block_bytes  # slots reused, no new slab
        assert all(torch.equal(block, copy) for block, copy in zip(cache.prefix.blocks, held, strict=True))
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        tokens = logits.argmax(-1)
        for _ in range(3):
            step, want_step = runner.decode(tokens, cache), plain.decode(tokens, want)
            torch.testing.assert_close(step, want_step, rtol=1e-4, atol=1e-4)
            tokens = want_step.argmax(-1)
