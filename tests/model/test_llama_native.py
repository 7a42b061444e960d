"""Llama blocks on the fast CPU path (model/fast_step.py, model/kernels): grouped-query attention reading the KV head
of each query's group in place, the C++ decoding step (RMSNorm, rotary at each row's position, GQA, gated FFN,
biases, head widths) against our PyTorch path (LayerStack.forward), int8, per-row LoRA and the prefix cache, on
LlamaForCausalLM directories built with `transformers` (tests/model/test_hf_llama.py's)."""

from __future__ import annotations

import copy

import pytest
import torch

from model import int8_kernel, native
from model.attention import decode_attention, prefix_attention
from model.causal_lm import CausalLM
from model.config import CausalLMConfig
from model.fast_step import plan_for, run_decoder
from model.generation import generate_causal
from model.hf import load_hf_model
from model.int8_linear import Int8Linear
from model.native_support import unsupported
from model.quantize import quantize
from model.shared_prefix import SharedPrefix
from tests.hf_compare import best_tokens, decoding
from tests.model.conftest import random_ids
from tests.model.helpers import causal_cache, decode
from tests.model.test_decode_attention import _reference
from tests.model.test_decoders_native import assert_c_step_agrees, assert_replay_agrees
from tests.model.test_fast_step import general
from tests.model.test_hf_llama import PROMPTS, save_llama
from tests.model.test_native_step import _Watched

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ decode kernels do not run here")

VARIANTS = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2},
    "mqa": {"num_key_value_heads": 1},
    "head_dim-biases": {"head_dim": 12, "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True},
    "rope-linear-tied": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True},
}
# Blocks no Llama directory has, from our own config: a partial rotary width (Phi-3), scalings whose angles depend on
# the positions (dynamic NTK past 4 positions: every step here) or carry an attention factor (yarn).
OWN = dict(vocab_size=96, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, max_len=64, positions="rope",
           norm_type="rms", ffn="gated", activation="silu", bias=False, scale_embeddings=False, dropout=0.0)
OWN_VARIANTS = {
    "partial-rotary-dynamic": {"rotary_dim": 4, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0,
                                                                 "original_max_position_embeddings": 4}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
}
INT8_LOGIT_TOL = 0.1  # of the largest logit, as tests/model/test_fast_path.py


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def _llama(tmp_path, name: str = "gqa"):
    if name in OWN_VARIANTS:
        torch.manual_seed(0)
        return CausalLM(CausalLMConfig(**OWN, **OWN_VARIANTS[name])).eval()
    model, _ = load_hf_model(save_llama(tmp_path / name, seed=5, eos_boost=2.0, **VARIANTS[name]))
    return model


def _counting(model) -> _Watched:
    """The model's plan with its C++ step counting its calls."""
    plan = plan_for(model.decoder)
    assert model.decoder.native and plan.native is not None  # the fast path takes these blocks
    plan.native = _Watched(plan.native)
    return plan.native


def _expanded_reference(q, k, v, mask):
    """Attention in float64 over K/V expanded to every query head."""
    group = q.shape[1] // k.shape[1]
    return _reference(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask)


