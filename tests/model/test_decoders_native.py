"""Mistral's, Qwen3's and Gemma 3's blocks on the fast CPU path (model/fast_step.py, model/kernels): sliding-window
layers (sequences several windows long), q/k norms, (1 + weight) RMSNorms, sandwich norms, query_pre_attn_scalar and
the window layers' own rotary base, on the C++ decoding step against our PyTorch path (LayerStack.forward, itself
equal to transformers: tests/model/test_hf_decoders.py, whose random directories these are), float32 and int8, with
per-row LoRA adapters."""

from __future__ import annotations

import copy

import pytest
import torch

from model import int8_kernel, native
from model.causal_lm import CausalLM
from model.config import CausalLMConfig
from model.fast_step import plan_for, run_decoder
from model.generation import generate_causal
from model.hf import load_hf_model
from model.layers import RMSNorm
from model.lora import LoRAConfig, add_adapter, use_adapters
from model.lora_layers import LoRALinear
from model.native_support import unsupported
from model.prefix_cache import BLOCK_TOKENS, PrefixCache, prefix_cache_serves
from model.quantize import quantize
from service.engine.runners import CausalRunner
from tests.hf_compare import best_tokens, decoding
from tests.model.conftest import random_ids
from tests.model.helpers import causal_cache, decode
from tests.model.test_fast_step import general
from tests.model.test_hf_decoders import PROMPTS, WINDOW, save
from tests.model.test_native_step import _Watched

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ decode kernels do not run here")

# tests/model/test_hf_decoders.py's VARIANTS: Mistral (every layer within a window of 4), Qwen3 (q/k norms; a window
# on its second layer, biases, a head width of 12), Gemma 3 (local, global, local layers: q/k norms, (1 + w) norms,
# sandwich norms, query_pre_attn_scalar, a local rotary base; linear scaling of the global one)
VARIANTS = ["mistral-window", "qwen3", "qwen3-bias-window-head_dim-12", "gemma3", "gemma3-linear-untied"]
INT8_LOGIT_TOL = 0.1  # of the largest logit, as tests/model/test_llama_native.py


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def _model(tmp_path, variant: str):
    model, config = load_hf_model(save(tmp_path / variant, variant, seed=5, eos_boost=2.0))
    assert unsupported(config) == [] and model.decoder.native
    return model


def _counting(model) -> _Watched:
    """The model's plan with its C++ step counting its calls."""
    plan = plan_for(model.decoder)
    assert plan.native is not None  # the C++ step binds these blocks
    plan.native = _Watched(plan.native)
    return plan.native


def _assert_steps_agree(model, ragged: bool, tolerance: float = 1e-4) -> None:
    """Four decoding steps after a 5-token prefill (past the window of 4) and a verification step of 4 tokens: the
    C++ step's logits against LayerStack.forward's."""
    cache = causal_cache(model, ragged)
    tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(4)]
    fast = decode(model, run_decoder, tokens, copy.deepcopy(cache))
    slow = decode(model, general, tokens, copy.deepcopy(cache))
    for f, s in zip(fast, slow, strict=True):
        assert (model.lm_head(f) - model.lm_head(s)).abs().max() < tolerance
    verified = {}
    for path in (run_decoder, general):
        copied = copy.deepcopy(cache)
        positions, mask = copied.begin_step(4)
        verified[path] = model.lm_head(path(model.decoder, model.embed(random_ids(3, 4, seed=9), positions), mask,
                                            copied, None))
    assert (verified[run_decoder] - verified[general]).abs().max() < tolerance


def assert_replay_agrees(model) -> None:
    """The decode plan's Python replay (float64: no C++ step) against LayerStack.forward, to float64 rounding, over
    four decoding steps of uniform and ragged rows."""
    model = model.double()
    assert plan_for(model.decoder).native is None  # float64: the replay
    for ragged in (False, True):
        cache = causal_cache(model, ragged)
        tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(4)]
        fast = decode(model, run_decoder, tokens, copy.deepcopy(cache))
        slow = decode(model, general, tokens, copy.deepcopy(cache))
        for f, s in zip(fast, slow, strict=True):
            torch.testing.assert_close(f, s, rtol=0, atol=1e-12)


