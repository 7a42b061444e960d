"""The int8 kernel (AVX512-VNNI, and its AVX2 twin) against an exact integer reference, and how the int8 GEMM is
chosen."""

import numpy as np
import pytest
import torch

from model import int8_kernel, native
from model.int8_linear import Int8Linear
from model.quantize import QuantizeError, quantize_int8
from tests.model.conftest import VECTOR_WIDTHS, tiny_seq2seq

kernel, why_not = int8_kernel.available()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"int8 kernel unavailable here: {why_not}")


def _quantized_weights(out: int, inp: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    scales = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic done naively: per-row float32 scale, round-to-even uint8, exact integer
    dot products (int64), the rest in float64."""
    x2 = x.reshape(-1, x.shape[-1])
    amax = x2.abs().amax(1)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # float32, as the kernel
    xq = torch.round(x2 * (1 / sx)[:, None]).to(torch.int64)  # -127..127 (the kernel's uint8 minus 128)
    dots = xq @ q.to(torch.int64).T
    y = dots.double() * sx.double()[:, None] * scales.double()[None, :]
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], q.shape[0])


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 70, 133])
# outputs: 1, 3, 4, 4 + 1 and 4 + 2 blocks of 16 (the tile takes 4 at a time); inputs: remainders of 4 and of 16
@pytest.mark.parametrize(("out", "inp"), [(1, 13), (37, 70), (64, 64), (80, 130), (96, 33), (16, 2048)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_equals_the_integer_reference(vector_bits, rows, out, inp, with_bias):
    q, scales = _quantized_weights(out, inp)
    bias = torch.randn(out) if with_bias else None
    x = torch.randn(rows, inp) * 3
    got = kernel.int8_linear(x, int8_kernel.pack(q), scales, q.sum(1, dtype=torch.int32), bias)
    want = _reference(x, q, scales, bias)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    if rows:
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(kernel is None or not kernel.has_vnni() or 256 not in VECTOR_WIDTHS,
                    reason="comparing the AVX512-VNNI tiles with their AVX2 twins needs a CPU that runs both")
@pytest.mark.parametrize("rows", [1, 5, 16, 70])  # a stream of one row, of 4 + 1 rows, of 16; the wide tiles
def test_the_vnni_tiles_and_their_avx2_twins_give_the_same_bits(vector_bits_of, rows):
    # the same int32 sums and float epilogue (relu: exact; the other activations' polynomials are the same formulas at
    # each width, avx2_math.h and activation_math.h, not compared bit for bit here)
    torch.manual_seed(rows)
    gate, up, fc2 = (Int8Linear(torch.randn(out, inp) * 0.1, torch.randn(out)) for out, inp in
                     ((200, 70), (200, 70), (70, 200)))
    x = torch.randn(rows, 70) * 3
    outputs = {}
    for bits in (512, 256):
        vector_bits_of(bits)
        with torch.inference_mode():
            outputs[bits] = (gate(x), gate.activated_into(x, "relu", fc2), gate.gated_into(x, up, "relu", fc2))
    for wide, narrow in zip(outputs[512], outputs[256], strict=True):
        assert torch.equal(wide, narrow)


@needs_kernel
def test_rows_do_not_depend_on_their_batch_and_leading_dims_are_kept():
    layer = torch.nn.Linear(96, 200)
    int8 = _with_kernel(layer, "kernel")
    x = torch.randn(3, 7, 96)
    batched = int8(x)
    assert batched.shape == (3, 7, 200)
    alone = torch.stack([torch.stack([int8(x[i, j : j + 1])[0] for j in range(7)]) for i in range(3)])
    assert torch.equal(batched, alone)  # per-row activation scales: bit-identical
    with torch.no_grad():
        want = layer(x)
    assert (batched - want).abs().max() < 0.02 * want.abs().max()


@needs_kernel
def test_pack_round_trips_and_the_module_dequantises():
    q, _ = _quantized_weights(37, 70)
    packed = int8_kernel.pack(q)
    assert packed.shape == (3, 18, 16, 4)  # 37 -> 48 outputs, 70 -> 72 inputs, zero-padded
    assert torch.equal(int8_kernel.unpack(packed, 37, 70), q)
    ids = torch.tensor([36, 0, 17, 16, 15, 17])  # any order, repeats, across the blocks of 16
    assert torch.equal(int8_kernel.unpack_rows(packed, ids, 70), q.index_select(0, ids))
    layer = torch.nn.Linear(70, 37)
    int8 = _with_kernel(layer, "kernel")
    assert int8.backend == "kernel" and torch.equal(int8.bias, layer.bias.detach())
    assert (int8.weight - layer.weight).abs().max() <= layer.weight.abs().amax(1).max() / 254 + 1e-7


@needs_kernel
def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    q, scales = _quantized_weights(32, 64)
    args = (int8_kernel.pack(q), scales, q.sum(1, dtype=torch.int32), None)
    for x in (torch.randn(2, 60), torch.randn(2, 65), torch.randn(2, 64, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="int8 kernel"):
            kernel.int8_linear(x, *args)
    with pytest.raises(RuntimeError, match="int8 kernel"):
        kernel.int8_linear(torch.randn(2, 64), args[0], scales[:31], *args[2:])


def test_the_kernel_choice_is_validated(kernel_options):
    kernel_options(int8_kernel="fbgemm")
    assert int8_kernel.kernel() is None
    model = tiny_seq2seq()
    quantize_int8(model)
    assert {m.backend for m in model.modules() if isinstance(m, Int8Linear)} == {"fbgemm"}
    kernel_options(int8_kernel="avx9000")
    with pytest.raises(QuantizeError, match="TSERVE_INT8_KERNEL"):
        quantize_int8(tiny_seq2seq())


def _with_kernel(layer: torch.nn.Linear, choice: str) -> Int8Linear:
    with native.using_options(int8_kernel=choice):
        return Int8Linear.from_linear(layer)
