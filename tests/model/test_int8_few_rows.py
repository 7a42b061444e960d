"""The int8 kernel's few-row products (decoding: greedy, beams, small batches; tiles of 1-8 rows against one block at a
time, their steps split over several accumulators, their outputs stored after a span of blocks, model/kernels/
int8_gemm.cpp) against the integer reference, and bit-equal to each row alone."""

import numpy as np
import pytest
import torch

from model import int8_kernel
from model.int8_linear import Int8Linear
from tests.model.test_int8_ffn import FLOAT64_TOL, _float64
from tests.model.test_int8_kernel import _quantized_weights, _reference

kernel, why_not = int8_kernel.available()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"int8 kernel unavailable here: {why_not}")


@needs_kernel
# outputs: 15 blocks of 16 (groups of 4, 4, 4, 3) with the last one partial; 38 blocks: spans of 16, 16 and 6 (at 2
# threads 16 and 4, 16 and 2), the last block partial; inputs: not a multiple of 64 or of 4
@pytest.mark.parametrize(("out", "inp"), [(229, 771), (40, 64), (512, 130), (600, 75)])
def test_few_rows_equal_the_integer_reference_and_each_row_alone(vector_bits, threads, out, inp):
    q, scales = _quantized_weights(out, inp, seed=out)
    packed, sums, bias = int8_kernel.pack(q), q.sum(1, dtype=torch.int32), torch.randn(out)
    x = torch.randn(17, inp) * 3
    alone = torch.cat([kernel.int8_linear(x[i : i + 1], packed, scales, sums, bias) for i in range(17)])
    want = _reference(x, q, scales, bias)
    np.testing.assert_allclose(alone.double().numpy(), want.numpy(), rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for rows in range(2, 18):  # 1-8 rows: one tile a block, 9-16: 8 and 1-8, 17: tiles of 4 rows x 4 blocks
        assert torch.equal(kernel.int8_linear(x[:rows], packed, scales, sums, bias), alone[:rows]), rows


@needs_kernel
@pytest.mark.parametrize("rows", [2, 4, 7])
def test_a_few_rows_quantised_handoff_equals_each_row_alone(threads, rows):
    torch.manual_seed(rows)
    fc1 = Int8Linear(torch.randn(1030, 70) * 0.05, torch.randn(1030))
    fc2 = Int8Linear(torch.randn(70, 1030) * 0.05, torch.randn(70))
    x = torch.randn(rows, 70) * 3
    with torch.inference_mode():
        alone = torch.cat([fc1.activated_into(x[i : i + 1], "gelu", fc2) for i in range(rows)])
        assert torch.equal(fc1.activated_into(x, "gelu", fc2), alone)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 8, 11])
def test_a_gated_few_row_ffn_over_several_spans_equals_the_separate_passes(vector_bits, threads, rows):
    # d_ff 600: 38 blocks, spans of 16, 16 and 6 (at 2 threads 16 and 4, 16 and 2), the last block partial
    torch.manual_seed(rows)
    gate, up = (Int8Linear(torch.randn(600, 75) * 0.1, torch.randn(600)) for _ in range(2))
    fc2 = Int8Linear(torch.randn(75, 600) * 0.1, torch.randn(75))
    x = torch.randn(rows, 75) * 3
    with torch.inference_mode():
        got = gate.gated_into(x, up, "silu", fc2)
        assert torch.equal(got, fc2(kernel.rows_mul_(gate.activated(x, "silu"), up(x))))
    reference = _float64(x, gate, up, fc2, "silu", gated=True)
    assert (got.double() - reference).abs().max() <= FLOAT64_TOL * reference.abs().max()
