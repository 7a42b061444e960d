"""What every architecture's exporter shares: the error, the config checks and the tensor helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model.config import TransformerConfig
from training.errors import UserError

Tensors = dict[str, torch.Tensor]
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}  # ACT2FN names, all exact


class ExportError(UserError):
    """The checkpoint cannot be expressed exactly by the target architecture, or the output is in the way."""


@dataclass(frozen=True)
class Need:
    """A config field value an architecture hard-codes."""

    field: str
    value: Any
    meaning: str


def check(config: TransformerConfig, architecture: str, needs: tuple[Need, ...]) -> None:
    """Raise ExportError naming the first field of ``config`` that ``architecture`` cannot express."""
    for need in needs:
        actual = getattr(config, need.field)
        if actual != need.value:
            raise ExportError(
                f"{need.field}={actual!r} but {architecture} needs {need.meaning} ({need.field}={need.value!r})"
            )


def bias(linear: nn.Linear) -> torch.Tensor:
    """The bias, or zeros for a bias-free projection (HF's always have one)."""
    return linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)


def linear(
    prefix: str, layer: nn.Linear, inputs: torch.Tensor | None = None, outputs: torch.Tensor | None = None
) -> Tensors:
    """``prefix``weight/bias, with the input columns and/or the output rows reordered by a permutation."""
    weight, b = layer.weight, bias(layer)
    if inputs is not None:
        weight = weight[:, inputs]
    if outputs is not None:
        weight, b = weight[outputs], b[outputs]
    return {f"{prefix}weight": weight, f"{prefix}bias": b}


def norm(prefix: str, layer: nn.LayerNorm, perm: torch.Tensor | None = None) -> Tensors:
    """``prefix``weight/bias of a LayerNorm, optionally permuted."""
    if perm is None:
        return {f"{prefix}weight": layer.weight, f"{prefix}bias": layer.bias}
    return {f"{prefix}weight": layer.weight[perm], f"{prefix}bias": layer.bias[perm]}