def assert_c_step_agrees(model) -> list[list[list[int]]]:
    """Decoding and verification steps (uniform and ragged rows), greedy and beam-4 generation: the C++ step (which
    really runs) against LayerStack.forward."""
    counted = _counting(model)
    for ragged in (False, True):
        _assert_steps_agree(model, ragged)
    assert counted.calls == 2 * (4 + 1)
    outputs = {}
    for native_path in (True, False):
        model.decoder.native = native_path
        outputs[native_path] = [best_tokens(generate_causal(model, PROMPTS, decoding(name)[0]))
                                for name in ("greedy", "beam")]
    model.decoder.native = True
    assert outputs[True] == outputs[False] and counted.calls > 10
    return outputs[True]


@pytest.mark.parametrize("offset", [False, True], ids=["qwen3", "gemma"])
def test_the_head_norm_kernel_normalizes_each_head_of_a_fused_projection_in_place(offset):
    """q/k norms on q's heads as the fused q/k/v projection holds them (strided views): as RMSNorm computes."""
    norm = RMSNorm(24, 1e-6, offset)
    norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    qkv = torch.randn(3, 2, (5 + 2) * 24, generator=torch.Generator().manual_seed(1))  # (B, t, (H + 2 H_kv) Dh)
    q = qkv.narrow(2, 0, 5 * 24).view(3, 2, 5, 24).transpose(1, 2)  # (B, H, t, Dh)
    want, rest = norm(q.clone()), qkv[..., 5 * 24:].clone()
    kernels.rows_head_rms_norm_(q, norm.weight, norm.eps, offset)
    torch.testing.assert_close(q, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[..., 5 * 24:], rest)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_c_step_computes_what_the_pytorch_path_does(tmp_path, variant):
    """Decoding and verification steps (uniform and ragged rows, keys beyond the window), greedy and beam-4 generation
    of prompts and outputs longer than the window: the C++ step (which really runs) against LayerStack.forward."""
    greedy, _ = assert_c_step_agrees(_model(tmp_path, variant))
    assert max(len(p) + len(t) for p, t in zip(PROMPTS, greedy, strict=True)) > 2 * WINDOW


@pytest.mark.parametrize("variant", ["mistral-window", "qwen3-bias-window-head_dim-12", "gemma3"])
def test_the_python_replay_computes_what_the_pytorch_path_does_in_float64(tmp_path, variant):
    """The decode plan without the C++ step (other dtypes, the GPU): window masks, q/k norms, sandwich norms, the
    query scale and the local rotary, to float64 rounding."""
    assert_replay_agrees(_model(tmp_path, variant))


@pytest.mark.parametrize("variant", ["mistral-window", "qwen3-bias-window-head_dim-12", "gemma3-linear-untied"])
def test_int8_models_take_the_c_step(tmp_path, variant):
    """int8 projections (the fused q/k/v of GQA widths) on these blocks: close to float32, and the C++ step computes
    what the PyTorch path computes with the same int8 layers."""
    if int8_kernel.kernel() is None:
        pytest.skip("our int8 kernel does not run here")
    float_model = _model(tmp_path, variant)
    model = quantize(copy.deepcopy(float_model), "int8")
    assert model.decoder.native and model.decoder.layers[0].self_attn.fused
    ids = torch.tensor([PROMPTS[1] * 2])
    want = float_model(ids)
    assert (model(ids) - want).abs().max() < INT8_LOGIT_TOL * want.abs().max()
    counted = _counting(model)
    _assert_steps_agree(model, ragged=True)
    assert counted.calls == 4 + 1
    greedy = decoding("greedy")[0]
    int8_tokens, float_tokens = (best_tokens(generate_causal(m, PROMPTS, greedy)) for m in (model, float_model))
    assert sum(a[:3] == b[:3] for a, b in zip(int8_tokens, float_tokens, strict=True)) >= len(PROMPTS) - 1


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-bias-window-head_dim-12", "gemma3"])
def test_per_row_lora_adapters_take_the_c_step(tmp_path, variant):
    model = _model(tmp_path, variant)
    targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "up", "fc2")
    add_adapter(model, "x", LoRAConfig(r=2, target_modules=targets), seed=0)
    add_adapter(model, "y", LoRAConfig(r=3, lora_alpha=6, target_modules=targets), seed=1)
    for module in model.modules():  # B starts at zero: make the adapters change the outputs
        if type(module) is LoRALinear:
            for b in module.lora_B.values():
                b.weight.normal_(0, 0.3)
    counted = _counting(model)
    cache = causal_cache(model, True)
    tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(3)]
    base = decode(model, run_decoder, tokens, copy.deepcopy(cache))
    with use_adapters(model, ["x", None, "y"]):
        fast = decode(model, run_decoder, tokens, copy.deepcopy(cache))
        slow = decode(model, general, tokens, copy.deepcopy(cache))
    for f, s in zip(fast, slow, strict=True):
        torch.testing.assert_close(f, s, rtol=1e-4, atol=1e-4)  # float32 sums in another order
    assert counted.calls == 6
    assert (fast[-1][0] - base[-1][0]).abs().max() > 1e-3 and torch.equal(fast[-1][1], base[-1][1])


