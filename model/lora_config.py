"""LoRA adapter configuration: the subset of PEFT's LoraConfig implemented here, and its errors.

model.lora attaches adapters built from these configs; model.lora_io reads and writes them as PEFT's
adapter_config.json.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# PEFT options that change the math when set (truthy); rejected rather than silently ignored.
_UNSUPPORTED = ("fan_in_fan_out", "use_dora", "use_rslora", "lora_bias", "rank_pattern", "alpha_pattern",
                "modules_to_save", "layers_to_transform")

class AdapterError(ValueError):
    """A user-facing LoRA failure; the message names the adapter, file or tensor involved."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class LoRAConfig:
    """Hyperparameters of one adapter (the subset of PEFT's LoraConfig implemented here)."""

    r: int = 8  # rank: A is (r, in_features), B is (out_features, r)
    lora_alpha: float = 16.0  # scaling = lora_alpha / r
    lora_dropout: float = 0.0  # dropout on the adapter's input only (training mode)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")  # last name components
    bias: str = "none"  # only "none": biases stay those of the base layers
    task_type: str | None = None  # PEFT's task_type, e.g. "SEQ_2_SEQ_LM"; informational
    base_model_name_or_path: str | None = None

    def __post_init__(self) -> None:
        targets = self.target_modules
        checks = {
            "r": _is_int(self.r) and self.r >= 1,
            "lora_alpha": _is_real(self.lora_alpha) and self.lora_alpha > 0,
            "lora_dropout": _is_real(self.lora_dropout) and 0 <= self.lora_dropout < 1,
            "target_modules": isinstance(targets, list | tuple) and len(targets) > 0
            and all(isinstance(t, str) and t for t in targets),
            "bias": self.bias == "none",
            "task_type": self.task_type is None or isinstance(self.task_type, str),
            "base_model_name_or_path": self.base_model_name_or_path is None
            or isinstance(self.base_model_name_or_path, str),
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            got = ", ".join(f"{k}={getattr(self, k)!r}" for k in bad)
            raise AdapterError(f"invalid LoRAConfig: {got} (r int >= 1, lora_alpha > 0, 0 <= lora_dropout < 1, "
                               "non-empty target_modules of names, bias 'none')")
        self.target_modules = tuple(targets)
        self.lora_alpha = float(self.lora_alpha)
        self.lora_dropout = float(self.lora_dropout)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r

    def to_peft_dict(self) -> dict[str, Any]:
        """The contents of PEFT's adapter_config.json for this adapter."""
        return {
            "peft_type": "LORA", "task_type": self.task_type,
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
            "target_modules": list(self.target_modules), "bias": self.bias,
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False, "use_dora": False, "revision": None,
        }

    @classmethod
    def from_peft_dict(cls, d: Mapping[str, Any]) -> LoRAConfig:
        """Parse PEFT's adapter_config.json contents; unknown keys are ignored, unsupported features rejected."""
        if not isinstance(d, Mapping):
            raise AdapterError(f"adapter config must be a JSON object, got {type(d).__name__}")
        if d.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"peft_type must be 'LORA', got {d.get('peft_type')!r}")
        unsupported = {k: d[k] for k in _UNSUPPORTED if d.get(k)}
        if unsupported:
            raise AdapterError(f"unsupported PEFT options {unsupported}")
        if isinstance(d.get("target_modules"), str):
            raise AdapterError(f"target_modules must be a list of module names, got the string "
                               f"{d['target_modules']!r} (regex/'all-linear' are not supported)")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
