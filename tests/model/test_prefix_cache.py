"""The prefix cache's store: block chains per namespace, sharing, the LRU under its budget; shared_prefixes."""

from __future__ import annotations

import torch

from model.prefix_cache import BLOCK_TOKENS, PrefixCache, shared_prefixes

LAYERS, HEADS, HEAD_DIM = 2, 3, 4
BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK_TOKENS * HEAD_DIM * 4  # float32


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def row_kv(prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (heads, len, head_dim) K/V whose every value names its layer, kind and token: a block copied
    from the wrong position, layer or kind shows."""
    ids = torch.tensor(prompt, dtype=torch.float32)[None, :, None].expand(HEADS, -1, HEAD_DIM)
    keys = [ids + 1000 * layer for layer in range(LAYERS)]
    values = [-(ids + 1000 * layer) for layer in range(LAYERS)]
    return keys, values


def store(cache: PrefixCache, prompt: list[int], namespace: str | None = None) -> None:
    cache.store_prompt(namespace, prompt, *row_kv(prompt))


def test_a_chain_holds_the_prompts_kv_block_by_block_and_leaves_the_last_token():
    cache = PrefixCache(budget_bytes=1 << 20)
    prompt = tokens(2 * BLOCK_TOKENS + 5)
    store(cache, prompt)
    assert len(cache) == 2 and cache.nbytes == 2 * BLOCK_BYTES  # the partial third block is not kept
    chain = cache.match(None, prompt)
    assert len(chain) == 2
    keys, values = row_kv(prompt[: 2 * BLOCK_TOKENS])
    joined = torch.cat([e.kv for e in chain], dim=3)
    for layer in range(LAYERS):
        assert torch.equal(joined[layer, 0], keys[layer]) and torch.equal(joined[layer, 1], values[layer])
    # A prompt that is exactly the cached blocks reuses all but the last one: its last token must be computed.
    assert cache.cached_tokens(None, prompt[: 2 * BLOCK_TOKENS]) == BLOCK_TOKENS
    assert cache.cached_tokens(None, prompt[: 2 * BLOCK_TOKENS + 1]) == 2 * BLOCK_TOKENS
    assert cache.stats.queried_tokens == len(prompt) and cache.stats.hit_tokens == 2 * BLOCK_TOKENS


def test_reuse_stops_at_the_first_different_token_and_never_crosses_namespaces():
    cache = PrefixCache(budget_bytes=1 << 20)
    prompt = tokens(3 * BLOCK_TOKENS + 1)
    store(cache, prompt)
    changed = list(prompt)
    changed[BLOCK_TOKENS + 3] = 7  # inside the second block
    assert cache.cached_tokens(None, changed) == BLOCK_TOKENS
    assert cache.cached_tokens("adapter-a", prompt) == 0
    store(cache, prompt, "adapter-a")
    assert cache.cached_tokens("adapter-a", prompt) == 3 * BLOCK_TOKENS
    assert cache.cached_tokens("adapter-b", prompt) == 0


def test_prompts_with_a_common_start_store_it_once():
    cache = PrefixCache(budget_bytes=1 << 20)
    common = tokens(2 * BLOCK_TOKENS)
    store(cache, common + tokens(BLOCK_TOKENS, start=500))
    store(cache, common + tokens(BLOCK_TOKENS, start=700))
    assert len(cache) == 4 and cache.nbytes == 4 * BLOCK_BYTES  # 2 shared + 1 each
    assert cache.cached_tokens(None, common + tokens(BLOCK_TOKENS + 1, start=700)) == 3 * BLOCK_TOKENS


def test_the_budget_evicts_least_recently_used_leaves_first():
    cache = PrefixCache(budget_bytes=3 * BLOCK_BYTES)
    a, b = tokens(2 * BLOCK_TOKENS + 1, start=100), tokens(2 * BLOCK_TOKENS + 1, start=300)
    store(cache, a)
    store(cache, b)  # its second block needs room: a's leaf, the least recently used, goes
    assert cache.nbytes <= cache.budget_bytes and len(cache) == 3
    assert cache.cached_tokens(None, b) == 2 * BLOCK_TOKENS
    assert cache.cached_tokens(None, a) == BLOCK_TOKENS  # a's root survived its leaf
    cache.match(None, a)  # a's root is now the newest: the next eviction takes b's leaf
    store(cache, tokens(BLOCK_TOKENS + 1, start=900))
    assert cache.cached_tokens(None, b) == BLOCK_TOKENS and cache.cached_tokens(None, a) == BLOCK_TOKENS


def test_an_entry_larger_than_the_budget_is_not_kept():
    cache = PrefixCache(budget_bytes=BLOCK_BYTES - 1)
    store(cache, tokens(BLOCK_TOKENS + 1))
    assert len(cache) == 0 and cache.nbytes == 0
    kv = torch.zeros(LAYERS, 2, HEADS, 40, HEAD_DIM)
    entry = cache.store_source(None, tokens(40), kv)
    assert entry.kv is kv and len(cache) == 0  # the caller still gets its K/V for this batch
    assert cache.match_source(None, tokens(40)) is None


def test_sources_match_only_identical_token_lists_under_their_namespace():
    cache = PrefixCache(budget_bytes=1 << 20)
    kv = torch.randn(LAYERS, 2, HEADS, 5, HEAD_DIM)
    cache.store_source("a", [9, 10, 11, 12, 13], kv)
    assert cache.match_source("a", [9, 10, 11, 12, 13]).kv is kv
    assert cache.match_source("a", [9, 10, 11, 12]) is None
    assert cache.match_source(None, [9, 10, 11, 12, 13]) is None
    assert cache.stats.queried_tokens == 14 and cache.stats.hit_tokens == 5


def test_shared_prefixes_lists_the_longest_common_blocks_once_per_group():
    system = tokens(2 * BLOCK_TOKENS, start=100)
    other = tokens(BLOCK_TOKENS, start=400)
    prompts = [
        system + [1, 2, 3],
        system + [4, 5],
        system[:BLOCK_TOKENS] + [6] * 20,  # shares one block with the first two: inside their longer prefix
        other + [7],
        other + [8],
        other + [9],  # under another namespace below
        tokens(40, start=600),  # shares nothing
    ]
    namespaces = [None, None, None, None, None, "a", None]
    assert sorted(shared_prefixes(prompts, namespaces)) == [(0, 2 * BLOCK_TOKENS), (3, BLOCK_TOKENS)]
    # A shared prefix leaves each row at least its last token.
    assert shared_prefixes([system, system], [None, None]) == [(0, BLOCK_TOKENS)]
    assert shared_prefixes([system[:BLOCK_TOKENS]] * 2, [None, None]) == []


def test_a_block_a_running_batch_reads_is_never_evicted():
    """Rows read cached blocks in place (model.shared_prefix): the LRU passes over a block a batch holds, evicts the
    next unused one, and keeps no new block while every other is in use; once the batch lets go, the block goes."""
    from model.shared_prefix import SharedPrefix

    cache = PrefixCache(budget_bytes=2 * BLOCK_BYTES)
    first, second = tokens(BLOCK_TOKENS + 1, start=100), tokens(BLOCK_TOKENS + 1, start=300)
    store(cache, first)
    store(cache, second)
    running = SharedPrefix.of_chains([[e.kv for e in cache.match(None, first)]])  # first's block, read in place
    cache.match(None, second)  # second's is now the most recent: first's is the LRU's next victim
    store(cache, tokens(BLOCK_TOKENS + 1, start=500))
    assert cache.cached_tokens(None, first) == BLOCK_TOKENS and cache.cached_tokens(None, second) == 0
    assert cache.nbytes == 2 * BLOCK_BYTES
    store(cache, tokens(BLOCK_TOKENS + 1, start=700))  # evicts the third; first is still read
    assert cache.cached_tokens(None, first) == BLOCK_TOKENS
    del running
    store(cache, tokens(BLOCK_TOKENS + 1, start=900))
    assert cache.cached_tokens(None, first) == 0 and cache.nbytes == 2 * BLOCK_BYTES


def test_with_every_block_in_use_a_new_one_is_not_kept():
    from model.shared_prefix import SharedPrefix

    cache = PrefixCache(budget_bytes=BLOCK_BYTES)
    prompt = tokens(BLOCK_TOKENS + 1)
    store(cache, prompt)
    running = SharedPrefix.of_chains([[e.kv for e in cache.match(None, prompt)]])
    store(cache, tokens(BLOCK_TOKENS + 1, start=300))
    assert len(cache) == 1 and cache.cached_tokens(None, prompt) == BLOCK_TOKENS and running.blocks
