"""bf16 serving weights (model.quantize "bf16"): the layers int8 replaces, logits and greedy outputs near fp32, LoRA
per row over a bf16 base, the restricted head, and what a bf16 model refuses (merging, saving, a GPU)."""

import copy
import logging

import pytest
import torch

from model import native
from model.bf16_linear import Bf16Linear
from model.checkpoint import CheckpointError, save_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.kernel_layers import is_plain
from model.lora import AdapterError, LoRAConfig, add_adapter, delete_adapter, merge_adapter, use_adapters
from model.lora_layers import LoRALinear
from model.quantize import QUANTIZE_MODES, QuantizeError, mode_for, quantize, quantize_bf16, quantize_int8
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_seq2seq
from tests.model.test_fast_path import trained_lm, trained_mt  # noqa: F401 (module fixtures: the same trained models)

GREEDY = GenerationConfig(max_new_tokens=10)
# |bf16 - fp32| logits relative to the largest fp32 logit: weights and activations rounded to 8 mantissa bits
# (relative error <= 2^-9 each) over 2-layer, d_model 32 sums; measured under 1% on these models, int8's bound is 10%.
BF16_LOGIT_TOL = 0.03


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    quantized = copy.deepcopy(model)
    quantize_bf16(quantized)
    return quantized


def _with_adapter(model: torch.nn.Module, name: str = "a", seed: int = 1) -> torch.nn.Module:
    """``model`` with adapter ``name`` on q_proj and v_proj, its B random (a delta that changes outputs)."""
    add_adapter(model, name, LoRAConfig(r=4, target_modules=("q_proj", "v_proj")), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear) and name in m.lora_B:
                m.lora_B[name].weight.copy_(0.5 * torch.randn(m.lora_B[name].weight.shape, generator=generator))
    return model


def test_bf16_replaces_the_layers_int8_does_and_leaves_adapters_and_embeddings_float():
    lm = _with_adapter(tiny_causal_lm())  # tied embeddings
    int8, bf16 = copy.deepcopy(lm), copy.deepcopy(lm)
    assert quantize_bf16(bf16) == quantize_int8(int8) > 0  # one rule finds the targets of both
    lora = [m for m in bf16.modules() if isinstance(m, LoRALinear)]
    assert lora and all(type(m.base) is Bf16Linear for m in lora)
    adapters = {id(m) for layer in lora for m in (layer.lora_A["a"], layer.lora_B["a"])}
    assert {id(m) for m in bf16.modules() if is_plain(m)} == adapters  # the adapters alone stay float Linears
    assert all(m.lora_A["a"].weight.dtype == m.lora_B["a"].weight.dtype == torch.float32 for m in lora)
    assert type(bf16.lm_head) is Bf16Linear and bf16.embed.tokens.weight.dtype == torch.float32  # tied: kept float
    assert bf16.decoder.layers[0].self_attn.qkv_proj is None  # an adapter wraps q and v: no fused projection
    plain = _bf16(tiny_causal_lm())
    attn = plain.decoder.layers[0].self_attn
    assert type(attn.qkv_proj) is Bf16Linear and attn.fused
    _with_adapter(plain)  # a hot-swapped adapter: back to the separate layers while it is there
    assert not attn.fused
    delete_adapter(plain, "a")
    assert attn.fused
    x = torch.randn(2, 3, 32)
    with torch.inference_mode():  # the fused rows are the separate layers' rows
        fused = attn.qkv_proj(x)
        torch.testing.assert_close(fused, torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1))


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_bf16_upcast_per_call_is_named_a_slow_choice(caplog, kernels):
    """Where the layers upcast their weights at every call (no AVX512-BF16, or the kernels off), quantising says
    so as a warning; with our bf16 kernel it does not."""
    with native.using_options(decode_kernels=kernels == "on"), caplog.at_level(logging.INFO, logger="model.quantize"):
        model = _bf16(tiny_causal_lm())
    backends = {m.backend for m in model.modules() if type(m) is Bf16Linear}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "upcast to float32" in r.message]
    assert backends and len(warned) == (1 if "torch" in backends else 0)
    assert kernels == "on" or backends == {"torch"}