def test_norm_weights_changed_in_place_reach_the_c_step(tmp_path):
    """The (1 + w) norms and q/k norms are bound as the model's own Parameters: load_state_dict's in-place copies
    reach the next step without a rebuilt plan."""
    model = _model(tmp_path, "gemma3")
    counted = _counting(model)
    state = {name: p + 0.1 * torch.randn_like(p) if "norm" in name else p for name, p in model.state_dict().items()}
    model.load_state_dict(state)
    assert plan_for(model.decoder).native is counted
    _assert_steps_agree(model, ragged=False)
    assert counted.calls == 4 + 1


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3"])
@pytest.mark.parametrize("decode_kernels", [True, False])
def test_prefix_cache_hits_give_what_misses_give(tmp_path, kernel_options, decode_kernels, variant):
    """Keys cached after rotation at their absolute positions (q/k-normed for Qwen3) in KV-head blocks: rows reading a
    cached prompt prefix get the logits and greedy tokens of rows computing it, on the C++ step and off it (windowed
    models take no prefix cache: model.prefix_cache.prefix_cache_serves)."""
    kernel_options(decode_kernels=decode_kernels)
    model = _model(tmp_path, variant)
    windowed = CausalLMConfig(positions="rope", sliding_window=4)
    assert prefix_cache_serves(model.config) and not prefix_cache_serves(windowed)
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(3, 96, (2 * BLOCK_TOKENS + 3,), generator=generator).tolist()
    prompts = [system + [40 + i] * (i + 1) for i in range(2)] + [system[5:]]  # the last reads no prefix
    runner, plain = CausalRunner(model, PrefixCache(budget_bytes=1 << 20)), CausalRunner(model)
    runner.prefill(prompts[:1], [None], [[]])  # caches the system prompt's blocks
    logits, cache = runner.prefill(prompts, [None] * 3, [[], [], []])
    want_logits, want = plain.prefill(prompts, [None] * 3, [[], [], []])
    assert cache.prefix is not None and [len(row) for row in cache.prefix.rows] == [2, 2, 0]
    assert cache.prefix.blocks[0].shape[2] == model.config.kv_heads
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    tokens = want_logits.argmax(-1)
    for _ in range(4):
        step, want_step = runner.decode(tokens, cache), plain.decode(tokens, want)
        torch.testing.assert_close(step, want_step, rtol=1e-4, atol=1e-4)
        assert torch.equal(step.argmax(-1), want_step.argmax(-1))
        tokens = want_step.argmax(-1)
    verified, want_verified = runner.verify(tokens[:, None].repeat(1, 3), cache), plain.verify(
        tokens[:, None].repeat(1, 3), want)
    torch.testing.assert_close(verified, want_verified, rtol=1e-4, atol=1e-4)


def test_heads_of_256_features_take_the_c_step():
    """Gemma 3's head width (256, one KV head; the attention kernel's widest) with its blocks, from our own config."""
    torch.manual_seed(0)
    config = CausalLMConfig(vocab_size=96, d_model=32, n_heads=2, n_kv_heads=1, head_size=256, d_ff=48, n_layers=2,
                            max_len=64, positions="rope", norm_type="rms", ffn="gated", activation="gelu_tanh",
                            bias=False, dropout=0.0, qk_norm=True, norm_offset=True, sandwich_norm=True,
                            attention_scale=0.1, sliding_window=3, window_layers=[True, False], rope_local_theta=100.0)
    model = CausalLM(config).eval()
    counted = _counting(model)
    _assert_steps_agree(model, ragged=True)
    assert counted.calls == 4 + 1
