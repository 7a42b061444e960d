"""Phi3ForCausalLM (Phi-3, Phi-4-mini) -> our causal_lm: Llama's map (model/hf/llama.py) after splitting the fused
projections (``qkv_proj`` rows: q, then k, then v; ``gate_up_proj`` rows: the gate, then up), with a
``sliding_window`` on every layer when set, partial rotary (``partial_rotary_factor``) and longrope (legacy "su" /
"yarn" types read as longrope, as transformers reads them) through model/hf/rope.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from model.config import CausalLMConfig
from model.hf.common import Tensors, check_supported, field, take
from model.hf.llama import PROJECTIONS, RULES, family_fields, window_fields
from model.hf.llama import state_dict as llama_state_dict
from model.hf.llama_adapters import adapter_layout, fused_projections

ARCHITECTURES = ("Phi3ForCausalLM",)
ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}  # Phi-3's fused projections: Llama's, in row order
# PEFT adapters (model/hf/llama_adapters.py): a fused module's LoRA splits into our parts, in its order
ADAPTER_LAYOUT = adapter_layout(fused_projections(PROJECTIONS, FUSED), "Phi-3")

__all__ = ["ADAPTER_LAYOUT", "ARCHITECTURES", "state_dict", "to_config"]


def to_config(hf: Mapping[str, Any]) -> CausalLMConfig:
    """Our config for Phi-3's config.json."""
    check_supported(hf, RULES, "Phi-3")
    window = hf.get("sliding_window")
    return CausalLMConfig(**family_fields(hf, aliases=ROPE_ALIASES),
                          **window_fields(window, [True] * field(hf, "num_hidden_layers")))


def state_dict(c: CausalLMConfig, tensors: Tensors) -> Tensors:
    """Our CausalLM's state dict from Phi-3's tensors: the fused projections split into Llama's names."""
    d, inner, kv_inner = c.d_model, c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    split = dict(tensors)
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        qkv = take(tensors, f"{p}self_attn.qkv_proj.weight", (inner + 2 * kv_inner, d))
        q, k, v = torch.split(qkv, [inner, kv_inner, kv_inner])
        gate, up = take(tensors, f"{p}mlp.gate_up_proj.weight", (2 * c.d_ff, d)).chunk(2)
        split |= {f"{p}self_attn.q_proj.weight": q, f"{p}self_attn.k_proj.weight": k,
                  f"{p}self_attn.v_proj.weight": v, f"{p}mlp.gate_proj.weight": gate, f"{p}mlp.up_proj.weight": up}
    return llama_state_dict(c, split)
