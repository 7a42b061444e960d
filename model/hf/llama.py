"""LlamaForCausalLM -> our causal_lm: a thin map of config fields and tensor names onto the flagged blocks.

Llama is pre-norm with RMSNorm (and a final one), rotary positions (half-split layout), grouped-query attention,
a SwiGLU feed-forward (gate_proj -> our fc1, up_proj -> up, down_proj -> fc2), no embedding scaling, and a head
tied or not. Refused by name: pretraining_tp > 1, rope types other than default/linear, hidden_act other than silu.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.config import CausalLMConfig
from model.hf.common import CONFIG_FILE, HFImportError, Tensors, Unsupported, check_supported, field, take

ARCHITECTURES = ("LlamaForCausalLM",)
RULES = (
    Unsupported("pretraining_tp", (1,), "tensor-parallel slicing of the projections"),
    Unsupported("hidden_act", ("silu",), "the gated feed-forward's activation"),
)
ROPE_TYPES = ("default", "linear")
PROJECTIONS = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
               "self_attn.v_proj": "self_attn.v_proj", "self_attn.o_proj": "self_attn.out_proj",
               "mlp.gate_proj": "ffn.fc1", "mlp.up_proj": "ffn.up", "mlp.down_proj": "ffn.fc2"}


def _rope(hf: Mapping[str, Any]) -> tuple[float, float]:
    """(theta, linear scale) from rope_parameters (transformers 5) or rope_theta + rope_scaling (earlier files)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise HFImportError(f"{CONFIG_FILE}: rope_parameters / rope_scaling must be objects")
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise HFImportError(f"{CONFIG_FILE}: rope type {rope_type!r} is not supported for Llama "
                            f"(supported: {list(ROPE_TYPES)})")
    theta = merged.get("rope_theta", field(hf, "rope_theta", (int, float), 10000.0))
    factor = merged.get("factor", 1.0) if rope_type == "linear" else 1.0
    return float(theta), float(factor)


def _token_id(hf: Mapping[str, Any], name: str, vocab: int, default: int) -> int:
    value = hf.get(name)
    if isinstance(value, list):  # several end ids: our config keeps the first
        value = value[0] if value else None
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise HFImportError(f"{CONFIG_FILE}: {name}={value!r} is outside the vocabulary (vocab_size={vocab})")
    return value


def to_config(hf: Mapping[str, Any]) -> CausalLMConfig:
    """Our config for Llama's config.json (HFImportError naming a field we cannot express)."""
    check_supported(hf, RULES, "Llama")
    vocab = field(hf, "vocab_size", default=32000)
    d_model, heads = field(hf, "hidden_size", default=4096), field(hf, "num_attention_heads", default=32)
    theta, scale = _rope(hf)
    bos = _token_id(hf, "bos_token_id", vocab, 1)
    eos = _token_id(hf, "eos_token_id", vocab, 2)
    attention_bias = field(hf, "attention_bias", bool, False)
    return CausalLMConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_heads=heads,
        d_ff=field(hf, "intermediate_size", default=11008),
        dropout=0.0,
        max_len=field(hf, "max_position_embeddings", default=2048),
        positions="rope",
        norm="pre",
        activation="silu",
        bias=attention_bias,
        scale_embeddings=False,
        tie_embeddings=field(hf, "tie_word_embeddings", bool, False),
        final_norm=True,
        layer_norm_eps=field(hf, "rms_norm_eps", float, 1e-6),
        pad_id=_token_id(hf, "pad_token_id", vocab, eos),  # no pad token: rows end at eos
        n_layers=field(hf, "num_hidden_layers", default=32),
        bos_id=bos,
        eos_id=eos,
        norm_type="rms",
        rope_theta=theta,
        rope_scale=scale,
        n_kv_heads=field(hf, "num_key_value_heads", default=heads),
        head_size=field(hf, "head_dim", default=d_model // heads),
        ffn="gated",
        ffn_bias=field(hf, "mlp_bias", bool, False),
    )


def state_dict(c: CausalLMConfig, tensors: Tensors) -> Tensors:
    """Our CausalLM's state dict from Llama's tensors (shapes checked)."""
    d, ff, inner, kv_inner = c.d_model, c.d_ff, c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    shapes = {"self_attn.q_proj": (inner, d), "self_attn.k_proj": (kv_inner, d), "self_attn.v_proj": (kv_inner, d),
              "self_attn.o_proj": (d, inner), "mlp.gate_proj": (ff, d), "mlp.up_proj": (ff, d),
              "mlp.down_proj": (d, ff)}
    embed = take(tensors, "model.embed_tokens.weight", (c.vocab_size, d))
    ours = {"embed.tokens.weight": embed, "decoder.final_norm.weight": take(tensors, "model.norm.weight", (d,))}
    for i in range(c.n_layers):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        for theirs, name in PROJECTIONS.items():
            ours[f"{q}{name}.weight"] = take(tensors, f"{p}{theirs}.weight", shapes[theirs])
            if c.bias if theirs.startswith("self_attn") else c.ffn_bias:
                ours[f"{q}{name}.bias"] = take(tensors, f"{p}{theirs}.bias", shapes[theirs][:1])
        ours[f"{q}self_attn_norm.weight"] = take(tensors, f"{p}input_layernorm.weight", (d,))
        ours[f"{q}ffn_norm.weight"] = take(tensors, f"{p}post_attention_layernorm.weight", (d,))
    ours["lm_head.weight"] = embed if c.tie_embeddings else take(tensors, "lm_head.weight", (c.vocab_size, d))
    return ours
