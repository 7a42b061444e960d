"""int8 weights for CPU inference: dynamic quantisation of the nn.Linear layers.

Each weight is stored as int8 with one scale per output channel (symmetric, max-abs / 127); each
call quantises its activations on the fly and runs an int8 GEMM, so bytes read per decoding step
drop about 4x. Embeddings, LayerNorms, attention and the KV cache stay in float. Two GEMMs
(``model.int8_kernel`` picks, ``TSERVE_INT8_KERNEL``):

- ours on AVX512-VNNI CPUs (model/kernels/int8_vnni.cpp): activations quantised per row on 8 bits,
  so a row's result does not depend on the rest of its batch; 1.2-1.8x fbgemm's speed at 1-64 rows;
- fbgemm's ``quantized::linear_dynamic`` elsewhere: activations per tensor on 7 bits
  (``reduce_range=True``, PyTorch's default: CPUs without VNNI can saturate 16-bit sums otherwise).

A quantised model is for inference only: it is never saved, and LoRA adapters still load onto it
(``LoRALinear`` wraps an ``Int8Linear`` and adds its float deltas) but cannot be merged into its weights.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from model import int8_kernel
from model.attention import MultiHeadAttention
from model.layers import TransformerLayer
from model.lora import HeadCopies, LoRALinear

logger = logging.getLogger(__name__)

QUANTIZE_MODES = ("none", "int8")
# The overload's C++ entry point: skips per-call overload resolution and OpOverload.__call__'s Python-side
# dispatch checks (4-7% of an int8 decode at batch 1-4 on this machine); the overload where it is absent.
_LINEAR_DYNAMIC = getattr(torch.ops.quantized.linear_dynamic.default, "_op", torch.ops.quantized.linear_dynamic.default)


class QuantizeError(ValueError):
    """The model cannot be quantised as asked (unknown mode, not on CPU, merged adapter)."""


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantised per call; CPU only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool = True) -> None:
        """Quantise ``weight`` (out, in); ``bias`` (out,) stays float. ``reduce_range``: fbgemm's 7-bit activations."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.reduce_range = reduce_range
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        bias = bias.detach().float().contiguous() if bias is not None else None
        kernel = int8_kernel.vnni_kernel()
        if kernel is not None:
            q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.backend = "vnni"
            self._kernel_linear = kernel.int8_linear
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

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (out, in) in float32: a fresh copy, writes to it change nothing."""
        if self.backend == "vnni":
            return int8_kernel.unpack(self._packed, self.out_features, self.in_features).float() * self._scales[:, None]
        q, _ = torch.ops.quantized.linear_unpack(self._packed)
        return q.dequantize()

    @property
    def bias(self) -> torch.Tensor | None:
        if self.backend == "vnni":
            return self._bias
        return torch.ops.quantized.linear_unpack(self._packed)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) float32 -> (..., out) float32."""
        if self.backend == "vnni":
            return self._kernel_linear(x, self._packed, self._scales, self._sums, self._bias)
        return _LINEAR_DYNAMIC(x, self._packed, self.reduce_range)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, {self.backend}"


def quantize_int8(model: nn.Module) -> int:
    """Replace every float nn.Linear of ``model`` (LoRA bases included, adapters and their head copies not) by an
    Int8Linear.

    Returns the number of layers replaced. The model must be on the CPU in float32 and have no
    merged adapter; tied weights keep their float copy where something else uses them (embeddings).
    Self-attention also gets a fused int8 q/k/v projection (one GEMM instead of three; the same
    per-row scales, so the same int8 weights) for as long as no LoRA adapter wraps q, k or v.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise QuantizeError("int8 quantisation runs on the CPU only (CPU int8 kernels); load the model with device cpu")
    try:
        kernel = int8_kernel.vnni_kernel()
    except int8_kernel.KernelUnavailable as exc:
        raise QuantizeError(str(exc)) from None
    if kernel is None and not {"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines):
        raise QuantizeError("no int8 kernel here: no AVX512-VNNI kernel and no x86/fbgemm quantized engine")
    targets: list[tuple[nn.Module, str, nn.Linear]] = []
    adapter_dicts: set[int] = set()  # LoRA A/B stay float
    for path, module in model.named_modules():  # parents come before their children
        if isinstance(module, LoRALinear):
            if module.merged is not None:
                raise QuantizeError(f"{path}: adapter {module.merged!r} is merged; unmerge it before quantising")
            adapter_dicts.update((id(module.lora_A), id(module.lora_B)))
        if isinstance(module, HeadCopies):
            adapter_dicts.add(id(module.copies))
        if id(module) in adapter_dicts:
            continue
        targets += [(module, name, child) for name, child in module.named_children() if type(child) is nn.Linear]
    for _, _, linear in targets:
        if linear.weight.dtype != torch.float32:
            raise QuantizeError(f"int8 quantisation needs float32 weights, got {linear.weight.dtype}")
    fused = [_fused_qkv(m.self_attn) for m in model.modules() if isinstance(m, TransformerLayer)]
    for parent, name, linear in targets:
        setattr(parent, name, Int8Linear.from_linear(linear))
    for attn, qkv in fused:
        if qkv is not None:
            attn.qkv_proj, attn._qkv_of = qkv, (attn.q_proj, attn.k_proj, attn.v_proj)
    logger.info("quantised %d linear layers to int8 (%s)", len(targets), "AVX512-VNNI kernel" if kernel else "fbgemm")
    return len(targets)


def _fused_qkv(attn: MultiHeadAttention) -> tuple[MultiHeadAttention, Int8Linear | None]:
    """An int8 (D, 3D) projection of ``attn``'s q, k, v, unless an adapter wraps one of them."""
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    if any(type(p) is not nn.Linear for p in parts):
        return attn, None
    biases = [p.bias for p in parts]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        return attn, None
    return attn, Int8Linear(torch.cat([p.weight for p in parts]), bias)


def quantize(model: nn.Module, mode: str | None) -> nn.Module:
    """Apply ``mode`` ("none"/None: leave as is, "int8": :func:`quantize_int8`) in place; returns ``model``."""
    if mode in (None, "none"):
        return model
    if mode != "int8":
        raise QuantizeError(f"unknown quantisation {mode!r}; expected one of {list(QUANTIZE_MODES)}")
    quantize_int8(model)
    return model


def mode_for(spec: str, name: str) -> str:
    """The mode ``spec`` gives model ``name``: spec is a mode, or "name=mode" entries and an optional bare default.

    "int8" quantises every model; "none,translation=int8" only the model called translation.
    """
    default, modes = "none", {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        key, _, mode = entry.rpartition("=")
        if mode not in QUANTIZE_MODES:
            raise QuantizeError(f"unknown quantisation {mode!r} in {spec!r}; expected one of {list(QUANTIZE_MODES)}")
        if key:
            modes[key] = mode
        else:
            default = mode
    return modes.get(name, default)


__all__ = ["Int8Linear", "QUANTIZE_MODES", "QuantizeError", "mode_for", "quantize", "quantize_int8"]
