"""The bf16-product encoder attention (model/kernels/encoder_attention_bf16.cpp) against float64 references, and the
dispatch: the bf16 mode attends with it, float32 (and a CPU without AVX512-BF16) keeps encoder_attention.cpp."""

import pytest
import torch

from model import bf16_linear, native
from model.attention import MultiHeadAttention, bf16_encoder_kernel, blocked_sdpa
from model.quantize import prepare_for_inference
from tests.model.conftest import random_ids, tiny_classifier

kernel = native.kernels()
bf16 = bf16_encoder_kernel()
needs_bf16 = pytest.mark.skipif(bf16 is None, reason="no AVX512-BF16 kernel on this CPU")


def _fused(b, h, t, seed):
    """q, k, v (B, H, T, 64) as views of one fused projection, as split_qkv gives them."""
    qkv = torch.randn(b, t, 3 * h * 64, generator=torch.Generator().manual_seed(seed))
    return tuple(x.view(b, t, h, 64).transpose(1, 2) for x in qkv.split(h * 64, -1))


def _mask(b, t, kind):
    if kind == "none":
        return None
    if kind == "shared":
        mask = torch.ones(1, 1, 1, t, dtype=torch.bool)
        mask[..., t // 2 + 1:] = False
        return mask
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
    for row in range(1, b, 3):  # a third of the rows padded, each to its own length
        mask[row, ..., max(1, t - 3 * row - 1):] = False
    return mask


def _reference(q, k, v, mask, round_weights):
    """float64 attention of q, k, v as given; ``round_weights``: the kernel's rounding of exp(s - max) to bf16 for
    p @ v, divided by the sum of the unrounded weights."""
    scores = q.double() @ k.double().transpose(-2, -1) / 8
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    total = weights.sum(-1, keepdim=True)
    if round_weights:
        weights = weights.float().bfloat16().double()
    return weights @ v.double() / total


@needs_bf16
@pytest.mark.parametrize("t", [1, 7, 17, 64, 65, 128, 200])
@pytest.mark.parametrize("masked", ["none", "per row", "shared"])
def test_the_kernel_equals_float64_attention_of_its_bf16_inputs(t, masked, threads):
    q, k, v = _fused(4, 3, t, seed=t)
    mask = _mask(4, t, masked)
    got = bf16.encoder_attention_bf16(q, k, v, mask)
    assert got.shape == (4, 3, t, 64) and got.transpose(1, 2).is_contiguous()
    rounded = [x.bfloat16().float() for x in (q, k, v)]
    # Tight: float64 of the bf16-rounded q, k, v with the weights rounded as the kernel rounds them: float32 sums,
    # and a weight whose bf16 rounding the kernel's exp (2e-7 relative) flips moves an output by at most 2^-8 |v|.
    tight = _reference(*rounded, mask, round_weights=True)
    error = (got.double() - tight).abs()
    assert error.max() <= 2**-8 * v.abs().max() and error.norm() <= 1e-4 * tight.norm()
    # Loose: against float32 attention of the unrounded inputs, bf16's 8 bits of mantissa.
    exact = _reference(q, k, v, mask, round_weights=False)
    assert (got.double() - exact).norm() <= 1e-2 * exact.norm()
    assert (got.double() - exact).abs().max() <= 2e-2 * exact.abs().max()


@needs_bf16
def test_a_row_that_sees_no_key_gets_zeros():
    q, k, v = _fused(2, 3, 20, seed=0)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[1] = False
    got = bf16.encoder_attention_bf16(q, k, v, mask)
    assert torch.equal(got[1], torch.zeros_like(got[1])) and got[0].abs().sum() > 0


@pytest.mark.skipif(kernel is None or not kernel.has_avx512(), reason="the encoder kernel needs AVX-512")
def test_float32_attention_stays_encoder_attention_bit_for_bit(monkeypatch):
    q, k, v = _fused(3, 4, 40, seed=1)
    mask = _mask(3, 40, "per row")
    today = kernel.encoder_attention(q, k, v, mask)
    assert torch.equal(blocked_sdpa(q, k, v, mask), today)  # the float32 engines: unchanged
    if bf16 is not None:
        assert torch.equal(blocked_sdpa(q, k, v, mask, bf16_products=True), bf16.encoder_attention_bf16(q, k, v, mask))
    monkeypatch.setattr(bf16_linear, "kernel", lambda: None)  # a CPU without AVX512-BF16: today's kernel
    assert torch.equal(blocked_sdpa(q, k, v, mask, bf16_products=True), today)


@pytest.mark.parametrize("mode", ["none", "int8", "bf16"])
def test_only_the_bf16_mode_attends_with_bf16_products(mode):
    model = prepare_for_inference(tiny_classifier(), mode)
    flags = {m.bf16_products for m in model.modules() if isinstance(m, MultiHeadAttention)}
    assert flags == {mode == "bf16"}


@needs_bf16
def test_a_bf16_classifiers_long_rows_take_the_bf16_kernel():
    model = prepare_for_inference(tiny_classifier(d_model=128, n_heads=2, max_len=64), "bf16")  # head dim 64
    ids = random_ids(3, 40)
    with torch.inference_mode():
        got = model(ids)
        for m in model.modules():
            if isinstance(m, MultiHeadAttention):
                m.bf16_products = False
        float32_attention = model(ids)
    assert not torch.equal(got, float32_attention)
    torch.testing.assert_close(got, float32_attention, rtol=0, atol=2e-2 * float32_attention.abs().max().item())