@pytest.mark.parametrize(("heads", "kv_heads", "dh"), [(4, 4, 24), (6, 2, 24), (4, 1, 24), (4, 1, 256)])
def test_grouped_query_attention_reads_each_groups_kv_head_in_place(heads, kv_heads, dh):
    """The kernel, SDPA's fallback (float64) and the prefix path read K/V of H_kv heads for H query heads as the
    float64 reference over expanded K/V computes (and as the kernel over expanded K/V does); heads up to Gemma 3's
    256 features."""
    g = torch.Generator().manual_seed(0)
    b, tq, t = 3, 2, 19
    q = torch.randn(b, heads, tq, dh, generator=g)
    k, v = (torch.randn(b, kv_heads, 32, dh, generator=g)[:, :, :t] for _ in range(2))  # cache slices
    mask = (torch.arange(t) < torch.tensor([t, t - 3, 5])[:, None]).view(b, 1, 1, t)
    want = _expanded_reference(q, k, v, mask)
    got = kernels.decode_attention(q, k, v, mask)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    group = heads // kv_heads
    expanded = kernels.decode_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask)
    torch.testing.assert_close(got, expanded, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(decode_attention(q.double(), k.double(), v.double(), mask), want)  # SDPA, float64
    # a shared prefix of two blocks (layers, 2, H_kv, block, Dh): row 0 reads both, row 1 the first, row 2 none
    blocks = [torch.randn(2, 2, kv_heads, 4, dh, generator=g) for _ in range(2)]
    prefix = SharedPrefix.of_chains([blocks, blocks[:1], []])
    with_prefix = kernels.decode_attention(q, k, v, mask, list(prefix.blocks), prefix.table, 1)
    torch.testing.assert_close(prefix_attention(q, k, v, mask, prefix, 1), with_prefix, rtol=1e-5, atol=1e-5)
    row0_keys = torch.cat([blocks[0][1, 0], blocks[1][1, 0], k[0]], dim=1)[None]
    row0_values = torch.cat([blocks[0][1, 1], blocks[1][1, 1], v[0]], dim=1)[None]
    torch.testing.assert_close(with_prefix[:1].double(), _expanded_reference(q[:1], row0_keys, row0_values, None),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_prefix[2], got[2])


@pytest.mark.parametrize("name", [*VARIANTS, *OWN_VARIANTS])
def test_the_c_step_computes_what_the_pytorch_path_does(tmp_path, name):
    """Decoding steps and a speculative verification step (uniform and ragged rows), greedy and beam-4 generation:
    the C++ step (which really runs) against LayerStack.forward."""
    assert_c_step_agrees(_llama(tmp_path, name))


@pytest.mark.parametrize("name", ["gqa", "head_dim-biases", "partial-rotary-dynamic"])
def test_the_python_replay_computes_what_the_pytorch_path_does_in_float64(tmp_path, name):
    """The decode plan without the C++ step (other dtypes, CPUs without the kernels): rotary angles computed once per
    step, RMSNorm, the gated FFN, GQA, to float64 rounding."""
    assert_replay_agrees(_llama(tmp_path, name))


def test_what_the_c_step_implements_is_one_predicate():
    """Every decoder block field of today's configs runs on the plan and the C++ step (Mistral's, Qwen3's and
    Gemma 3's: tests/model/test_decoders_native.py; T5's: tests/model/test_t5_native.py); the encoder-only fields
    (ModernBERT's) decline to the PyTorch blocks, as a field added later does until listed."""
    from dataclasses import fields

    from model.config import ClassifierConfig, Seq2SeqConfig, TransformerConfig
    from model.native_support import IMPLEMENTED_FIELDS

    python_only = {"bidirectional_window", "first_attn_norm", "rotary_float32"}
    assert {f.name for f in fields(TransformerConfig)} - IMPLEMENTED_FIELDS == python_only
    modernbert = ClassifierConfig(positions="rope", sliding_window=4, bidirectional_window=True, first_attn_norm=False,
                                  rotary_float32=True)
    assert set(unsupported(modernbert)) == python_only
    t5 = dict(positions="relative", norm_type="rms", bias=False, ffn="gated", activation="gelu_tanh", head_size=12,
              attention_scale=1.0, relative_buckets=8, relative_max_distance=16)
    assert unsupported(Seq2SeqConfig(**t5)) == []
    llama = dict(positions="rope", norm_type="rms", n_kv_heads=2, ffn="gated", activation="silu", bias=False,
                 scale_embeddings=False, head_size=12, rope_scaling={"rope_type": "linear", "factor": 2.0})
    gemma = dict(qk_norm=True, sliding_window=8, window_layers=[True, False] * 2, rope_local_theta=10.0,
                 norm_offset=True, sandwich_norm=True, attention_scale=0.5)
    assert unsupported(CausalLMConfig(**llama)) == [] and unsupported(CausalLMConfig()) == []
    assert unsupported(CausalLMConfig(**llama, **gemma)) == []


def test_int8_llama_runs_the_c_step_with_a_grouped_qkv_projection(tmp_path):
    if int8_kernel.kernel() is None:
        pytest.skip("our int8 kernel does not run here")
    float_model = _llama(tmp_path, "head_dim-biases")
    model = quantize(copy.deepcopy(float_model), "int8")
    attn = model.decoder.layers[0].self_attn
    assert attn.fused and attn.qkv_proj.out_features == (4 + 2 * 2) * 12
    assert type(model.decoder.layers[0].ffn.up) is Int8Linear
    ids = torch.tensor(PROMPTS[1:2] * 2)
    want = float_model(ids)
    assert (model(ids) - want).abs().max() < INT8_LOGIT_TOL * want.abs().max()
    counted = _counting(model)
    cache = causal_cache(model, True)
    tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(3)]
    fast = decode(model, run_decoder, tokens, copy.deepcopy(cache))
    slow = decode(model, general, tokens, copy.deepcopy(cache))
    for f, s in zip(fast, slow, strict=True):
        assert (model.lm_head(f) - model.lm_head(s)).abs().max() < 1e-4
    assert counted.calls == 3
    greedy = decoding("greedy")[0]
    int8_tokens, float_tokens = (best_tokens(generate_causal(m, PROMPTS, greedy)) for m in (model, float_model))
    assert sum(a[:4] == b[:4] for a, b in zip(int8_tokens, float_tokens, strict=True)) >= len(PROMPTS) - 1


def test_int8_quantises_q_k_norm_and_window_blocks_for_the_c_step():
    """q/k norms (Qwen3) and a sliding window (Mistral): int8 projections, fused q/k/v of GQA widths, C++ step."""
    if int8_kernel.kernel() is None:
        pytest.skip("our int8 kernel does not run here")
    torch.manual_seed(0)
    float_model = CausalLM(CausalLMConfig(**OWN, qk_norm=True, sliding_window=3)).eval()
    model = quantize(copy.deepcopy(float_model), "int8")
    assert model.decoder.native and model.decoder.layers[0].self_attn.fused
    counted = _counting(model)
    ids = torch.tensor(PROMPTS[1:2] * 2)
    want = float_model(ids)
    assert (model(ids) - want).abs().max() < INT8_LOGIT_TOL * want.abs().max()
    greedy = decoding("greedy")[0]
    assert best_tokens(generate_causal(model, PROMPTS[:2], greedy))[0][:3] == best_tokens(
        generate_causal(float_model, PROMPTS[:2], greedy))[0][:3]
    assert counted.calls > 0
