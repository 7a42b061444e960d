"""A model of a config, and where it runs: its family's class, the device and the dtype.

A leaf below model.checkpoint and model.hf, which both build models.
"""

from __future__ import annotations

import torch
from torch import nn

from model.causal_lm import CausalLM
from model.classifier import TransformerClassifier
from model.config import TransformerConfig
from model.seq2seq import Seq2SeqTransformer

MODELS: dict[str, type[nn.Module]] = {
    "seq2seq": Seq2SeqTransformer,
    "classifier": TransformerClassifier,
    "causal_lm": CausalLM,
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def build_model(config: TransformerConfig) -> nn.Module:
    """Instantiate the model class of ``config.family``."""
    return MODELS[config.family](config)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """ "auto" -> CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """ "auto"/None -> bf16 on CUDA (fp16 where bf16 is unsupported), fp32 on CPU. Raises ValueError for a name
    not in DTYPES."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]