def test_bf16_logits_close_and_greedy_outputs_equal(trained_mt, trained_lm):  # noqa: F811
    """Both models were trained to confident outputs (reversal, counting), so bf16's rounding moves no greedy token:
    a margin between the best two logits of more than 2 x BF16_LOGIT_TOL of the largest logit survives it."""
    mt16, lm16 = _bf16(trained_mt), _bf16(trained_lm)
    src, tgt, ids = random_ids(4, 6, seed=5), random_ids(4, 5, seed=9), random_ids(4, 8, seed=6)
    with torch.inference_mode():
        for got, want in ((mt16(src, tgt), trained_mt(src, tgt)), (lm16(ids), trained_lm(ids))):
            assert got.dtype == torch.float32
            assert (got - want).abs().max() < BF16_LOGIT_TOL * want.abs().max()
            assert (got - want).abs().max() > 0  # the rounding happened
    sources = random_ids(6, 6, seed=5).tolist()
    assert [h[0].tokens for h in generate_seq2seq(mt16, sources, GREEDY)] == \
        [h[0].tokens for h in generate_seq2seq(trained_mt, sources, GREEDY)]
    prompts = [[9, 10, 11], [20], [30, 31, 32, 33]]
    assert [h[0].tokens for h in generate_causal(lm16, prompts, GREEDY)] == \
        [h[0].tokens for h in generate_causal(trained_lm, prompts, GREEDY)]


def _logits(model: torch.nn.Module, adapters: list[str | None] | None) -> torch.Tensor:
    with torch.inference_mode(), use_adapters(model, adapters):
        return model(random_ids(3, 6, seed=3), random_ids(3, 4, seed=4))


def test_lora_per_row_on_bf16_equals_lora_on_fp32_and_hot_swaps():
    """Adapters loaded after quantising (the service's order): rows choosing a, b or the base get their own delta
    over the bf16 base, as on fp32; removing one and adding another leaves the rest as they were."""
    fp32 = tiny_seq2seq()
    bf16 = _bf16(fp32)
    for model in (fp32, bf16):
        _with_adapter(_with_adapter(model, "a", seed=1), "b", seed=2)
    rows = ["a", None, "b"]
    want, got, base = _logits(fp32, rows), _logits(bf16, rows), _logits(bf16, None)
    scale = want.abs().max()
    assert (got - want).abs().max() < BF16_LOGIT_TOL * scale
    assert (got[0] - base[0]).abs().max() > 2 * BF16_LOGIT_TOL * scale  # the adapter's delta is there
    torch.testing.assert_close(got[1], base[1])  # the base row: no delta
    delete_adapter(bf16, "b")
    _with_adapter(bf16, "c", seed=2)  # b's weights under another name
    torch.testing.assert_close(_logits(bf16, ["a", None, "c"]), got)
    with pytest.raises(AdapterError, match=r"quantised \(bf16\)"):
        merge_adapter(bf16, "a")


def test_bf16_refuses_what_it_cannot_do(tmp_path):
    """Unknown modes name the list; a merged adapter, a model off the CPU and saving a bf16 model are refused."""
    assert "bf16" in QUANTIZE_MODES and mode_for("none,mt=bf16", "mt") == "bf16" and mode_for("bf16", "x") == "bf16"
    with pytest.raises(QuantizeError, match=r"'fp8'.*\['none', 'int8', 'bf16'\]"):
        mode_for("mt=fp8", "mt")
    with pytest.raises(QuantizeError, match=r"'fp8'.*\['none', 'int8', 'bf16'\]"):
        quantize(tiny_causal_lm(), "fp8")
    merged = tiny_seq2seq()
    add_adapter(merged, "m", LoRAConfig(r=2), seed=0)
    merge_adapter(merged, "m")
    with pytest.raises(QuantizeError, match="merged"):
        quantize_bf16(merged)
    with pytest.raises(QuantizeError, match="CPU only.*dtype"):
        quantize_bf16(tiny_causal_lm().to("meta"))  # any device but the CPU: a GPU model lowers its dtype instead
    with pytest.raises(QuantizeError, match="float32 weights"):
        quantize_bf16(tiny_causal_lm().to(torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"quantised \(bf16\)"):
        save_checkpoint(tmp_path / "bf16", _bf16(tiny_causal_lm()), None)
    assert not (tmp_path / "bf16").exists()
