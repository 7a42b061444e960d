"""Decoding steps at a few rows: grouped-query attention read once per KV head (decode_attention.cpp) and the int8
weights' huge-page arena (model/int8_kernel.py)."""

import pytest
import torch

from model import int8_kernel, native

kernel = native.kernels()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the C++ decode-attention kernel does not run here")


def _reference(q, k, v, mask):
    """float64 attention with each KV head repeated for its query heads; mask bool (True = attend) or float (added)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return scores.softmax(-1) @ v


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("b", "h", "kv", "tq", "t", "dh", "mask"),
                         [(1, 9, 3, 1, 544, 64, None), (4, 14, 2, 1, 70, 64, "bool"), (3, 8, 2, 4, 40, 64, "float"),
                          (2, 6, 3, 2, 100, 80, "bool"), (8, 4, 1, 1, 17, 128, None), (2, 4, 2, 3, 16, 50, "bool"),
                          (3, 6, 3, 1, 15, 32, "float"), (4, 6, 3, 1, 0, 64, None), (2, 6, 2, 1, 37, 40, "bool")])
def test_query_heads_of_one_kv_head_read_it_together(threads, b, h, kv, tq, t, dh, mask):
    """The query heads of a KV head, scored 16 keys at a time and summed together, give the floats each head alone
    gives (its K/V repeated: one query head per KV head), and match float64."""
    torch.manual_seed(t + dh)
    q = torch.randn(b, h, tq, dh)
    k, v = (torch.randn(b, kv, t + 5, dh)[:, :, :t] for _ in range(2))  # cache slices: rows t + 5 apart
    m = {None: None, "bool": torch.rand(b, 1, tq, t) > 0.3, "float": torch.randn(b, h, tq, t)}[mask]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        grouped = kernel.decode_attention(q, k, v, m, [], None, 0)
        alone = kernel.decode_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1), m, [],
                                        None, 0)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(grouped, alone)
    if t:
        torch.testing.assert_close(grouped.double(), _reference(q, k, v, m), rtol=1e-5, atol=1e-5)
    else:
        assert not grouped.any()  # nothing to attend to: zeros


def test_packed_weights_share_aligned_huge_page_mappings():
    """An arena places each weight on a cache line of a 2 MB-aligned mapping, one after another, and a weight keeps
    its mapping alive after the arena is gone; pack() uses one only inside huge_pages() (a model's quantisation)."""
    arena = int8_kernel.HugePageArena()
    first, second = arena.take((3, 10, 16, 4)), arena.take((1, 5, 16, 4))
    assert first.data_ptr() % (2 << 20) == 0 and second.data_ptr() == first.data_ptr() + first.numel()
    assert first.is_contiguous() and second.shape == (1, 5, 16, 4)
    big = arena.take((arena.CHUNK + 1,))  # a mapping of its own
    assert big.numel() == arena.CHUNK + 1 and big.data_ptr() % (2 << 20) == 0
    q = torch.randint(-127, 128, (37, 70), dtype=torch.int8)
    with int8_kernel.huge_pages():
        inside, after = int8_kernel.pack(q), int8_kernel.pack(q)
    outside = int8_kernel.pack(q)
    del arena
    assert inside.data_ptr() % (2 << 20) == 0 and after.data_ptr() == inside.data_ptr() + inside.numel()
    assert outside.untyped_storage().nbytes() == outside.numel()  # a storage of its own, not a view of a mapping
    for packed in (inside, after, outside):
        assert torch.equal(int8_kernel.unpack(packed, 37, 70), q)
