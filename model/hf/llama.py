"""LlamaForCausalLM -> our causal_lm: a thin map of config fields and tensor names onto the flagged blocks.

Llama is pre-norm with RMSNorm (and a final one), rotary positions (half-split layout), grouped-query attention,
a SwiGLU feed-forward (gate_proj -> our fc1, up_proj -> up, down_proj -> fc2), no embedding scaling, and a head
tied or not. Refused by name: pretraining_tp > 1, rope types model.rope does not compute, hidden_act other than silu.

The Llama family's other importers (mistral.py, qwen2.py, qwen3.py, gemma3.py, phi3.py) are this map with their
flags: :func:`family_fields` reads the fields they share, :func:`window_fields` their sliding windows, and
:func:`state_dict` maps their tensors (``norms``: the names of a layer's norms).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.config import CausalLMConfig
from model.hf.common import (
    CONFIG_FILE,
    HFImportError,
    Tensors,
    Unsupported,
    check_supported,
    field,
    take,
    token_id_field,
)
from model.hf.llama_adapters import adapter_layout
from model.hf.rope import max_length, rope_fields

ARCHITECTURES = ("LlamaForCausalLM",)
FAMILY_RULES = (Unsupported("pretraining_tp", (1,), "tensor-parallel slicing of the projections"),)
RULES = (*FAMILY_RULES, Unsupported("hidden_act", ("silu",), "the gated feed-forward's activation"))
PROJECTIONS = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
               "self_attn.v_proj": "self_attn.v_proj", "self_attn.o_proj": "self_attn.out_proj",
               "mlp.gate_proj": "ffn.fc1", "mlp.up_proj": "ffn.up", "mlp.down_proj": "ffn.fc2"}
ADAPTER_LAYOUT = adapter_layout(PROJECTIONS, "Llama")  # PEFT adapters: model/hf/llama_adapters.py
NORMS = {"input_layernorm": "self_attn_norm", "post_attention_layernorm": "ffn_norm"}  # a layer's, theirs -> ours
LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # config.json's layer_types: windowed or not


def to_config(hf: Mapping[str, Any]) -> CausalLMConfig:
    """Our config for Llama's config.json (HFImportError naming a field we cannot express)."""
    check_supported(hf, RULES, "Llama")
    return CausalLMConfig(**family_fields(hf))


def window_fields(window: int | None, layers: list[bool]) -> dict[str, Any]:
    """Our sliding_window / window_layers for a ``window`` (None: off) over the ``layers`` flagged True."""
    if window is None or not any(layers):
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise HFImportError(f"{CONFIG_FILE}: sliding_window={window!r} must be a positive integer")
    return {"sliding_window": window, "window_layers": None if all(layers) else layers}


def layer_types(hf: Mapping[str, Any]) -> list[bool] | None:
    """config.json's layer_types as window flags per layer (None when it has none)."""
    types = hf.get("layer_types")
    if types is None:
        return None
    n_layers = field(hf, "num_hidden_layers")
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise HFImportError(f"{CONFIG_FILE}: layer_types must list one of {sorted(LAYER_TYPES)} per layer "
                            f"({n_layers})")
    return [LAYER_TYPES[t] for t in types]


def family_fields(hf: Mapping[str, Any], **rope: Any) -> dict[str, Any]:
    """Our causal_lm config fields for a Llama-family config.json as Llama reads it (each architecture overrides
    its flags); ``rope``: keyword arguments of model.hf.rope.rope_fields (a layer type, a default base...)."""
    vocab = field(hf, "vocab_size", default=32000)
    d_model, heads = field(hf, "hidden_size", default=4096), field(hf, "num_attention_heads", default=32)
    head_dim = field(hf, "head_dim", default=d_model // heads)
    bos = token_id_field(hf, "bos_token_id", vocab, 1)
    eos = token_id_field(hf, "eos_token_id", vocab, 2)
    attention_bias = field(hf, "attention_bias", bool, False)
    return dict(
        vocab_size=vocab,
        d_model=d_model,
        n_heads=heads,
        d_ff=field(hf, "intermediate_size", default=11008),
        dropout=0.0,
        max_len=max_length(hf),
        positions="rope",
        norm="pre",
        activation="silu",
        bias=attention_bias,
        scale_embeddings=False,
        tie_embeddings=field(hf, "tie_word_embeddings", bool, False),
        final_norm=True,
        layer_norm_eps=field(hf, "rms_norm_eps", float, 1e-6),
        pad_id=token_id_field(hf, "pad_token_id", vocab, eos),  # no pad token: rows end at eos
        n_layers=field(hf, "num_hidden_layers", default=32),
        bos_id=bos,
        eos_id=eos,
        norm_type="rms",
        **rope_fields(hf, head_dim, **rope),
        n_kv_heads=field(hf, "num_key_value_heads", default=heads),
        head_size=head_dim,
        ffn="gated",
        ffn_bias=field(hf, "mlp_bias", bool, False),
    )


def state_dict(c: CausalLMConfig, tensors: Tensors, norms: Mapping[str, str] = NORMS) -> Tensors:
    """Our CausalLM's state dict from Llama-family tensors (shapes checked); ``norms``: a layer's norms, their
    names -> ours."""
    d, ff, inner, kv_inner = c.d_model, c.d_ff, c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    biases = {"self_attn": c.bias, "self_attn.o_proj": c.bias if c.out_bias is None else c.out_bias,
              "mlp": c.ffn_bias}
    shapes = {"self_attn.q_proj": (inner, d), "self_attn.k_proj": (kv_inner, d), "self_attn.v_proj": (kv_inner, d),
              "self_attn.o_proj": (d, inner), "mlp.gate_proj": (ff, d), "mlp.up_proj": (ff, d),
              "mlp.down_proj": (d, ff)}
    embed = take(tensors, "model.embed_tokens.weight", (c.vocab_size, d))
    ours = {"embed.tokens.weight": embed, "decoder.final_norm.weight": take(tensors, "model.norm.weight", (d,))}
    for i in range(c.n_layers):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        for theirs, name in PROJECTIONS.items():
            ours[f"{q}{name}.weight"] = take(tensors, f"{p}{theirs}.weight", shapes[theirs])
            if biases.get(theirs, biases[theirs.split(".")[0]]):
                ours[f"{q}{name}.bias"] = take(tensors, f"{p}{theirs}.bias", shapes[theirs][:1])
        for theirs, name in norms.items():
            ours[f"{q}{name}.weight"] = take(tensors, f"{p}{theirs}.weight", (d,))
        if c.qk_norm:  # per-head norms of q and k
            for name in ("self_attn.q_norm", "self_attn.k_norm"):
                ours[f"{q}{name}.weight"] = take(tensors, f"{p}{name}.weight", (c.head_dim,))
    ours["lm_head.weight"] = embed if c.tie_embeddings else take(tensors, "lm_head.weight", (c.vocab_size, d))
    return ours
