"""Gemma3ForCausalLM (``gemma3_text``) -> our causal_lm: Llama's map (model/hf/llama.py) with Gemma's flags.

Embeddings scaled by sqrt(hidden) (rounded to the model's dtype), RMSNorm with (1 + weight), GeGLU
(``hidden_activation``), a norm before and after each sub-layer (input / post_attention / pre_feedforward /
post_feedforward), RMSNorm over each head of q and k, scores scaled by ``query_pre_attn_scalar`` ** -0.5, local
layers (layer_types "sliding_attention", or every layer but each ``sliding_window_pattern``-th) attending within
``sliding_window`` with their own unscaled rotary base, and a tied head by default. Refused by name: logit
soft-capping (final or in attention) and bidirectional attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.config import CausalLMConfig
from model.hf.common import CONFIG_FILE, HFImportError, Tensors, Unsupported, activation, check_supported, field
from model.hf.llama import FAMILY_RULES, PROJECTIONS, family_fields, layer_types, window_fields
from model.hf.llama import state_dict as llama_state_dict
from model.hf.llama_adapters import adapter_layout
from model.hf.rope import rope_fields

ARCHITECTURES = ("Gemma3ForCausalLM",)
ADAPTER_LAYOUT = adapter_layout(PROJECTIONS, "Gemma 3")  # PEFT adapters: model/hf/llama_adapters.py
RULES = (*FAMILY_RULES,
         Unsupported("final_logit_softcapping", (None,), "tanh soft-capping of the logits"),
         Unsupported("attn_logit_softcapping", (None,), "tanh soft-capping of the attention scores"),
         Unsupported("use_bidirectional_attention", (False, None), "bidirectional attention"))
NORMS = {"input_layernorm": "self_attn_norm", "post_attention_layernorm": "self_attn_post_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "ffn_post_norm"}
LAYER_TYPES = ("full_attention", "sliding_attention")  # the keys of rope_parameters given per layer type
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' defaults

__all__ = ["ADAPTER_LAYOUT", "ARCHITECTURES", "state_dict", "to_config"]


def to_config(hf: Mapping[str, Any]) -> CausalLMConfig:
    """Our config for Gemma 3's config.json."""
    check_supported(hf, RULES, "Gemma 3")
    n_layers = field(hf, "num_hidden_layers", default=26)
    pattern = field(hf, "sliding_window_pattern", default=6)
    local = layer_types(hf) or [bool((i + 1) % pattern) for i in range(n_layers)]
    windows = window_fields(hf.get("sliding_window"), local)
    if any(local) and not windows:
        raise HFImportError(f"{CONFIG_FILE}: sliding_attention layers need a sliding_window")
    params = hf.get("rope_parameters")
    per_type = isinstance(params, dict) and any(key in params for key in LAYER_TYPES)
    fields = family_fields(hf, layer_type="full_attention" if per_type else None, default_theta=GLOBAL_THETA)
    if windows:
        windows["rope_local_theta"] = _local_theta(hf, fields, per_type)
    scalar = field(hf, "query_pre_attn_scalar", (int, float), 256)
    if scalar <= 0:
        raise HFImportError(f"{CONFIG_FILE}: query_pre_attn_scalar={scalar!r} must be positive")
    return CausalLMConfig(**{
        **fields,
        "activation": activation(hf, "hidden_activation", "gelu_pytorch_tanh"),
        "tie_embeddings": field(hf, "tie_word_embeddings", bool, True),
        "scale_embeddings": True,
        "norm_offset": True,
        "sandwich_norm": True,
        "qk_norm": True,
        "attention_scale": float(scalar) ** -0.5,
        **windows,
    })


def _local_theta(hf: Mapping[str, Any], fields: Mapping[str, Any], per_type: bool) -> float:
    """The local layers' rotary base: plain rope (no scaling), as wide as the global layers'."""
    default = field(hf, "rope_local_base_freq", (int, float), LOCAL_THETA)
    if not per_type:  # older files: rope_theta / rope_scaling are the global layers', rope_local_base_freq local
        return float(default)
    local = rope_fields(hf, fields["head_size"], layer_type="sliding_attention", default_theta=default)
    if local["rope_scaling"] is not None or local["rotary_dim"] != fields["rotary_dim"]:
        raise HFImportError(f"{CONFIG_FILE}: rope_parameters['sliding_attention'] with scaling or another rotary "
                            "width is not supported for Gemma 3 (its local layers use plain rope)")
    return local["rope_theta"]


def state_dict(c: CausalLMConfig, tensors: Tensors) -> Tensors:
    """Our CausalLM's state dict from Gemma 3's tensors (four norms per layer)."""
    return llama_state_dict(c, tensors, NORMS)
