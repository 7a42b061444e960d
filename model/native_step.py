"""The decoder stack bound for the C++ decoding step (model/kernels/decode_step.cpp's ``DecoderStack``).

model/fast_step.py's plan holds one :class:`NativeStep` where every layer is something the C++ step runs: float32,
our bf16 or our int8 projections (LoRA-wrapped ones by their bases, the adapters' deltas passed per step), LayerNorms or
RMSNorms (Llama's, or Gemma's by 1 + weight: one kind per stack), q/k norms and sandwich norms, one attention shape
for every layer (heads, KV heads, head width, scale of q.k, rotary or not; cross-attention's head width and scale
of q.k the same), and per layer its rotary kind (:func:`rotary_kinds`: Gemma 3's window layers rotate with their own
base) and whether it attends within the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from model import packed_weights
from model.attention import KERNEL_MAX_HEAD_DIM, MultiHeadAttention
from model.bf16_linear import Bf16Linear
from model.int8_linear import Int8Linear
from model.kernel_layers import is_layer_norm, is_plain
from model.kv_cache import KVCache
from model.layers import LayerStack, RMSNorm, TransformerLayer
from model.lora_layers import LoRALinear
from model.rope import Rotary

Angles = tuple[torch.Tensor, torch.Tensor]  # one step's rotary cos and sin (B|1, t, R)
Masks = tuple[torch.Tensor | None, torch.Tensor | None]  # a step's self-attention masks: all layers', window layers'

_ABSENT = torch.empty(0)  # decode_step.cpp's "no tensor here" (a missing bias or panel)


def _in_order(enum: Any) -> list[str]:
    """The member names of one of the kernels' enums (``kernels.Slot``, ``kernels.Norm``), by value."""
    members = enum.__members__
    return sorted(members, key=lambda name: int(members[name]))


def _slot_modules(layer: TransformerLayer) -> dict[str, nn.Module | None]:
    """The layer's projections by their ``kernels.Slot`` names; None where absent (q/k/v while the fused
    projection serves, the cross-attention's without one)."""
    attn, cross, fused = layer.self_attn, layer.cross_attn, layer.self_attn.fused
    return {
        "q": None if fused else attn.q_proj,
        "k": None if fused else attn.k_proj,
        "v": None if fused else attn.v_proj,
        "out": attn.out_proj,
        "cross_q": cross.q_proj if cross is not None else None,
        "cross_out": cross.out_proj if cross is not None else None,
        "fc1": layer.ffn.fc1,
        "fc2": layer.ffn.fc2,
        "qkv": attn.qkv_proj if fused else None,
        "up": layer.ffn.up,
    }


def _projection(module: nn.Module | None) -> list[torch.Tensor] | None:
    """A projection as decode_step.cpp takes it: float32 [weight, bias], our bf16 [packed, bias] (float32 zeros for
    no bias: its length is the output width) or our int8 [packed, scales, sums, bias] (an empty tensor for no bias);
    [] for an absent one; None when the native step cannot run it."""
    if module is None:
        return []
    if type(module) is LoRALinear:  # its base; the adapters' deltas come per step (NativeStep.deltas)
        module = module.base
    if is_plain(module) and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
        return [module.weight, _ABSENT if module.bias is None else module.bias]
    if type(module) is Int8Linear and module.backend == "kernel":
        return [module._packed, module._scales, module._sums, _ABSENT if module._bias is None else module._bias]
    if type(module) is Bf16Linear and module.packed is not None:
        return [module.packed, torch.zeros(module.out_features) if module.bias is None else module.bias]
    return None


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is our RMSNorm (Llama's, or Gemma's by 1 + weight: ``module.offset``)."""
    return type(module) is RMSNorm


def _norm_modules(layer: TransformerLayer) -> dict[str, nn.Module | None]:
    """The layer's norms by their ``kernels.Norm`` names; None where absent."""
    return {"self_attn_norm": layer.self_attn_norm, "cross_attn_norm": layer.cross_attn_norm,
            "ffn_norm": layer.ffn_norm, "self_attn_post_norm": layer.self_attn_post_norm,
            "ffn_post_norm": layer.ffn_post_norm, "q_norm": layer.self_attn.q_norm, "k_norm": layer.self_attn.k_norm}


