"""fc1's output quantised for fc2 inside fc1's int8 GEMM (Int8Linear.activated_into) gives fc2 the same bytes as
quantising the float output, so the feed-forward's result is bit-equal; FeedForward takes it when both are int8."""

import pytest
import torch

from model import int8_kernel
from model.int8_linear import Int8Linear
from model.layers import FeedForward
from model.quantize import quantize_int8
from tests.model.conftest import tiny_classifier

kernel, why_not = int8_kernel.available()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"int8 kernel unavailable here: {why_not}")


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])  # 2: fewer row chunks than threads quantises the float output after
@pytest.mark.parametrize("activation", ["relu", "gelu"])
# rows: one chunk of 64 with a tile remainder, several chunks; d_ff: partial blocks and a width not a multiple of 4
@pytest.mark.parametrize(("rows", "d", "d_ff"), [(3, 24, 37), (70, 40, 130), (200, 33, 3071)])
def test_the_quantised_handoff_equals_fc2_of_the_float_output(threads, activation, rows, d, d_ff):
    torch.manual_seed(0)
    fc1 = Int8Linear(torch.randn(d_ff, d) * 0.05, torch.randn(d_ff))
    fc2 = Int8Linear(torch.randn(d, d_ff) * 0.05, torch.randn(d))
    x = torch.randn(2, rows, d) * 3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            assert torch.equal(fc1.activated_into(x, activation, fc2), fc2(fc1.activated(x, activation)))
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_an_int8_feed_forward_takes_the_handoff_and_keeps_its_output():
    torch.manual_seed(0)
    model = tiny_classifier()
    quantize_int8(model)
    ffn = next(m for m in model.modules() if isinstance(m, FeedForward))
    assert type(ffn.fc1) is Int8Linear and type(ffn.fc2) is Int8Linear
    x = torch.randn(3, 9, ffn.fc1.in_features)
    with torch.inference_mode():
        assert torch.equal(ffn(x), ffn.fc2(ffn.fc1.activated(x, ffn.activation)))
    with pytest.raises(RuntimeError, match="xq must be contiguous uint8"):
        kernel.int8_linear_quantized(torch.zeros(2, 5, dtype=torch.uint8), torch.ones(2), ffn.fc2._packed,
                                     ffn.fc2._scales, ffn.fc2._sums, ffn.fc2._bias)
