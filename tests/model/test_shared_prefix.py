"""Rows that read cached prompt blocks in place (model.shared_prefix) against full forwards of their whole
sequences: the prefill of the rest, decoding and verification steps (our kernel and the PyTorch path), rows
dropped, reordered and joined; and the blocks are the prefix cache's own tensors, not copies."""

from __future__ import annotations

import pytest
import torch

from model.kv_cache import KVCache
from model.prefix_cache import BLOCK_TOKENS, PrefixCache
from model.shared_prefix import SharedPrefix
from tests.model.conftest import tiny_causal_lm


def full_logits(model, sequence: list[int]) -> torch.Tensor:
    """The next-token logits after ``sequence``, from a forward of all of it (no cache)."""
    return model(torch.tensor([sequence]))[0, -1]


def assert_rows_continue(model, logits: torch.Tensor, sequences: list[list[int]]) -> None:
    for row, sequence in enumerate(sequences):
        torch.testing.assert_close(logits[row], full_logits(model, sequence), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decode_kernels", [True, False])
def test_rows_read_cached_blocks_in_place_and_continue_like_their_whole_prompts(kernel_options, decode_kernels):
    kernel_options(decode_kernels=decode_kernels)
    model = tiny_causal_lm(max_len=128)
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(7, 40, (2 * BLOCK_TOKENS + 6,), generator=generator).tolist()
    second = first[:BLOCK_TOKENS] + torch.randint(7, 40, (5,), generator=generator).tolist()  # shares block 0
    third = torch.randint(7, 40, (9,), generator=generator).tolist()  # nothing cached
    store = PrefixCache(budget_bytes=1 << 20)
    with torch.no_grad():
        whole = model.new_cache(1, capacity=64)
        model.prefill(torch.tensor([first]), torch.tensor([len(first)]), whole)
        store.store_prompt(None, first, [k[0] for k in whole.keys], [v[0] for v in whole.values])
        prompts = [first, second, third]
        chains = [store.match(None, prompt) for prompt in prompts]
        assert [len(c) for c in chains] == [2, 1, 0]
        cache = model.new_cache(3, capacity=24)
        cache.prefix = SharedPrefix.of_chains([[entry.kv for entry in chain] for chain in chains])
        # Shared, not copied: the batch's blocks are the cache's tensors, each once; the rows' buffers hold
        # only what follows their prefixes.
        assert len(cache.prefix.blocks) == 2
        assert all(any(block is entry.kv for entry in chains[0]) for block in cache.prefix.blocks)
        rests = [prompt[len(chain) * BLOCK_TOKENS:] for prompt, chain in zip(prompts, chains, strict=True)]
        ids = torch.zeros(3, max(map(len, rests)), dtype=torch.long)
        for row, rest in enumerate(rests):
            ids[row, : len(rest)] = torch.tensor(rest)
        logits = model.prefill(ids, torch.tensor([len(r) for r in rests]), cache)
        assert cache.capacity < len(first) and cache.lengths.tolist() == [6, 5, 9]
        assert_rows_continue(model, logits, prompts)

        sequences = [list(p) for p in prompts]
        for step in range(3):  # decoding steps
            fed = torch.tensor([11 + step, 20 + step, 30 + step])
            for row, token in enumerate(fed.tolist()):
                sequences[row].append(token)
            assert_rows_continue(model, model.decode_step(fed, cache), sequences)

        drafts = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])  # a verification step: 3 tokens per row
        verified = model.verify_step(drafts, cache)
        for row, draft in enumerate(drafts.tolist()):
            for i in range(3):
                torch.testing.assert_close(verified[row, i], full_logits(model, sequences[row] + draft[: i + 1]),
                                           rtol=1e-4, atol=1e-4)
        cache.truncate(cache.lengths - 2)  # keep one draft token per row
        sequences = [s + d[:1] for s, d in zip(sequences, drafts.tolist(), strict=True)]

        cache.select(torch.tensor([2, 0]))  # the second row leaves, the others swap
        sequences = [sequences[2], sequences[0]]
        assert len(cache.prefix.blocks) == 2 and cache.prefix.rows == ((), (0, 1))
        joined = model.new_cache(1, capacity=8)
        newcomer = torch.randint(7, 40, (4,), generator=generator).tolist()
        model.prefill(torch.tensor([newcomer]), torch.tensor([4]), joined)
        cache = KVCache.concat([cache, joined])
        sequences.append(newcomer)
        fed = torch.tensor([3, 4, 5])
        sequences = [s + [t] for s, t in zip(sequences, fed.tolist(), strict=True)]
        assert_rows_continue(model, model.decode_step(fed, cache), sequences)


def test_a_prefix_lists_shared_blocks_once_and_lets_go_of_unread_ones():
    a, b, c = (torch.full((1, 2, 1, BLOCK_TOKENS, 2), float(i)) for i in range(3))
    prefix = SharedPrefix.of_chains([[a, b], [], [a], [c]])
    assert prefix.rows == ((0, 1), (), (0,), (2,)) and len(prefix.blocks) == 3
    assert prefix.lengths.tolist() == [2 * BLOCK_TOKENS, 0, BLOCK_TOKENS, BLOCK_TOKENS]
    assert prefix.table.tolist() == [[0, 1], [-1, -1], [0, -1], [2, -1]]
    assert [(g.chain, g.rows) for g in prefix.groups] == [((0, 1), (0,)), ((), (1,)), ((0,), (2,)), ((2,), (3,))]
    assert torch.equal(prefix.values(0, (0, 1)), torch.cat([a[0, 1], b[0, 1]], dim=1))  # a chain's blocks in order
    kept = prefix.select(torch.tensor([2, 2]))
    assert kept.blocks == (a,) and len(kept.groups) == 1  # c and b are no longer referenced
    assert kept.groups[0].index == slice(0, 2)
    assert prefix.select(torch.tensor([1])) is None
    joined = SharedPrefix.concat([None, kept], [2, 2])
    assert joined.rows == ((), (), (0,), (0,)) and joined.blocks[0] is a
