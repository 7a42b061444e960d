"""The int8 feed-forward in one pass (model/kernels/int8_gemm.cpp): a gated FFN's gate and up read side by side on one
quantised input, act(gate) * up formed in registers and quantised for fc2 (Int8Linear.gated_into,
int8_gated_quantized), and the ungated hand-off (Int8Linear.activated_into): bit-equal to the separate passes
(int8_linear of each, the activation, the product, fc2 quantising the float hidden state), close to float64, and
taken by FeedForward and the C++ decoding step."""

import copy

import pytest
import torch

from model import int8_kernel, native
from model.causal_lm import CausalLM
from model.config import CausalLMConfig
from model.fast_step import run_decoder
from model.int8_linear import Int8Linear
from model.layers import FeedForward
from model.quantize import quantize
from tests.model.conftest import random_ids
from tests.model.helpers import causal_cache, decode
from tests.model.test_fast_step import general
from tests.model.test_llama_native import _counting

kernel, why_not = int8_kernel.available()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"int8 kernel unavailable here: {why_not}")

ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "silu"]
D, D_FF = 33, 130  # inputs not a multiple of 4; 9 output blocks, the last partial (an odd block after the pairs)
# Against float64 of the dequantised weights only the activations' 8-bit rounding remains: each row's rounding is up to
# max|row| / 254 an element, summed over 33-130 inputs with random signs, twice (x, then the hidden state), the gated
# product adding both factors' errors: at most 2.3% of the largest output over these cases; a wrong block, scale, bias
# or activation is off by the output's own size.
FLOAT64_TOL = 0.05


@pytest.fixture(scope="module", params=[True, False], ids=["bias", "no-bias"])
def layers(request) -> tuple[Int8Linear, Int8Linear, Int8Linear]:
    """(fc1 / gate, up, fc2) of one FFN, random weights."""
    torch.manual_seed(0)
    bias = request.param

    def layer(out: int, inp: int) -> Int8Linear:
        return Int8Linear(torch.randn(out, inp) * 0.1, torch.randn(out) if bias else None)

    return layer(D_FF, D), layer(D_FF, D), layer(D, D_FF)


def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    return before


def _float64(x, fc1, up, fc2, activation, gated: bool) -> torch.Tensor:
    def linear(layer, h):
        bias = layer.bias.double() if layer.bias is not None else None
        return torch.nn.functional.linear(h, layer.weight.double(), bias)

    act = {"relu": torch.relu, "silu": torch.nn.functional.silu,
           "gelu": torch.nn.functional.gelu, "gelu_tanh": lambda h: torch.nn.functional.gelu(h, approximate="tanh")}
    h = act[activation](linear(fc1, x.double()))
    return linear(fc2, h * linear(up, x.double()) if gated else h)


@pytest.mark.parametrize("threads", [1, 2])  # 2 threads at a few rows: the float product, then one quantise pass
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
# a lone row, streaming tiles of 2-8 rows, a 9th row alone, one chunk of 64 with 4-row tiles, several chunks
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 17, 64, 200])
def test_the_ffn_in_one_pass_equals_the_separate_passes(vector_bits, layers, threads, activation, gated, rows):
    fc1, up, fc2 = layers
    x = torch.randn(rows, D, generator=torch.Generator().manual_seed(rows)) * 3
    before = _threads(threads)
    try:
        with torch.inference_mode():
            if gated:
                got = fc1.gated_into(x, up, activation, fc2)
                want = fc2(kernel.rows_mul_(fc1.activated(x, activation), up(x)))
            else:
                got = fc1.activated_into(x, activation, fc2)
                want = fc2(fc1.activated(x, activation))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    reference = _float64(x, fc1, up, fc2, activation, gated)
    assert (got.double() - reference).abs().max() <= FLOAT64_TOL * reference.abs().max()


def test_the_gate_and_up_must_have_one_shape(layers):
    fc1, _, fc2 = layers
    other = Int8Linear(torch.randn(D_FF + 16, D), None)
    with pytest.raises(RuntimeError, match="one shape"):
        fc1.gated_into(torch.randn(2, D), other, "silu", fc2)


@pytest.mark.parametrize("ffn", ["gated", "mlp"])
def test_an_int8_feed_forward_takes_the_one_pass_path(ffn):
    torch.manual_seed(0)
    model = quantize(CausalLM(CausalLMConfig(**_CONFIG, ffn=ffn)).eval(), "int8")
    layer = next(m for m in model.modules() if isinstance(m, FeedForward))
    x = torch.randn(2, 5, layer.fc1.in_features)
    with torch.inference_mode():
        separate = layer.fc2(_gated_or_not(layer, x))
        calls = []
        fused = layer.fc1.gated_into if layer.up is not None else layer.fc1.activated_into
        name = fused.__name__
        setattr(layer.fc1, name, lambda *args: calls.append(1) or fused(*args))
        try:
            got = layer(x)
        finally:
            delattr(layer.fc1, name)
    assert calls and torch.equal(got, separate)


def _gated_or_not(layer: FeedForward, x: torch.Tensor) -> torch.Tensor:
    h = layer.fc1.activated(x, layer.activation)
    return h * layer.up(x) if layer.up is not None else h


_CONFIG = dict(vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, max_len=64, dropout=0.0,
               positions="rope", norm_type="rms", activation="silu", bias=False, scale_embeddings=False)
INT8_LOGIT_TOL = 0.1  # of the largest logit: the step and LayerStack.forward round attention in other orders


@pytest.mark.skipif(native.kernels() is None, reason="the C++ decode kernels do not run here")
@pytest.mark.parametrize("ffn", ["gated", "mlp"])
@pytest.mark.parametrize("ragged", [False, True])
def test_the_c_step_runs_the_int8_ffn_as_the_pytorch_path_does(ffn, ragged):
    """Four decoding steps of an int8 Llama-style (gated) or plain FFN: the C++ step against LayerStack.forward,
    whose FFN (gated_into / activated_into) gives the same bytes as the step's."""
    torch.manual_seed(0)
    model = quantize(CausalLM(CausalLMConfig(**_CONFIG, ffn=ffn)).eval(), "int8")
    counted = _counting(model)
    with torch.inference_mode():
        cache = causal_cache(model, ragged)
        tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(4)]
        fast = decode(model, run_decoder, tokens, copy.deepcopy(cache))
        slow = decode(model, general, tokens, copy.deepcopy(cache))
        for f, s in zip(fast, slow, strict=True):
            want = model.lm_head(s)
            assert (model.lm_head(f) - want).abs().max() <= INT8_LOGIT_TOL * want.abs().max()
    assert counted.calls >= 4
