"""Qwen2ForCausalLM (Qwen2.5) -> our causal_lm: Llama's map (model/hf/llama.py) with biases on q/k/v only.

``use_sliding_window`` is honoured as transformers honours it: ``sliding_window`` on the layers config.json's
layer_types names "sliding_attention" (without layer_types: the layers from ``max_window_layers`` on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.config import CausalLMConfig
from model.hf.common import check_supported, field
from model.hf.llama import PROJECTIONS, RULES, family_fields, layer_types, state_dict, window_fields
from model.hf.llama_adapters import adapter_layout

ARCHITECTURES = ("Qwen2ForCausalLM",)
ADAPTER_LAYOUT = adapter_layout(PROJECTIONS, "Qwen2")  # PEFT adapters: model/hf/llama_adapters.py

__all__ = ["ADAPTER_LAYOUT", "ARCHITECTURES", "qwen_windows", "state_dict", "to_config"]


def qwen_windows(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Our window fields for a Qwen2 / Qwen3 config.json."""
    if not field(hf, "use_sliding_window", bool, False):
        return {}
    n_layers, first = field(hf, "num_hidden_layers"), field(hf, "max_window_layers", default=28)
    layers = layer_types(hf) or [i >= first for i in range(n_layers)]
    return window_fields(hf.get("sliding_window"), layers)


def to_config(hf: Mapping[str, Any]) -> CausalLMConfig:
    """Our config for Qwen2's config.json."""
    check_supported(hf, RULES, "Qwen2")
    return CausalLMConfig(**{**family_fields(hf), "bias": True, "out_bias": False, "ffn_bias": False},
                          **qwen_windows(hf))
