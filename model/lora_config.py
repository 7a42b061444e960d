"""LoRA adapter configuration: the subset of PEFT's LoraConfig implemented here, and its errors.

model.lora attaches adapters built from these configs; model.lora_io reads and writes them as PEFT's
adapter_config.json.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT options that change the math when set (truthy); rejected rather than silently ignored.
_UNSUPPORTED = ("fan_in_fan_out", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "layers_to_transform")
# modules_to_save names we take: a classifier's head (PEFT's SEQ_CLS task type lists both; a model has one at most),
# a language model's head and its token embeddings (our Embeddings' ``tokens``)
CLASSIFIER_HEADS = ("classifier", "score", "pooler")  # the head, its dense (BERT's pooler, RoBERTa's dense)
HEAD_NORM = "head_norm"  # the LayerNorm after a classifier head's dense (ModernBERT's head.norm)
HEADS = (*CLASSIFIER_HEADS, HEAD_NORM, "lm_head", "tokens")
# Bounds on an adapter_config.json, checked before its contents are used. PEFT writes ~1 KB, nested 2 deep.
MAX_CONFIG_BYTES = 64 * 1024
MAX_CONFIG_DEPTH = 16  # objects/arrays within each other (a deeper file is refused before anything recurses on it)
MAX_RANK = 65536  # far above any layer width; keeps shapes and messages small (the shape check is exact)
QUOTE_CHARS = 64  # user-supplied names and values are quoted in errors up to this many characters


# The one rule for adapter (and model) names: also a directory name, never hidden or an option.
NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"
NAME_RULE = "1-64 of [A-Za-z0-9_.-], not starting with '.' or '-'"
_NAME = re.compile(NAME_PATTERN)


class AdapterError(ValueError):
    """A user-facing LoRA failure; the message names the adapter, file or tensor involved."""


def is_valid_name(name: object) -> bool:
    """Whether ``name`` follows :data:`NAME_RULE`."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def quote(value: object) -> str:
    """``repr(value)`` cut to :data:`QUOTE_CHARS` characters (then "…"): user-supplied text in error messages."""
    try:
        text = repr(value)
    except ValueError:  # an int of more than sys.get_int_max_str_digits() digits
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "…"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond float's range
        return False


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
    modules_to_save: tuple[str, ...] | None = None  # modules the adapter carries its own copies of (HEADS)

    def __post_init__(self) -> None:
        targets = self.target_modules
        checks = {
            "r": _is_int(self.r) and 1 <= self.r <= MAX_RANK,
            "lora_alpha": _is_real(self.lora_alpha) and self.lora_alpha > 0,
            "lora_dropout": _is_real(self.lora_dropout) and 0 <= self.lora_dropout < 1,
            "target_modules": isinstance(targets, list | tuple) and len(targets) > 0
            and all(isinstance(t, str) and t for t in targets),
            "bias": self.bias == "none",
            "task_type": self.task_type is None or isinstance(self.task_type, str),
            "base_model_name_or_path": self.base_model_name_or_path is None
            or isinstance(self.base_model_name_or_path, str),
            "modules_to_save": self.modules_to_save is None or isinstance(self.modules_to_save, list | tuple)
            and all(isinstance(m, str) for m in self.modules_to_save),
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            got = ", ".join(f"{k}={quote(getattr(self, k))}" for k in bad)
            raise AdapterError(f"invalid LoRAConfig: {got} (r int in 1..{MAX_RANK}, finite lora_alpha > 0, "
                               "0 <= lora_dropout < 1, non-empty target_modules of names, bias 'none', "
                               "modules_to_save a list of names)")
        self.target_modules = tuple(targets)
        self.modules_to_save = tuple(self.modules_to_save) if self.modules_to_save else None
        others = [m for m in self.modules_to_save or () if m not in HEADS]
        if others:
            raise AdapterError(f"modules_to_save {quote(others)} is not supported: only a classifier's head "
                               f"({', '.join(CLASSIFIER_HEADS)}) and its norm ({HEAD_NORM}), a language model's "
                               "lm_head or its token embeddings (tokens)")
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
            "modules_to_save": list(self.modules_to_save) if self.modules_to_save else None,
            "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False, "use_dora": False, "revision": None,
        }

    @classmethod
    def from_peft_dict(cls, d: Mapping[str, Any]) -> LoRAConfig:
        """Parse PEFT's adapter_config.json contents; unknown keys are ignored, unsupported features rejected."""
        if not isinstance(d, Mapping):
            raise AdapterError(f"adapter config must be a JSON object, got {type(d).__name__}")
        if d.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"peft_type must be 'LORA', got {quote(d.get('peft_type'))}")
        unsupported = {k: d[k] for k in _UNSUPPORTED if d.get(k)}
        if unsupported:
            raise AdapterError(f"unsupported PEFT options {quote(unsupported)}")
        if isinstance(d.get("target_modules"), str):
            raise AdapterError(f"target_modules must be a list of module names, got the string "
                               f"{quote(d['target_modules'])} (regex/'all-linear' are not supported)")
        config = cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
        if d.get("use_rslora"):  # rank-stabilised: scaling lora_alpha / sqrt(r), the same as this alpha over r
            config.lora_alpha *= math.sqrt(config.r)
        return config

    @classmethod
    def from_json(cls, raw: bytes, source: str = CONFIG_FILE,
                  rename: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> LoRAConfig:
        """Parse adapter_config.json's bytes within :data:`MAX_CONFIG_BYTES` and :data:`MAX_CONFIG_DEPTH`;
        errors name ``source`` (the file). ``rename`` maps the parsed dict onto our module names first (an
        adapter trained on a Hugging Face model: model.lora_io.AdapterLayout)."""
        if len(raw) > MAX_CONFIG_BYTES:
            raise AdapterError(f"cannot read {source}: over {MAX_CONFIG_BYTES} bytes")
        too_deep = AdapterError(f"cannot read {source}: nested more than {MAX_CONFIG_DEPTH} levels deep")
        try:
            d = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise too_deep from None
        except ValueError as e:  # invalid UTF-8 or JSON, or an integer of more than 4300 digits
            reason = str(e).split(";")[0]  # not Python's advice (after ';') on raising the digit limit
            raise AdapterError(f"cannot read {source}: not valid JSON: {reason}") from None
        if _depth_over(d, MAX_CONFIG_DEPTH):
            raise too_deep
        try:
            return cls.from_peft_dict(rename(d) if rename is not None and isinstance(d, dict) else d)
        except AdapterError as e:
            raise AdapterError(f"{source}: {e}") from None


def _depth_over(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests objects/arrays more than ``limit`` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False
