"""The panel GEMM over packed weights (model/kernels/packed_linear.cpp, model/packed_weights.py) against float64,
how packed copies follow their weights, and generation with and without them; in 512-bit tiles where the CPU has
AVX-512 and in AVX2's 256-bit ones (which AVX-512 CPUs run too)."""

import os

import pytest
import torch

from model import native, packed_weights
from model.decoding import GenerationConfig
from model.fast_step import plan_for
from model.generation import generate_causal, generate_seq2seq
from model.layout import input_major, use_input_major_weights
from model.lora import LoRAConfig, add_adapter, merge_adapter
from model.lora_layers import LoRALinear
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_seq2seq

kernel = native.kernels()
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ kernels do not run here")


def _weights(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    return weight, torch.randn(out_features, generator=g)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 13, 24, 25, 37, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(512, 512), (40, 7), (8000, 64), (7, 2048), (100, 133)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_equals_the_float64_reference(vector_bits, rows, out_features, in_features, with_bias):
    """Row tiles of 1-12 (AVX2: 1-6, 3-4 rows in blocks of 64 inputs, 5-24 rows interleaved over blocks of 192
    inputs, 25 past them; 13 and 37 rows split unevenly), column counts that are and are not multiples of the
    32-column panels and of 8, odd inner sizes and partial blocks."""
    weight, bias = _weights(out_features, in_features)
    bias = bias if with_bias else None
    x = torch.randn(rows, in_features)
    with torch.no_grad():
        got = kernel.packed_linear(x, kernel.pack_weight(weight), out_features, bias)
    expected = x.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("in_features", [64, 700])
def test_a_row_gives_the_same_bits_in_any_batch(vector_bits, in_features):
    """Each output is the same FMAs in the same order whatever tile its row falls in (1-2 rows over whole panels,
    3-4 in blocks, 5-24 interleaved over blocks, more in half panels): a row's result does not depend on its batch."""
    weight, bias = _weights(100, in_features, seed=2)
    x, panels = torch.randn(100, in_features), kernel.pack_weight(weight)
    with torch.no_grad():
        alone = torch.cat([kernel.packed_linear(x[r:r + 1], panels, 100, bias) for r in range(4)])
        for rows in (2, 3, 4, 5, 16, 24, 25, 64, 100):
            assert torch.equal(kernel.packed_linear(x[:rows], panels, 100, bias)[:4], alone[:rows])


@pytest.mark.parametrize("rows", [3, 16, 64])
def test_panels_shared_among_more_threads_than_cores_are_each_computed_once(vector_bits, rows):
    """Threads take even shares of the panels and steal the last ones of a slower thread's share: with more threads
    than this machine has cores some are descheduled mid-share, and every panel still comes out once, the same bits
    as on one thread."""
    weight, bias = _weights(4000, 96, seed=3)
    x, panels = torch.randn(rows, 96), kernel.pack_weight(weight)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            alone = kernel.packed_linear(x, panels, 4000, bias)
            torch.set_num_threads(max(3, 2 * (os.cpu_count() or 1)))
            for _ in range(5):
                assert torch.equal(kernel.packed_linear(x, panels, 4000, bias), alone)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(alone.double(), x.double() @ weight.double().t() + bias.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(150, 100, 3000), (700, 70, 300)])
def test_inputs_larger_than_l2_taken_in_blocks_of_rows_equal_the_float64_reference(vector_bits, rows, out_features,
                                                                                     in_features):
    """Over 768 KB of inputs the panels are walked once per block of rows: 60-row blocks and a partial last one
    (150 x 3,000), 648-row blocks of uneven tiles (700 x 300)."""
    weight, bias = _weights(out_features, in_features, seed=1)
    x = torch.randn(rows, in_features)
    assert x.numel() * 4 > 768 * 1024
    with torch.no_grad():
        got = kernel.packed_linear(x, kernel.pack_weight(weight), out_features, bias)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().t() + bias.double(), atol=1e-4, rtol=1e-5)


def test_leading_dims_strided_inputs_and_either_weight_layout(vector_bits):
    weight, bias = _weights(70, 48)
    x = torch.randn(6, 1, 96)[..., ::2]  # (6, 1, 48), not contiguous
    with torch.no_grad():
        got = kernel.packed_linear(x, kernel.pack_weight(input_major(weight)), 70, bias)
    assert got.shape == (6, 1, 70)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert torch.equal(kernel.pack_weight(weight), kernel.pack_weight(input_major(weight)))