def rotary_kinds(stack: LayerStack) -> tuple[list[Rotary], list[int]]:
    """The distinct rotary positions of the stack's layers (alike: same width, base and scaling) and each layer's
    index among them; ([], []) without rotary positions. Gemma 3's window layers have a base of their own."""
    kinds: list[Rotary] = []
    of: list[int] = []
    for layer in stack.layers:
        rotary = layer.self_attn.rotary
        if rotary is None:
            return [], []
        key = _rotary_key(rotary)
        found = next((i for i, kind in enumerate(kinds) if _rotary_key(kind) == key), None)
        if found is None:
            found = len(kinds)
            kinds.append(rotary)
        of.append(found)
    return kinds, of


def _rotary_key(rotary: Rotary) -> tuple[Any, ...]:
    return rotary.head_dim, rotary.rotary_dim, rotary.theta, rotary.scaling


def _norm(module: nn.Module | None, offset: bool) -> tuple[list[torch.Tensor], float] | None:
    """([weight, bias], eps) of a LayerNorm, ([weight], eps) of an RMSNorm (by 1 + weight when ``offset``: the
    stack's kind), as decode_step.cpp takes them; ([], 0.0) for an absent one; None if it cannot."""
    if module is None:
        return [], 0.0
    if is_rms_norm(module):
        return ([module.weight], module.eps) if module.offset == offset else None
    if not is_layer_norm(module) or module.weight is None or module.bias is None:
        return None
    return [module.weight, module.bias], module.eps


