"""The few-rows float32 GEMV (model/kernels/few_rows_linear.cpp) against float64, its fallbacks, and its users."""

import pytest
import torch
import torch.nn.functional as F

from model import native
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.layout import input_major, use_input_major_weights
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_seq2seq

kernel = native.kernels()
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ kernels do not run here")


def _weights(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    return input_major(weight), torch.randn(out_features, generator=g)


def _reference(x, weight, bias):
    y = x.double() @ weight.double().t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 33])
@pytest.mark.parametrize(("out_features", "in_features"), [(512, 512), (40, 7), (8000, 64), (16, 2048), (17, 33)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_equals_the_float64_reference(rows, out_features, in_features, with_bias):
    """Rows 1-4 (the GEMV), more (MKL's GEMM, then the bias); sizes that are and are not multiples of the
    vector width (16) or of the 4-row groups."""
    weight, bias = _weights(out_features, in_features)
    bias = bias if with_bias else None
    x = torch.randn(rows, in_features)
    with torch.no_grad():
        got = kernel.few_rows_linear(x, weight, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_leading_dimensions_and_a_strided_input_keep_their_shape():
    weight, bias = _weights(48, 32)
    x = torch.randn(2, 1, 64)[..., ::2]  # (2, 1, 32), not contiguous
    with torch.no_grad():
        got = kernel.few_rows_linear(x, weight, bias)
    assert got.shape == (2, 1, 48)
    torch.testing.assert_close(got.double(), _reference(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["output_major", "float64", "autograd"])
def test_what_the_kernel_does_not_run_goes_to_f_linear(case):
    """An (out, in) row-major weight, another dtype and autograd: F.linear's result, gradients too."""
    weight, bias = _weights(24, 16)
    x = torch.randn(2, 16)
    if case == "output_major":
        weight = weight.contiguous()
    if case == "float64":
        weight, bias, x = weight.double(), bias.double(), x.double()
    if case == "autograd":
        weight.requires_grad_(True)
        got = kernel.few_rows_linear(x, weight, bias)
        got.sum().backward()
        assert weight.grad is not None
        torch.testing.assert_close(weight.grad, torch.ones(2, 24).t() @ x)
        return
    with torch.no_grad():
        torch.testing.assert_close(kernel.few_rows_linear(x, weight, bias), F.linear(x, weight, bias))


def test_bad_shapes_raise_instead_of_reading_out_of_bounds():
    weight, bias = _weights(24, 16)
    with torch.no_grad(), pytest.raises(RuntimeError):
        kernel.few_rows_linear(torch.randn(1, 15), weight, bias)
    with torch.no_grad(), pytest.raises(RuntimeError):
        kernel.few_rows_linear(torch.randn(1, 16), weight, torch.randn(23))


@pytest.mark.parametrize("family", ["causal_lm", "seq2seq"])
@pytest.mark.parametrize("beams", [1, 4])
def test_generation_with_input_major_weights_equals_the_row_major_model(family, beams):
    """Input-major weights (the service's layout) give the row-major model's tokens and close scores."""
    model = tiny_causal_lm() if family == "causal_lm" else tiny_seq2seq()
    generate = generate_causal if family == "causal_lm" else generate_seq2seq
    inputs = random_ids(2, 6).tolist()
    config = GenerationConfig(strategy="beam" if beams > 1 else "greedy", num_beams=beams, max_new_tokens=8)
    before = generate(model, inputs, config)
    use_input_major_weights(model)
    after = generate(model, inputs, config)
    for a, b in zip(before, after, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
