"""A KV cache of 2 MB or more keeps every layer's K and V as views of one mapping on 2 MB pages
(model.huge_pages.buffers): each view behaves as a buffer of its own, and growth, joins and row selections keep
the contents and make a new mapping of views."""

import mmap

import pytest
import torch

from model.huge_pages import HUGE_PAGE
from model.kv_cache import KVCache
from model.static_cache import StaticKVCache

LAYERS, HEADS, DIM = 3, 2, 64  # a row of 1,024 positions: 3 x 2 x 2 x 1,024 x 64 x 4 B = 3 MB


def _big(batch: int = 1, capacity: int = 1024) -> KVCache:
    cache = KVCache.empty(LAYERS, batch, HEADS, DIM, capacity, "cpu", torch.float32)
    assert sum(t.nbytes for t in cache.keys + cache.values) >= HUGE_PAGE
    return cache


def _fill(cache: KVCache) -> list[torch.Tensor]:
    """Every buffer of ``cache`` filled with values of its own; returns copies of them."""
    for i, buffer in enumerate(cache.keys + cache.values):
        buffer.copy_(torch.randn(buffer.shape) + 10 * i)
    return [b.clone() for b in cache.keys + cache.values]


def _one_disjoint_mapping(buffers: list[torch.Tensor]) -> None:
    """The buffers lie back to back in one block of memory (2 MB-aligned where the OS takes the advice), none
    overlapping another."""
    starts = sorted((b.data_ptr(), b.nbytes) for b in buffers)
    assert starts[0][0] % HUGE_PAGE == 0 or not hasattr(mmap, "MADV_HUGEPAGE")
    for (start, size), (following, _) in zip(starts, starts[1:], strict=False):
        assert start + size == following
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == 1


def test_a_large_cache_is_one_zeroed_mapping_of_separate_buffers():
    cache = _big()
    buffers = cache.keys + cache.values
    _one_disjoint_mapping(buffers)
    assert all(b.is_contiguous() and not b.any() for b in buffers)
    expected = _fill(cache)
    positions, _ = cache.begin_step(5)
    k, v = torch.randn(1, HEADS, 5, DIM), torch.randn(1, HEADS, 5, DIM)
    cache.write(1, k, v)  # layer 1 only
    expected[1][:, :, :5], expected[LAYERS + 1][:, :, :5] = k, v
    for buffer, want in zip(buffers, expected, strict=True):
        assert torch.equal(buffer, want)


def test_growth_keeps_the_contents_in_a_new_mapping():
    cache = _big(capacity=1024)
    before = _fill(cache)
    cache.max_length = 1024
    cache._reserve(1030)  # past the capacity: grown by GROWTH
    buffers = cache.keys + cache.values
    _one_disjoint_mapping(buffers)
    for buffer, old in zip(buffers, before, strict=True):
        assert buffer.shape[2] == 1024 + 64
        assert torch.equal(buffer[:, :, :1024], old)
        assert not buffer[:, :, 1024:].any()


def test_a_shrunk_cache_keeps_its_first_positions_in_a_new_mapping():
    """The engine's compaction (service.engine.batch.compact) after long rows left keeps the cache on its pages."""
    cache = _big(capacity=2048)
    before = _fill(cache)
    cache.resize(1500)
    buffers = cache.keys + cache.values
    _one_disjoint_mapping(buffers)
    for buffer, old in zip(buffers, before, strict=True):
        assert buffer.shape[2] == 1500 and torch.equal(buffer, old[:, :, :1500])


def test_selected_rows_keep_their_used_positions_and_a_zeroed_tail_in_a_new_mapping():
    cache = _big(batch=3)
    before = _fill(cache)
    cache.max_length, cache.uniform = 700, False
    index = torch.tensor([2, 0])
    cache.select(index)
    buffers = cache.keys + cache.values
    _one_disjoint_mapping(buffers)
    for buffer, old in zip(buffers, before, strict=True):
        assert torch.equal(buffer[:, :, :700], old[index, :, :700])
        assert not buffer[:, :, 700:].any()


def test_joined_caches_stack_their_rows_zero_padded_in_a_new_mapping():
    short, long = _big(batch=1, capacity=900), _big(batch=2, capacity=1024)
    first, second = _fill(short), _fill(long)
    joined = KVCache.concat([short, long])
    buffers = joined.keys + joined.values
    _one_disjoint_mapping(buffers)
    for buffer, a, b in zip(buffers, first, second, strict=True):
        assert buffer.shape == (3, HEADS, 1024, DIM)
        assert torch.equal(buffer[:1, :, :900], a)
        assert not buffer[:1, :, 900:].any()
        assert torch.equal(buffer[1:], b)


@pytest.mark.parametrize("capacity", [1, 64])
def test_a_small_cache_keeps_tensors_of_its_own(capacity):
    """Under 2 MB in all no huge page fits: ordinary zeroed tensors, one storage each."""
    cache = KVCache.empty(LAYERS, 1, HEADS, DIM, capacity, "cpu", torch.float32)
    buffers = cache.keys + cache.values
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == len(buffers)
    assert not any(b.any() for b in buffers)


def test_a_static_cache_is_one_mapping_whose_row_views_stay_separate():
    cache = StaticKVCache.allocate(LAYERS, 2, HEADS, DIM, 1024, "cpu", torch.float32)
    _one_disjoint_mapping(cache.keys + cache.values)
    expected = _fill(cache)
    view = cache.view(1)
    view.values[0].fill_(-1.0)  # row 0 of layer 0's V, through the smaller batch's view
    expected[LAYERS][:1] = -1.0
    for buffer, want in zip(cache.keys + cache.values, expected, strict=True):
        assert torch.equal(buffer, want)