@dataclass
class NativeStep:
    """The decoder stack bound for the C++ step (``kernels.DecoderStack``: model/kernels/decode_step.cpp)."""

    stack: Any  # kernels.DecoderStack
    projections: list[list[torch.Tensor]]  # flat: each layer's, one per kernels.Slot (as the bound stack holds them)
    adapted: list[tuple[int, LoRALinear]]  # (index in projections, module): LoRA-wrapped ones, bound by their bases
    # The packed copies of the last step and the (version, data pointer) of each float32 weight they were made for:
    # a step checks those in one pass instead of asking model/packed_weights.py per weight (0.15 ms a step).
    _panels: list[torch.Tensor] = field(default_factory=list)
    _panel_state: list[tuple[int, int]] = field(default_factory=list)
    # Whether any projection is a (weight, bias) pair, float32 or bf16: an int8 stack has no panels to look up and
    # pass, known once here instead of from a 300-item list every step (~33 us of a SmolLM2 int8 batch-1 step).
    _pairs: bool = field(init=False)

    def __post_init__(self) -> None:
        self._pairs = any(len(p) == 2 for p in self.projections)

    def deltas(self, rows: int, tokens: int = 1) -> list[list[torch.Tensor]] | None:
        """This step's LoRA deltas per projection (model.lora_layers.RowDeltas as lists; [] where a projection adds
        none, and [] for the whole step when none does), or None when one must come from the Python replay
        (training mode, autograd, non-finite adapter weights). With several ``tokens`` per row, each row's
        scales repeat for its tokens (the kernel adds deltas per token row)."""
        deltas: list[list[torch.Tensor]] = []
        for index, module in self.adapted:
            stackable = module.stackable()
            found = module.row_deltas(rows)
            if found is None:
                continue
            if not stackable:
                return None
            if not deltas:
                deltas = [[] for _ in self.projections]
            a, b, scales = found
            if tokens > 1 and scales.shape[0] == rows:
                scales = scales.repeat_interleave(tokens, dim=0)
            deltas[index] = [a, b, scales]
        return deltas

    @classmethod
    def of(cls, stack: LayerStack, kernels: ModuleType) -> NativeStep | None:
        """None when a layer holds something the C++ step does not run (fbgemm int8, other dtypes)."""
        first = stack.layers[0]
        activation = kernels.Activation.__members__.get(first.ffn.activation)
        shape = _attention_shape(first.self_attn)
        windows = {layer.self_attn.window for layer in stack.layers} - {None}
        if activation is None or len(windows) > 1 or any(
            layer.pre_norm != first.pre_norm or layer.ffn.activation != first.ffn.activation
            or _attention_shape(layer.self_attn) != shape
            or layer.cross_attn is not None and _scaled_heads(layer.cross_attn) != _scaled_heads(first.self_attn)
            for layer in stack.layers
        ):
            return None
        offset = any(is_rms_norm(m) and m.offset for m in stack.modules())
        slots, norm_names = _in_order(kernels.Slot), _in_order(kernels.Norm)
        projections, norms, eps, adapted = [], [], [], []
        for layer in stack.layers:
            by_slot, by_norm = _slot_modules(layer), _norm_modules(layer)
            modules = [by_slot[name] for name in slots]
            bound = [_projection(m) for m in modules]
            layer_norms = [_norm(by_norm[name], offset) for name in norm_names]
            if any(b is None for b in bound) or any(n is None for n in layer_norms):
                return None
            if layer.self_attn.head_dim > KERNEL_MAX_HEAD_DIM:
                return None
            adapted += [(len(projections) + i, m) for i, m in enumerate(modules) if type(m) is LoRALinear]
            projections += bound
            for weight_and_bias, e in layer_norms:
                norms.append(weight_and_bias)
                eps.append(e)
        attn = first.self_attn
        bound_stack = kernels.DecoderStack(
            projections=projections, norms=norms, eps=eps, heads=attn.n_heads, pre_norm=first.pre_norm,
            activation=activation, kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, rotary=rotary_kinds(stack)[1],
            windowed=[layer.self_attn.window is not None for layer in stack.layers] if windows else [],
            norm_offset=offset, query_scale=attn.query_scale)
        return cls(bound_stack, projections, adapted)

    def panels(self, kernels: ModuleType, rows: int) -> list[torch.Tensor]:
        """Each float32 projection's packed copy (model/packed_weights.py; empty for the others) for a step of
        ``rows`` rows, or [] where the few-rows GEMV (packing off, or rows up to ``MAX_GEMV_ROWS``) takes the step."""
        if rows <= packed_weights.MAX_GEMV_ROWS or not packed_weights.enabled() or not self._pairs:
            return []
        try:
            state = [(p[0]._version, p[0].data_ptr()) for p in self.projections if len(p) == 2]
        except RuntimeError:  # an inference tensor keeps no version: packed() declines it, asked every step
            state = None
        if state is None or state != self._panel_state:
            found = [packed_weights.packed(kernels, p[0]) if len(p) == 2 else None for p in self.projections]
            self._panels = [_ABSENT if panels is None else panels for panels in found]
            self._panel_state = state or []
        return self._panels

    def __call__(
        self, kernels: ModuleType, x: torch.Tensor, masks: Masks, cache: KVCache, memory_mask: torch.Tensor | None,
        deltas: list[list[torch.Tensor]], angles: list[Angles],
    ) -> torch.Tensor:
        """One step; ``masks``: this step's self-attention masks (all layers', the window layers'), ``angles``: its
        cos/sin of each rotary kind."""
        cross = cache.cross
        step_cache = kernels.StepCache(
            keys=cache.keys, values=cache.values,
            cross_keys=cross.keys if cross is not None else [], cross_values=cross.values if cross is not None else [],
            start=cache.max_length, visible=cache.max_length + x.shape[1],
            write_positions=None if cache.uniform else cache.write_positions,
            self_mask=masks[0], memory_mask=memory_mask, group=cross.group_size if cross is not None else 1,
            prefix_blocks=list(cache.prefix.blocks) if cache.prefix is not None else [],
            prefix_table=cache.prefix.table if cache.prefix is not None else None,
            rotary_cos=[cos for cos, _ in angles], rotary_sin=[sin for _, sin in angles], window_mask=masks[1],
            beam_lead=cache.beam_lead, beam_shared=cache.beam_shared,
            cross_lead=cross.leads if cross is not None else None,
        )
        return self.stack.step(x, step_cache, deltas, self.panels(kernels, x.shape[0]))


    def prefill(
        self, kernels: ModuleType, x: torch.Tensor, masks: Masks, cache: KVCache, memory_mask: torch.Tensor | None,
        deltas: list[list[torch.Tensor]], angles: list[Angles],
    ) -> torch.Tensor:
        """A prompt's tokens in one step (model.fast_step.run_prefill): the step itself, named apart from the decoding
        steps (``__call__``) so that what counts steps does not count prompts."""
        return NativeStep.__call__(self, kernels, x, masks, cache, memory_mask, deltas, angles)


def _attention_shape(attn: MultiHeadAttention) -> tuple[int, int, int, bool, float, bool]:
    """What the C++ step takes once for every layer: heads, KV heads, head width, rotary or not, the scale of q,
    q/k norms or not."""
    return (attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.rotary is not None, attn.query_scale,
            attn.q_norm is not None)


def _scaled_heads(attn: MultiHeadAttention) -> tuple[int, float]:
    """The head width and scale of q (``query_scale``) of an attention: one pair for a stack's self- and
    cross-attention in the C++ step."""
    return attn.head_dim, attn.query_scale
