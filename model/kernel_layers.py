"""The layers every model is built from, computing their CPU inference on our kernels.

:class:`Linear` and :class:`LayerNorm` are torch's layers (same parameters, state_dict and training)
whose float32 CPU inference (no autograd) runs on model/kernels; :func:`activate` does the same for
FeedForward's nonlinearity. Everything else (training, other dtypes and devices, a CPU without the
kernels) is torch's own op.

MKL's float32 GEMM copies each weight into its own packed form on every call, which at the row counts
of serving (a 16-token sentence, a batch of decoding rows) costs more than the multiplication: on this
project's AMD EPYC it ran BERT-base's 768 x 3072 weights at 16 rows 3-5x slower than our panel GEMM over
a copy packed once (docs/benchmarks.md, "The panel GEMM for every linear layer"). :func:`linear` is the
one rule for which kernel multiplies:

- more than :data:`model.packed_weights.MAX_GEMV_ROWS` rows (0: always): the panel GEMM over the weight's
  packed copy (model/packed_weights.py);
- otherwise, or with ``TSERVE_PACKED_WEIGHTS=off``, the few-rows GEMV over the weights as stored (input-major
  after model/layout.py), which hands more than 4 rows to MKL (and every row, on a CPU without AVX-512).

On CPUs with AVX2 but no AVX-512 (where MKL's float32 GEMV and GEMM run slowly on AMD) the panel GEMM, norms and
activations run as 8-lane twins of the AVX-512 kernels.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from model import native, packed_weights


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """Our kernels where they compute on ``x``: float32 CPU inference on a CPU that runs them; else None."""
    if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return native.kernels()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on our kernels for float32 CPU inference where they run (see the module's
    rule)."""
    kernels = kernels_for(x)
    if kernels is None or weight.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > packed_weights.MAX_GEMV_ROWS and packed_weights.enabled():
        panels = packed_weights.packed(kernels, weight)
        if panels is not None:
            return kernels.packed_linear(x, panels, weight.shape[0], bias)
    return kernels.few_rows_linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` computing its inference with :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def is_plain(module: nn.Module) -> bool:
    """Whether ``module`` is a float linear layer, ours or torch's: not a LoRA wrapper, not int8."""
    return type(module) in (Linear, nn.Linear)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dimension whose inference runs on the kernels' row LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        if kernels is None or self.weight is None or self.bias is None:
            return super().forward(x)
        return kernels.rows_layer_norm(x, self.weight, self.bias, self.eps)


def is_layer_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a LayerNorm, ours or torch's."""
    return type(module) in (LayerNorm, nn.LayerNorm)


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """FeedForward's nonlinearity by its config name (relu, gelu, gelu_tanh, silu); in place on our kernels."""
    kernels = kernels_for(h)
    if kernels is not None and h.is_contiguous():
        return kernels.rows_activate_(h, kernels.Activation.__members__[activation])
    if activation == "relu":
        return F.relu(h)
    if activation == "silu":
        return F.silu(h)
    return F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
