"""int8 weights for CPU inference: dynamic quantisation of the nn.Linear layers.

Each nn.Linear becomes an :class:`~model.int8_linear.Int8Linear` (int8 weights, one scale per output
channel, activations quantised on the fly), so bytes read per decoding step drop about 4x. Embeddings,
LayerNorms, attention and the KV cache stay in float.

A quantised model is for inference only: it is never saved, and LoRA adapters still load onto it
(``LoRALinear`` wraps an ``Int8Linear`` and adds its float deltas) but cannot be merged into its weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from model import int8_kernel
from model.attention import MultiHeadAttention
from model.int8_linear import Int8Linear
from model.kernel_layers import is_plain
from model.layers import TransformerLayer
from model.layout import use_input_major_weights
from model.lora_layers import HeadCopies, LoRALinear

logger = logging.getLogger(__name__)

QUANTIZE_MODES = ("none", "int8")


class QuantizeError(ValueError):
    """The model cannot be quantised as asked (unknown mode, not on CPU, merged adapter)."""


def quantize_int8(model: nn.Module) -> int:
    """Replace every float nn.Linear of ``model`` (LoRA bases included, adapters and their head copies not) by an
    Int8Linear.

    Returns the number of layers replaced. The model must be on the CPU in float32 and have no
    merged adapter; tied weights keep their float copy where something else uses them (embeddings).
    Self-attention also gets a fused int8 q/k/v projection (one GEMM instead of three; the same
    per-row scales, so the same int8 weights; (H + 2 H_kv) * head_dim outputs under grouped-query attention) for as
    long as no LoRA adapter wraps q, k or v. Llama's gated FFN quantises its gate, up and down projections alike.
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
        targets += [(module, name, child) for name, child in module.named_children() if is_plain(child)]
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
    """An int8 projection of ``attn``'s q, k, v side by side, unless an adapter wraps one of them."""
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    if not all(is_plain(p) for p in parts):
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


def prepare_for_inference(model: nn.Module, mode: str | None) -> nn.Module:
    """What serving and evaluation run on a loaded model (adapters loaded or not): quantise it (``mode``), then
    lay its float weights out input-major (model.layout); returns ``model``."""
    quantize(model, mode)
    use_input_major_weights(model)
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
