"""A T5 decoding step's parts: the relative position bias looked up in a table of relative positions
(model/relative_position.py) and the decode attention over cache slices (decode_attention.cpp's prefetches stay
within the keys of each unit)."""

import pytest
import torch

from model import native
from model.kv_cache import KVCache
from model.relative_position import RelativePositionBias

kernel = native.kernels()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the C++ decode-attention kernel does not run here")


def _buckets_bias(bias: RelativePositionBias, queries: torch.Tensor, keys: int) -> torch.Tensor:
    """The bias through the buckets of each position (the autograd path), detached."""
    with torch.enable_grad():
        return bias(queries, keys).detach()


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
def test_the_table_of_relative_positions_gives_the_buckets_floats(bidirectional):
    """Inference looks the bias up in a table of relative positions (grown as positions pass it): the floats of the
    buckets at every query and key position, near and past the far bucket, laid out contiguously along the keys."""
    torch.manual_seed(0)
    bias = RelativePositionBias(32, 128, 6, bidirectional)
    for keys in (1, 2, 16, 33, 64, 65, 130, 700):
        for queries in (torch.tensor([[keys - 1]]), torch.arange(keys)[None], torch.tensor([[0], [keys - 1]])):
            with torch.no_grad():
                got = bias(queries, keys)
            assert torch.equal(got, _buckets_bias(bias, queries, keys)) and got.stride(-1) == 1


def test_a_decoding_step_slices_the_table_and_follows_the_weight():
    """A decoding step's bias (uniform rows, one token) is a slice of the table: the mask LayerStack.forward would
    build, at every position; an in-place change of the weight (load_state_dict) builds the table again."""
    torch.manual_seed(1)
    bias = RelativePositionBias(32, 128, 4, bidirectional=False)
    cache = KVCache.empty(1, 2, 4, 8, 80, "cpu", torch.float32)
    for _ in range(75):
        cache.begin_step(1)
        with torch.inference_mode():
            got = bias.attention_mask(None, 1, cache)
        with torch.enable_grad():
            expected = bias.attention_mask(None, 1, cache).detach()
        assert torch.equal(got, expected) and got.shape == (1, 4, 1, cache.max_length + 1)
        cache.end_step(1)
    bias.load_state_dict({"embedding.weight": torch.randn(32, 4)})
    cache.begin_step(1)
    with torch.no_grad():
        assert torch.equal(bias.attention_mask(None, 1, cache), _buckets_bias(bias, cache.write_positions[:1], 76))


def test_a_bias_made_under_inference_mode_follows_its_weight():
    """A weight made under torch.inference_mode (a checkpoint loaded there) keeps no version counter: the bias is
    still the buckets' floats, and after an in-place change of the weight the changed ones."""
    torch.manual_seed(2)
    with torch.inference_mode():
        bias = RelativePositionBias(32, 128, 4, bidirectional=False)
    queries = torch.tensor([[0], [40]])
    for _ in range(2):
        reference = RelativePositionBias(32, 128, 4, bidirectional=False)
        reference.load_state_dict({"embedding.weight": bias.embedding.weight.clone()})
        with torch.inference_mode():
            got = bias(queries, 41)
            bias.embedding.weight.add_(1.0)
        assert torch.equal(got, _buckets_bias(reference, queries, 41))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("keys", [1, 15, 16, 17, 33, 48])
def test_attention_over_cache_slices_reads_only_their_keys(threads, keys):
    """Rows and heads of a cache read up to ``keys`` of a larger buffer whose unused positions hold NaN (a cache's
    capacity; never written): the output is the contiguous copy's, bit for bit, with T5's float bias."""
    torch.manual_seed(keys)
    buffer = torch.full((4, 12, 65, 64), float("nan"))
    k, v = buffer.clone(), buffer.clone()
    k[:, :, :keys], v[:, :, :keys] = torch.randn(4, 12, keys, 64), torch.randn(4, 12, keys, 64)
    q, bias = torch.randn(4, 12, 1, 64), torch.randn(1, 12, 1, keys)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sliced = kernel.decode_attention(q, k[:, :, :keys], v[:, :, :keys], bias, [], None, 0)
        copied = kernel.decode_attention(q, k[:, :, :keys].contiguous(), v[:, :, :keys].contiguous(), bias, [], None, 0)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(sliced, copied) and not sliced.isnan().any()
