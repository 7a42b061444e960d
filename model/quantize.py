"""Lower-precision weights for CPU inference: the nn.Linear layers of a loaded model, replaced in place.

Two modes beside "none" (:data:`QUANTIZE_MODES`), each replacing every float nn.Linear (LoRA bases included, the
adapters and their head copies not) by an inference-only layer:

- "int8": :class:`~model.int8_linear.Int8Linear` (int8 weights, one scale per output channel, activations quantised
  on the fly): bytes read per decoding step drop about 4x;
- "bf16": :class:`~model.bf16_linear.Bf16Linear` (bfloat16 weights, float32 activations rounded to bfloat16 at the
  GEMM's input, float32 accumulation and output): half the bytes of float32, and the CPU's bf16 dot products where
  it has them (AVX512-BF16; on AVX2 CPUs float32 FMAs of the same products).

Both fuse self-attention's q/k/v projections into one layer (:func:`_fused_qkv`). Embeddings, norms, attention and
the KV cache stay in float. A quantised model is for inference only: it is never saved, and LoRA adapters still load
onto it (``LoRALinear`` wraps the quantised layer and adds its float deltas) but cannot be merged into its weights.
On a GPU a model's own ``dtype`` (bfloat16 included) is the way to lower its precision; these modes are CPU-only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from model import int8_kernel
from model.attention import MultiHeadAttention
from model.bf16_linear import Bf16Linear
from model.int8_linear import Int8Linear
from model.kernel_layers import is_plain
from model.layers import TransformerLayer
from model.layout import use_input_major_weights
from model.lora_layers import HeadCopies, LoRALinear

logger = logging.getLogger(__name__)

QUANTIZE_MODES = ("none", "int8", "bf16")
# Mode -> the layer it puts in place of nn.Linear (inference only: never saved, never merged into)
QUANTIZED_LAYERS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "bf16": Bf16Linear}
QUANTIZED_LINEARS = tuple(QUANTIZED_LAYERS.values())
# A quantised layer from a float (out, in) weight and (out,) bias: Int8Linear(weight, bias), Bf16Linear(weight, bias)
LayerFactory = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]


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
    _check_cpu(model, "int8")
    try:
        kernel = int8_kernel.kernel()
    except int8_kernel.KernelUnavailable as exc:
        raise QuantizeError(str(exc)) from None
    if kernel is None and not {"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines):
        raise QuantizeError("no int8 kernel here: neither ours (AVX512-VNNI or AVX2) nor an x86/fbgemm quantized "
                            "engine")
    with int8_kernel.huge_pages():  # the model's packed weights in 2 MB pages, contiguous in load order
        count = _replace_linears(model, "int8", Int8Linear)
    logger.info("quantised %d linear layers to int8 (%s)", count, "our kernel" if kernel else "fbgemm")
    return count


def quantize_bf16(model: nn.Module) -> int:
    """Replace every float nn.Linear of ``model`` as :func:`quantize_int8` does (the same layers, the same fused
    q/k/v projection), by a Bf16Linear: bfloat16 weights, float32 accumulation. Returns the number replaced."""
    _check_cpu(model, "bf16")
    count = _replace_linears(model, "bf16", Bf16Linear)
    backends = sorted({m.backend for m in model.modules() if type(m) is Bf16Linear})
    logger.info("quantised %d linear layers to bf16 (%s)", count, ", ".join(backends) or "none")
    if "torch" in backends:
        logger.warning("bf16 weights on this CPU (no AVX-512 or AVX2, or TSERVE_DECODE_KERNELS=off) are upcast to "
                       "float32 at every call: several times slower than float32 weights (docs/benchmarks.md); serve "
                       "float32 or int8 here")
    return count


def quantized_mode(module: nn.Module) -> str | None:
    """The mode whose layer ``module`` is ("int8", "bf16"); None for any other module."""
    return next((mode for mode, layer in QUANTIZED_LAYERS.items() if type(module) is layer), None)


def model_mode(model: nn.Module) -> str:
    """The mode ``model``'s linear layers were quantised to ("none" when none was)."""
    return next((mode for m in model.modules() if (mode := quantized_mode(m)) is not None), "none")


def _check_cpu(model: nn.Module, mode: str) -> None:
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise QuantizeError(f"{mode} quantisation runs on the CPU only (CPU kernels); load the model with device cpu, "
                            "or lower a GPU model's precision with its dtype setting (bfloat16, float16)")


def _replace_linears(model: nn.Module, mode: str, layer: LayerFactory) -> int:
    """Replace the :func:`_targets` of ``model`` by ``layer(weight, bias)`` and fuse q/k/v; returns how many."""
    targets = _targets(model)
    for _, _, linear in targets:
        if linear.weight.dtype != torch.float32:
            raise QuantizeError(f"{mode} quantisation needs float32 weights, got {linear.weight.dtype}")
    fused = [_fused_qkv(m.self_attn, layer) for m in model.modules() if isinstance(m, TransformerLayer)]
    for parent, name, linear in targets:
        setattr(parent, name, layer(linear.weight, linear.bias))
    for attn, qkv in fused:
        if qkv is not None:
            attn.qkv_proj, attn._qkv_of = qkv, (attn.q_proj, attn.k_proj, attn.v_proj)
    return len(targets)


def _targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, layer) of every plain float Linear of ``model`` outside LoRA adapters and head copies; raises
    where an adapter is merged (its delta would be quantised into the base)."""
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
    return targets


def _fused_qkv(attn: MultiHeadAttention, layer: LayerFactory) -> tuple[MultiHeadAttention, nn.Module | None]:
    """``layer`` over ``attn``'s q, k, v weights side by side, unless an adapter wraps one of them. Both modes'
    weights are per output row (int8's scales, bf16's rounding), so the fused rows equal the separate layers'."""
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    if not all(is_plain(p) for p in parts):
        return attn, None
    biases = [p.bias for p in parts]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        return attn, None
    return attn, layer(torch.cat([p.weight for p in parts]), bias)


_QUANTIZERS = {"int8": quantize_int8, "bf16": quantize_bf16}


def quantize(model: nn.Module, mode: str | None) -> nn.Module:
    """Apply ``mode`` ("none"/None: leave as is, "int8": :func:`quantize_int8`, "bf16": :func:`quantize_bf16`) in
    place; returns ``model``."""
    if mode in (None, "none"):
        return model
    if mode not in _QUANTIZERS:
        raise QuantizeError(f"unknown quantisation {mode!r}; expected one of {list(QUANTIZE_MODES)}")
    _QUANTIZERS[mode](model)
    return model


def prepare_for_inference(model: nn.Module, mode: str | None) -> nn.Module:
    """What serving and evaluation run on a loaded model (adapters loaded or not): quantise it (``mode``), then
    lay its float weights out input-major (model.layout); returns ``model``. The bf16 mode, whose GEMMs round their
    inputs to bf16 already, also attends with bf16 products (MultiHeadAttention.bf16_products); float32 stays exact."""
    quantize(model, mode)
    use_input_major_weights(model)
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.bf16_products = mode == "bf16"
    return model


def mode_for(spec: str, name: str) -> str:
    """The mode ``spec`` gives model ``name``: spec is a mode, or "name=mode" entries and an optional bare default.

    "int8" quantises every model; "none,translation=int8" only the model called translation; "bf16,code=none" every
    model but code to bf16.
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


__all__ = ["QUANTIZED_LAYERS", "QUANTIZED_LINEARS", "QUANTIZE_MODES", "Bf16Linear", "Int8Linear", "QuantizeError",
           "mode_for", "model_mode", "quantize", "quantize_bf16", "quantize_int8", "quantized_mode"]
