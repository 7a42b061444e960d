"""The bf16 linear layer: y = x W^T + b with W stored in bf16 (half of float32's bytes); CPU inference only.

Batch-1 decoding reads every weight once per token, so halving the weights' bytes is up to twice its speed. Each
call rounds x to bf16 (round to nearest even, as ``x.bfloat16()``), multiplies by the bf16 weights and sums the
products in float32 (AVX512-BF16's ``VDPBF16PS`` takes pairs of bf16 and accumulates in float32): the output and
the bias are float32, not rounded to bf16 as PyTorch's own bf16 ``linear`` rounds its output.

Two backends (:attr:`Bf16Linear.backend`), the same numbers up to the order of the float32 sums:

- ``kernel``: ours (model/kernels/bf16_linear.cpp) where the C++ kernels run (model.native.kernels(): AVX-512 or
  AVX2 + FMA, not under ``TSERVE_DECODE_KERNELS=off``), over weights packed once (:func:`pack`): VDPBF16PS where the
  CPU has AVX512-BF16 (AMD Zen 4, Intel Cooper Lake and later), else the kernel's AVX2 twin, which splits each pair
  into two float32 weights for float32 FMAs (the same exact products);
- ``torch`` elsewhere: the bf16 x and weights upcast to float32 per call and one float32 GEMM (exact: a product of
  two bf16 values fits float32's mantissa). PyTorch 2.13 on CPU has no bf16 GEMM with a float32 output
  (``torch.mm(..., out_dtype=torch.float32)`` is CUDA-only) and oneDNN's bf16 ``linear`` rounds its output to bf16
  (errors of 2^-9 of the output), so the upcast is the fastest exact one: it costs a float32 copy of the weights
  per call (docs/benchmarks.md, issue 40's section).

A leaf of the model package: it imports model.native only.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from model import native

PANEL = 32  # outputs per packed panel (bf16_linear.cpp's kPanel): two 16-lane float32 accumulators per row
BACKENDS = ("auto", "kernel", "torch")


def kernel() -> ModuleType | None:
    """The C++ kernels where our bf16 GEMM runs on this CPU (and the decoding kernels are on), else None."""
    return native.kernels()


def pack(w: torch.Tensor) -> torch.Tensor:
    """bf16 weights (out, in) -> the kernel's [ceil(out/32)][ceil(in/2)][32][2] layout, zero-padded: each 64-byte
    half of a panel row holds 16 outputs' pairs of consecutive inputs, as VDPBF16PS multiplies them."""
    out, inp = w.shape
    padded = torch.zeros(-(-out // PANEL) * PANEL, -(-inp // 2) * 2, dtype=torch.bfloat16)
    padded[:out, :inp] = w
    return padded.view(-1, PANEL, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The inverse of :func:`pack`: bf16 weights (out, in)."""
    panels, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(panels * PANEL, pairs * 2)[:out, :inp]


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor, inp: int) -> torch.Tensor:
    """Rows ``ids`` of :func:`unpack`'s weights (len(ids), in), read straight from the packed layout."""
    return packed[ids // PANEL, :, ids % PANEL, :].reshape(ids.shape[0], -1)[:, :inp]


def reference_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch backend: x (..., in) float32 rounded to bf16, times bf16 ``w`` (out, in), summed in float32."""
    y = x.to(torch.bfloat16).float() @ w.float().T
    return y + bias if bias is not None else y


class Bf16Linear(nn.Module):
    """y = x W^T + b with W bf16, x rounded to bf16 per call, float32 sums, bias and output; CPU only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str = "auto") -> None:
        """Round ``weight`` (out, in) to bf16; ``bias`` (out,) stays float32. ``backend``: one of BACKENDS
        (``kernel``: ours or an error; ``torch``: the fallback, on any machine)."""
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {list(BACKENDS)}")
        self.out_features, self.in_features = weight.shape
        w = weight.detach().to(torch.bfloat16)
        self._bias = bias.detach().float().contiguous() if bias is not None else None
        module = kernel() if backend != "torch" else None
        if backend == "kernel" and module is None:
            raise RuntimeError("backend='kernel': the C++ kernels do not run here (no AVX-512 or AVX2, or turned off)")
        if module is not None:
            self.backend, self._kernel_linear, self._w = "kernel", module.bf16_linear, pack(w)
        else:
            self.backend, self._kernel_linear, self._w = "torch", None, w.contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "auto") -> Bf16Linear:
        return cls(linear.weight, linear.bias, backend)

    def _bf16_weight(self) -> torch.Tensor:
        """The bf16 weights (out, in), a view or a fresh copy."""
        if self.backend == "kernel":
            return unpack(self._w, self.out_features, self.in_features)
        return self._w

    def rows(self, ids: torch.Tensor) -> Bf16Linear:
        """The layer of output rows ``ids`` alone (a restricted vocabulary's head: model.restricted_vocab), with the
        same bf16 weights: its outputs are those rows of this layer's."""
        if self.backend == "kernel":
            w = unpack_rows(self._w, ids, self.in_features)
        else:
            w = self._w.index_select(0, ids)
        bias = self._bias.index_select(0, ids) if self._bias is not None else None
        return Bf16Linear(w, bias, self.backend)

    @property
    def weight(self) -> torch.Tensor:
        """The bf16 weight (out, in) in float32: a fresh copy, writes to it change nothing."""
        return self._bf16_weight().float()

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    @property
    def packed(self) -> torch.Tensor | None:
        """Our kernel's packed weights (model/kernels/decode_step.cpp reads them), None under the torch backend."""
        return self._w if self.backend == "kernel" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) float32 -> (..., out) float32 (ours without autograd, the same sums through torch with it)."""
        if self._kernel_linear is not None and not torch.is_grad_enabled():
            return self._kernel_linear(x, self._w, self.out_features, self._bias)
        return reference_linear(x, self._bf16_weight(), self._bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self._bias is not None}, "
                f"bf16, {self.backend}")