def test_no_inputs_features_give_the_bias():
    weight, bias = _weights(40, 0)
    panels = kernel.pack_weight(weight)
    with torch.no_grad():
        torch.testing.assert_close(kernel.packed_linear(torch.randn(6, 0), panels, 40, bias), bias.expand(6, 40))
        assert kernel.packed_linear(torch.randn(6, 0), panels, 40, None).eq(0).all()


@pytest.mark.parametrize("broken", ["inner", "columns", "bias", "grad"])
def test_what_does_not_fit_raises(broken):
    weight, bias = _weights(64, 16)
    panels, x, n = kernel.pack_weight(weight), torch.randn(8, 16), 64
    if broken == "inner":
        x = torch.randn(8, 15)
    elif broken == "columns":
        n = 65  # three panels would be needed
    elif broken == "bias":
        bias = bias[:-1]
    with torch.set_grad_enabled(broken == "grad"), pytest.raises(RuntimeError, match="packed_linear"):
        kernel.packed_linear(x, panels, n, bias)


def test_packed_copies_follow_their_weights():
    layer = torch.nn.Linear(48, 40)
    first = packed_weights.packed(kernel, layer.weight)
    assert packed_weights.packed(kernel, layer.weight) is first  # kept
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: a new version
    second = packed_weights.packed(kernel, layer.weight)
    assert second is not first and torch.equal(second, kernel.pack_weight(layer.weight))
    layer.weight.data = input_major(layer.weight.data)  # re-laid: the same values, new data
    assert packed_weights.packed(kernel, layer.weight) is not second
    with torch.inference_mode():
        assert packed_weights.packed(kernel, torch.randn(40, 48)) is None  # changes would go unseen
    assert packed_weights.packed(kernel, layer.weight.double()) is None


def test_steps_of_a_few_rows_or_with_packing_off_use_none(kernel_options):
    lm = tiny_causal_lm()
    native = plan_for(lm.decoder).native
    assert native.panels(kernel, packed_weights.MAX_GEMV_ROWS) == []
    assert len(native.panels(kernel, packed_weights.MAX_GEMV_ROWS + 1)) == len(native.projections)
    kernel_options(packed_weights=False)
    assert native.panels(kernel, 32) == []


@pytest.mark.parametrize("family", ["causal", "seq2seq"])
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_batched_generation_is_the_same_with_packed_weights(vector_bits, family, strategy):
    """Batches of more than 4 rows (6 inputs, or 3 inputs x 4 beams) through the panel GEMM, including the
    output projection, against MKL on the same input-major weights; then with an adapter merged (new
    versions of its weights, packed afresh)."""
    model, generate = (tiny_causal_lm(), generate_causal) if family == "causal" else (tiny_seq2seq(), generate_seq2seq)
    add_adapter(model, "x", LoRAConfig(r=2, target_modules=("fc1",)), seed=0)
    for module in model.modules():
        if type(module) is LoRALinear:
            module.lora_B["x"].weight.data.normal_(0, 0.5)
    use_input_major_weights(model)
    config = GenerationConfig(strategy=strategy, num_beams=4, max_new_tokens=6, min_new_tokens=6)
    inputs = random_ids(6 if strategy == "greedy" else 3, 5).tolist()
    for merged in (False, True):
        if merged:
            merge_adapter(model, "x")
        results = {}
        for packing in ("auto", "off"):
            with native.using_options(packed_weights=packing == "auto"):
                results[packing] = generate(model, inputs, config)
        fc1 = model.decoder.layers[0].ffn.fc1.base.weight
        assert getattr(fc1, packed_weights._ATTRIBUTE)[0] == (fc1._version, fc1.data_ptr())  # packed, up to date
        for a, b in zip(results["auto"], results["off"], strict=True):
            assert [h.tokens for h in a] == [h.tokens for h in b]
            torch.testing.assert_close(torch.tensor([h.score for h in a]), torch.tensor([h.score for h in b]),
                                       atol=1e-4, rtol=1e-5)
