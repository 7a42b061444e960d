"""MistralForCausalLM -> our causal_lm: Llama's map (model/hf/llama.py) with a sliding window on every layer.

``sliding_window`` (None: off): a query attends to the keys less than that many positions back; the cache keeps
every position and the attention mask narrows to the window (model.kv_cache.within_window).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.config import CausalLMConfig
from model.hf.common import check_supported, field
from model.hf.llama import PROJECTIONS, RULES, family_fields, state_dict, window_fields
from model.hf.llama_adapters import adapter_layout

ARCHITECTURES = ("MistralForCausalLM",)
ADAPTER_LAYOUT = adapter_layout(PROJECTIONS, "Mistral")  # PEFT adapters: model/hf/llama_adapters.py

__all__ = ["ADAPTER_LAYOUT", "ARCHITECTURES", "state_dict", "to_config"]


def to_config(hf: Mapping[str, Any]) -> CausalLMConfig:
    """Our config for Mistral's config.json (its layer_types are not read: transformers' Mistral ignores them)."""
    check_supported(hf, RULES, "Mistral")
    window = hf.get("sliding_window")
    return CausalLMConfig(**family_fields(hf), **window_fields(window, [True] * field(hf, "num_hidden_layers")))
