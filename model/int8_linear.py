"""The int8 linear layer: y = x W^T + b with W int8 per output channel; CPU inference only.

Each weight is stored as int8 with one scale per output channel (symmetric, max-abs / 127); each call
quantises its activations on the fly and runs an int8 GEMM. Two GEMMs (``model.int8_kernel`` picks,
``TSERVE_INT8_KERNEL``):

- ours on CPUs with AVX512-VNNI or AVX2 (model/kernels/int8_gemm.cpp; the same outputs from either): activations
  quantised per row on 8 bits, so a row's result does not depend on the rest of its batch; 1.2-1.8x fbgemm's speed
  at 1-64 rows on AVX512-VNNI, 1.1-3.9x at 1-4 rows and 0.86-0.96x at 64-256 on AVX2 (docs/benchmarks.md, "int8
  layers on AVX2");
- fbgemm's ``quantized::linear_dynamic`` elsewhere: activations per tensor on 7 bits
  (``reduce_range=True``, PyTorch's default: CPUs without VNNI can saturate 16-bit sums otherwise).

A FeedForward's fc1 may ask for its activation with the product (:meth:`Int8Linear.activated`): ours applies it to
each output vector before storing it, so no pass over the (rows, d_ff) output follows; and with ours on both, fc2 may
take that output already quantised (:meth:`Int8Linear.activated_into`: quantised in fc1's GEMM while in L2); a gated
FeedForward's gate and up run as one GEMM over both weights on one quantised input, its product quantised for fc2 the
same way (:meth:`Int8Linear.gated_into`).

Near a leaf of the model package: it imports model.int8_kernel and model.kernel_layers only (model.layers,
model.quantize, model.lora and model.fast_step import it).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from model import int8_kernel
from model.kernel_layers import activate

# The overload's C++ entry point: skips per-call overload resolution and OpOverload.__call__'s Python-side
# dispatch checks (4-7% of an int8 decode at batch 1-4 on this machine); the overload where it is absent.
_LINEAR_DYNAMIC = getattr(torch.ops.quantized.linear_dynamic.default, "_op", torch.ops.quantized.linear_dynamic.default)


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantised per call; CPU only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool = True) -> None:
        """Quantise ``weight`` (out, in); ``bias`` (out,) stays float. ``reduce_range``: fbgemm's 7-bit activations."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.reduce_range = reduce_range
        w = weight.detach().float()
        scales = (torch.maximum(w.amax(dim=1), -w.amin(dim=1)) / 127).clamp(min=1e-12)  # max |w|, no |w| copy
        bias = bias.detach().float().contiguous() if bias is not None else None
        kernel = int8_kernel.kernel()
        if kernel is not None:
            q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # one float temporary, not three
            self.backend = "kernel"
            # the kernels' functions and enum, not their module: a deepcopy of the model copies neither
            self._kernel_linear, self._kernel_activated = kernel.int8_linear, kernel.int8_linear_activated
            self._kernel_into = kernel.int8_linear_activated_quantized
            self._kernel_quantized, self._kernel_gated = kernel.int8_linear_quantized, kernel.int8_gated_quantized
            self._activations = kernel.Activation
            self._packed = int8_kernel.pack(q)
            self._scales, self._sums, self._bias = scales, q.sum(dim=1, dtype=torch.int32), bias
            return
        self.backend = "fbgemm"
        with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch 2.10+, still the way in
            warnings.simplefilter("ignore", UserWarning)
            zero_points = torch.zeros(self.out_features, dtype=torch.long)
            q = torch.quantize_per_channel(w, scales.double(), zero_points, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(q, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def rows(self, ids: torch.Tensor) -> Int8Linear:
        """The layer of output rows ``ids`` alone (a restricted vocabulary's head: model.restricted_vocab), with the
        same int8 weights and scales: its outputs are those rows of this layer's."""
        if self.backend != "kernel":  # quantising the dequantised rows again gives the same int8 values and scales
            bias = self.bias.index_select(0, ids) if self.bias is not None else None
            return Int8Linear(self.weight.index_select(0, ids), bias, self.reduce_range)
        layer = Int8Linear.__new__(Int8Linear)
        nn.Module.__init__(layer)
        q = int8_kernel.unpack_rows(self._packed, ids, self.in_features)
        layer.out_features, layer.in_features, layer.reduce_range = ids.shape[0], self.in_features, self.reduce_range
        layer.backend, layer._kernel_linear, layer._packed = "kernel", self._kernel_linear, int8_kernel.pack(q)
        layer._kernel_activated, layer._activations = self._kernel_activated, self._activations
        layer._kernel_into, layer._kernel_quantized = self._kernel_into, self._kernel_quantized
        layer._kernel_gated = self._kernel_gated
        layer._scales, layer._sums = self._scales.index_select(0, ids), self._sums.index_select(0, ids)
        layer._bias = self._bias.index_select(0, ids) if self._bias is not None else None
        return layer

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (out, in) in float32: a fresh copy, writes to it change nothing."""
        if self.backend == "kernel":
            return int8_kernel.unpack(self._packed, self.out_features, self.in_features).float() * self._scales[:, None]
        q, _ = torch.ops.quantized.linear_unpack(self._packed)
        return q.dequantize()

    @property
    def bias(self) -> torch.Tensor | None:
        if self.backend == "kernel":
            return self._bias
        return torch.ops.quantized.linear_unpack(self._packed)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) float32 -> (..., out) float32."""
        if self.backend == "kernel":
            return self._kernel_linear(x, self._packed, self._scales, self._sums, self._bias)
        return _LINEAR_DYNAMIC(x, self._packed, self.reduce_range)

    def activated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``activation`` (a FeedForward's config name: relu, gelu, gelu_tanh, silu) of this layer's output; ours
        applies it to each output vector in registers before storing it (the same float operations as
        model.kernel_layers.activate, so the same values), instead of a pass over the whole output."""
        if self.backend == "kernel":
            return self._kernel_activated(x, self._packed, self._scales, self._sums, self._bias,
                                          self._activations.__members__[activation])
        return activate(self(x), activation)

    def activated_into(self, x: torch.Tensor, activation: str, fc2: Int8Linear) -> torch.Tensor:
        """``fc2(self.activated(x, activation))``; when both run ours, this GEMM's rows are quantised for fc2 as
        they are computed (a 64-row tile of the float output quantised while it is in L2) instead of the float
        output going to memory and fc2 reading it back: the same bytes as fc2 quantising that output."""
        if self.backend != "kernel" or fc2.backend != "kernel":
            return fc2(self.activated(x, activation))
        hq, hs = self._kernel_into(x.reshape(-1, x.shape[-1]), self._packed, self._scales, self._sums, self._bias,
                                   self._activations.__members__[activation])
        return fc2._quantized(hq, hs, x.shape[:-1])

    def gated_into(self, x: torch.Tensor, up: Int8Linear, activation: str, fc2: Int8Linear) -> torch.Tensor:
        """``fc2(self.activated(x, activation) * up(x))``: a gated FeedForward, this layer its gate. When all three run
        ours, x is quantised once and each tile reads a block of this layer's weights and the same block of up's side
        by side (one pass, one parallel region), the product formed in registers and its rows quantised for fc2 as
        :meth:`activated_into` does: the same bytes as the separate passes."""
        if self.backend != "kernel" or up.backend != "kernel" or fc2.backend != "kernel":
            return fc2(self.activated(x, activation) * up(x))
        code = self._activations.__members__[activation]
        hq, hs = self._kernel_gated(x.reshape(-1, x.shape[-1]), self._packed, self._scales, self._sums, self._bias,
                                    up._packed, up._scales, up._sums, up._bias, code)
        return fc2._quantized(hq, hs, x.shape[:-1])

    def _quantized(self, hq: torch.Tensor, hs: torch.Tensor, leading: torch.Size) -> torch.Tensor:
        """This layer of rows already quantised (uint8 rows, scales) -> (*leading, out)."""
        return self._kernel_quantized(hq, hs, self._packed, self._scales, self._sums, self._bias).view(
            *leading, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, {self.backend}"
