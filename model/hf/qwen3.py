"""Qwen3ForCausalLM -> our causal_lm: Llama's map (model/hf/llama.py) with an RMSNorm over each head of q and k
(``q_norm`` / ``k_norm``, before rope), ``attention_bias`` on all four projections, and Qwen2's sliding windows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.config import CausalLMConfig
from model.hf.common import check_supported
from model.hf.llama import PROJECTIONS, RULES, family_fields, state_dict
from model.hf.llama_adapters import adapter_layout
from model.hf.qwen2 import qwen_windows

ARCHITECTURES = ("Qwen3ForCausalLM",)
ADAPTER_LAYOUT = adapter_layout(PROJECTIONS, "Qwen3")  # PEFT adapters: model/hf/llama_adapters.py

__all__ = ["ADAPTER_LAYOUT", "ARCHITECTURES", "state_dict", "to_config"]


def to_config(hf: Mapping[str, Any]) -> CausalLMConfig:
    """Our config for Qwen3's config.json."""
    check_supported(hf, RULES, "Qwen3")
    return CausalLMConfig(**family_fields(hf), qk_norm=True, **qwen_windows(hf))
