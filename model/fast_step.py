"""The decoder stack of one decoding step without nn.Module dispatch: the inference fast path.

A decode step at batch 1 spends as long in Python as in some of its GEMMs: every layer makes a
dozen nn.Module calls (hooks machinery, attribute lookups) around a dozen tensor ops. This module
walks the same layers once, keeps for each one plain callables bound to the same parameters
(``torch.layer_norm`` / ``model.kernel_layers.linear`` on the Parameter objects, an ``Int8Linear``'s or a
``LoRALinear``'s own forward), and replays them per step. It computes exactly what
``LayerStack.forward`` computes in eval mode with a cache (tests compare the two in float64);
training, attention weights and ``keep_last`` take the general path.

The plan is rebuilt when a module or a bound Parameter object is swapped (LoRA wrapping, int8
quantisation, a new Parameter assigned); in-place weight changes (``load_state_dict``, LoRA merge,
``model.layout``) reach it through the shared Parameters.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from model import native, packed_weights
from model.attention import KERNEL_MAX_HEAD_DIM, MultiHeadAttention, decode_attention
from model.int8_linear import Int8Linear
from model.kernel_layers import is_layer_norm, is_plain, linear
from model.kv_cache import KVCache
from model.layers import LayerStack, TransformerLayer
from model.lora_layers import LoRALinear

Op = Callable[[torch.Tensor], torch.Tensor]


def _op(module: nn.Module) -> Op:
    """A callable computing ``module(x)``: its parameters bound directly when it is a plain Linear/LayerNorm."""
    if is_plain(module):
        weight, bias = module.weight, module.bias
        return lambda x: linear(x, weight, bias)
    if is_layer_norm(module):
        shape, weight, bias, eps = module.normalized_shape, module.weight, module.bias, module.eps
        return lambda x: torch.layer_norm(x, shape, weight, bias, eps)
    return module.forward if not module._forward_hooks and not module._forward_pre_hooks else module


@dataclass
class _Attention:
    q: Op
    k: Op
    v: Op
    out: Op
    qkv: Op | None  # the fused q/k/v projection, while it is in use
    heads: Callable[[torch.Tensor], torch.Tensor]  # the module's split_heads
    split_qkv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, attn: MultiHeadAttention) -> _Attention:
        qkv = _op(attn.qkv_proj) if attn.fused else None
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
        return cls(*(_op(p) for p in projections), qkv, attn.split_heads, attn.split_qkv)

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        return self.out(MultiHeadAttention.merge_heads(out))


@dataclass
class _Layer:
    pre_norm: bool
    self_norm: Op
    self_attn: _Attention
    cross_norm: Op | None
    cross_attn: _Attention | None
    ffn_norm: Op
    fc1: Op
    activation: Op
    fc2: Op

    @classmethod
    def of(cls, layer: TransformerLayer) -> _Layer:
        cross = layer.cross_attn is not None
        return cls(
            pre_norm=layer.pre_norm,
            self_norm=_op(layer.self_attn_norm),
            self_attn=_Attention.of(layer.self_attn),
            cross_norm=_op(layer.cross_attn_norm) if cross else None,
            cross_attn=_Attention.of(layer.cross_attn) if cross else None,
            ffn_norm=_op(layer.ffn_norm),
            fc1=_op(layer.ffn.fc1),
            activation=layer.ffn.activate,
            fc2=_op(layer.ffn.fc2),
        )

    def sublayer(self, x: torch.Tensor, norm: Op, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Pre-LN: x + f(LN(x)); post-LN: LN(x + f(x)) (eval: no dropout)."""
        if self.pre_norm:
            return x + f(norm(x))
        return norm(x + f(x))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, memory_mask: torch.Tensor | None, cache: KVCache, i: int
    ) -> torch.Tensor:
        attn = self.self_attn

        def self_attention(h: torch.Tensor) -> torch.Tensor:
            if attn.qkv is not None:
                q, k, v = attn.split_qkv(attn.qkv(h))
            else:
                q, k, v = attn.heads(attn.q(h)), attn.heads(attn.k(h)), attn.heads(attn.v(h))
            k, v = cache.write(i, k, v)
            if k.dtype != q.dtype:  # a cache kept in another dtype
                k, v = k.to(q.dtype), v.to(q.dtype)
            return attn.merge(decode_attention(q, k, v, mask, cache.prefix, i))

        x = self.sublayer(x, self.self_norm, self_attention)
        if self.cross_attn is not None:
            cross, memory = self.cross_attn, cache.cross

            def cross_attention(h: torch.Tensor) -> torch.Tensor:
                q = cross.heads(cross.q(h))
                out = _grouped_attention(q, memory.keys[i], memory.values[i], memory_mask, memory.group_size)
                return cross.merge(out)

            x = self.sublayer(x, self.cross_norm, cross_attention)
        return self.sublayer(x, self.ffn_norm, lambda h: self.fc2(self.activation(self.fc1(h))))


def _grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, group: int
) -> torch.Tensor:
    """SDPA of q (B, H, T, Dh) over per-row keys/values whose rows repeat in runs of ``group``.

    The queries of a run attend together to its first row's K/V (one (g * T)-query attention per
    source instead of g one-query attentions over copies): beam search reads 1/g of the memory.
    """
    if group == 1:
        return decode_attention(q, keys, values, mask)
    b, heads, t, dh = q.shape
    grouped = q.view(b // group, group, heads, t, dh).transpose(1, 2).reshape(b // group, heads, group * t, dh)
    first = slice(None, None, group)
    out = decode_attention(grouped, keys[first], values[first], mask[first] if mask is not None else None)
    return out.view(b // group, heads, group, t, dh).transpose(1, 2).reshape(b, heads, t, dh)


_WATCHED = {
    "layer": ("self_attn_norm", "self_attn", "cross_attn_norm", "cross_attn", "ffn_norm", "ffn"),
    "attention": ("q_proj", "k_proj", "v_proj", "out_proj", "qkv_proj"),
    "ffn": ("fc1", "fc2"),
}


def _watched(stack: LayerStack) -> list[tuple[dict, str, object]]:
    """(dict, name, value) of every module and parameter the plan binds, to notice a swap: the module
    dicts of the layers and their attention/FFN blocks, and the parameter dicts of the bound
    Linear/LayerNorm layers (a new Parameter object assigned to one of them)."""
    watched: list[tuple[dict, str, object]] = [(stack._modules, "final_norm", stack.final_norm)]
    for layer in stack.layers:
        parents = [(layer, "layer"), (layer.self_attn, "attention"), (layer.ffn, "ffn")]
        if layer.cross_attn is not None:
            parents.append((layer.cross_attn, "attention"))
        for parent, kind in parents:
            watched += [(parent._modules, name, parent._modules.get(name)) for name in _WATCHED[kind]]
    for module in stack.modules():
        if is_plain(module) or is_layer_norm(module):
            watched += [(module._parameters, name, p) for name, p in module._parameters.items()]
    return watched


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
    }


def _projection(module: nn.Module | None) -> list[torch.Tensor] | None:
    """A projection as decode_step.cpp takes it: float32 [weight, bias] or our int8 [packed, scales, sums, bias]
    (an empty tensor for no bias); [] for an absent one; None when the native step cannot run it."""
    if module is None:
        return []
    if type(module) is LoRALinear:  # its base; the adapters' deltas come per step (_NativeStep.deltas)
        module = module.base
    if is_plain(module) and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
        return [module.weight, _ABSENT if module.bias is None else module.bias]
    if type(module) is Int8Linear and module.backend == "vnni":
        return [module._packed, module._scales, module._sums, _ABSENT if module._bias is None else module._bias]
    return None


def _norm(module: nn.Module | None) -> tuple[list[torch.Tensor], float] | None:
    """([weight, bias], eps) of a LayerNorm as decode_step.cpp takes it; ([], 0.0) for an absent one; None if
    it cannot."""
    if module is None:
        return [], 0.0
    if not is_layer_norm(module) or module.weight is None or module.bias is None:
        return None
    return [module.weight, module.bias], module.eps


@dataclass
class _NativeStep:
    """The decoder stack bound for the C++ step (``kernels.DecoderStack``: model/kernels/decode_step.cpp)."""

    stack: Any  # kernels.DecoderStack
    projections: list[list[torch.Tensor]]  # flat: each layer's, one per kernels.Slot (as the bound stack holds them)
    adapted: list[tuple[int, LoRALinear]]  # (index in projections, module): LoRA-wrapped ones, bound by their bases
    # The packed copies of the last step and the (version, data pointer) of each float32 weight they were made for:
    # a step checks those in one pass instead of asking model/packed_weights.py per weight (0.15 ms a step).
    _panels: list[torch.Tensor] = field(default_factory=list)
    _panel_state: list[tuple[int, int]] = field(default_factory=list)

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
    def of(cls, stack: LayerStack, kernels: ModuleType) -> _NativeStep | None:
        """None when a layer holds something the C++ step does not run (fbgemm int8, other dtypes)."""
        first = stack.layers[0]
        activation = kernels.Activation.__members__.get(first.ffn.activation)
        if activation is None or any(
            layer.pre_norm != first.pre_norm or layer.ffn.activation != first.ffn.activation
            or layer.self_attn.n_heads != first.self_attn.n_heads for layer in stack.layers
        ):
            return None
        slots, norm_names = _in_order(kernels.Slot), _in_order(kernels.Norm)
        projections, norms, eps, adapted = [], [], [], []
        for layer in stack.layers:
            by_slot = _slot_modules(layer)
            modules = [by_slot[name] for name in slots]
            bound = [_projection(m) for m in modules]
            layer_norms = [_norm(getattr(layer, name)) for name in norm_names]
            if any(b is None for b in bound) or any(n is None for n in layer_norms):
                return None
            if layer.self_attn.head_dim > KERNEL_MAX_HEAD_DIM:
                return None
            adapted += [(len(projections) + i, m) for i, m in enumerate(modules) if type(m) is LoRALinear]
            projections += bound
            for weight_and_bias, e in layer_norms:
                norms.append(weight_and_bias)
                eps.append(e)
        bound_stack = kernels.DecoderStack(projections=projections, norms=norms, eps=eps,
                                           heads=first.self_attn.n_heads, pre_norm=first.pre_norm,
                                           activation=activation)
        return cls(bound_stack, projections, adapted)

    def panels(self, kernels: ModuleType, rows: int) -> list[torch.Tensor]:
        """Each float32 projection's packed copy (model/packed_weights.py; empty for the others) for a step of
        ``rows`` rows, or [] where the few-rows GEMV (packing off, or rows up to ``MAX_GEMV_ROWS``) takes the step."""
        if rows <= packed_weights.MAX_GEMV_ROWS or not packed_weights.enabled():
            return []
        try:
            state = [(p[0]._version, p[0].data_ptr()) for p in self.projections if len(p) == 2]
        except RuntimeError:  # an inference tensor keeps no version: packed() declines it, asked every step
            state = []
        if not state or state != self._panel_state:
            found = [packed_weights.packed(kernels, p[0]) if len(p) == 2 else None for p in self.projections]
            self._panels = [_ABSENT if panels is None else panels for panels in found]
            self._panel_state = state
        return self._panels

    def __call__(
        self, kernels: ModuleType, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache,
        memory_mask: torch.Tensor | None, deltas: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        cross = cache.cross
        step_cache = kernels.StepCache(
            keys=cache.keys, values=cache.values,
            cross_keys=cross.keys if cross is not None else [], cross_values=cross.values if cross is not None else [],
            start=cache.max_length, visible=cache.max_length + x.shape[1],
            write_positions=None if cache.uniform else cache.write_positions,
            self_mask=mask, memory_mask=memory_mask, group=cross.group_size if cross is not None else 1,
            prefix_blocks=list(cache.prefix.blocks) if cache.prefix is not None else [],
            prefix_table=cache.prefix.table if cache.prefix is not None else None,
        )
        return self.stack.step(x, step_cache, deltas, self.panels(kernels, x.shape[0]))


class DecodePlan:
    """The layers of a ``LayerStack`` bound for replay; see the module docstring."""

    def __init__(self, stack: LayerStack) -> None:
        self.layers = [_Layer.of(layer) for layer in stack.layers]
        self.final_norm = _op(stack.final_norm) if stack.final_norm is not None else None
        self.kernels = native.kernels()  # the process's kernels when the plan was built (plan_for compares)
        self.native = _NativeStep.of(stack, self.kernels) if self.kernels is not None else None
        self._parents, self._names, self._children = zip(*_watched(stack), strict=True)

    def current(self) -> bool:
        """Whether the stack still holds the modules and parameters this plan was built from (q/k/v and
        qkv_proj included, so the fused projection's use follows too). Runs every step: the loop is in C."""
        return all(map(operator.is_, map(dict.get, self._parents, self._names), self._children))

    def __call__(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache, memory_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        kernels = self.kernels if self.native is not None else None
        deltas = (
            self.native.deltas(x.shape[0], x.shape[1])
            if kernels is not None
            and x.shape[1] <= kernels.MAX_STEP_TOKENS
            and x.dtype == torch.float32
            and cache.keys[0].dtype == torch.float32
            and not torch.is_grad_enabled()
            else None
        )
        if deltas is not None:
            x = self.native(kernels, x, mask, cache, memory_mask, deltas)
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward(x, mask, memory_mask, cache, i)
        return self.final_norm(x) if self.final_norm is not None else x


# LayerStack -> its plan. Kept outside the module so that copy.deepcopy(model) never copies a plan
# whose callables would still point at the original model's parameters.
_PLANS: weakref.WeakKeyDictionary[LayerStack, DecodePlan] = weakref.WeakKeyDictionary()


def plan_for(stack: LayerStack) -> DecodePlan:
    """The current plan of ``stack``, built (or rebuilt after a module swap or a switch of the kernels) on demand."""
    plan = _PLANS.get(stack)
    if plan is None or plan.kernels is not native.kernels() or not plan.current():
        plan = _PLANS[stack] = DecodePlan(stack)
    return plan


def run_decoder(
    stack: LayerStack, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache, memory_mask: torch.Tensor | None
) -> torch.Tensor:
    """``stack(x, mask, memory_mask=..., cache=...)[0]``, through the stack's :class:`DecodePlan` in eval mode."""
    if stack.training or not stack.native:  # blocks the plan does not implement (Llama's): PyTorch
        return stack(x, mask, memory_mask=memory_mask, cache=cache)[0]
    return plan_for(stack)(x, mask, cache, memory_mask)


# An encoder's inference forward over more tokens than this runs its rows in chunks of at most this many tokens
# (one row at least), so that a chunk's activations stay in the caches: BERT-base at 64 rows x 256 tokens took
# 1.17x (fp32) and 1.45x (int8) as long in one forward as in chunks of 1,024 tokens, whose speed held from
# 512 to 2,048 tokens a chunk (docs/benchmarks.md, issue 19 lever 9). Rows are independent: outputs are the same.
ENCODER_CHUNK_TOKENS = 1024


def run_encoder(
    stack: LayerStack, x: torch.Tensor, mask: torch.Tensor | None, attention_weights: bool = False,
    keep_last: slice | None = None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """``stack(x, mask, attention_weights=..., keep_last=...)`` of an encoder (no cache, no memory), in chunks of
    rows (:data:`ENCODER_CHUNK_TOKENS`) for a large inference forward without attention maps or per-row
    adapters."""
    rows = max(1, ENCODER_CHUNK_TOKENS // max(x.shape[1], 1))
    if (
        x.shape[0] <= rows
        or attention_weights
        or stack.training
        or torch.is_grad_enabled()
        or (mask is not None and mask.shape[0] != x.shape[0])
        or any(type(m) is LoRALinear and m.routing.groups is not None for m in stack.modules())
    ):
        return _encode(stack, x, mask, attention_weights, keep_last)
    chunks = [_encode(stack, x[i: i + rows], mask[i: i + rows] if mask is not None else None, False, keep_last)[0]
              for i in range(0, x.shape[0], rows)]
    return torch.cat(chunks), [{} for _ in stack.layers]


def _encode(
    stack: LayerStack, x: torch.Tensor, mask: torch.Tensor | None, attention_weights: bool, keep_last: slice | None
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """One forward of the stack. Rows of up to ``MAX_STEP_TOKENS`` positions in float32 CPU inference without
    active adapters take the C++ stack (``DecoderStack.encode``), which saves the interpreter's time per layer
    (about 0.1 ms, a tenth of BERT-base's forward over 16 tokens); ``keep_last`` may then be None or the first
    position alone."""
    plan = (None if stack.training or attention_weights or x.dtype != torch.float32 or not stack.native
            else plan_for(stack))
    native_step = plan.native if plan is not None else None
    if (
        native_step is None
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
        or x.shape[1] > plan.kernels.MAX_STEP_TOKENS
        or keep_last not in (None, slice(0, 1))
        or (mask is not None and mask.dtype != torch.bool)
        or native_step.deltas(x.shape[0], x.shape[1]) != []
    ):
        return stack(x, mask, attention_weights=attention_weights, keep_last=keep_last)
    rows = x.shape[0] * x.shape[1]
    x = native_step.stack.encode(x, mask, native_step.panels(plan.kernels, rows), keep_last is not None)
    return (plan.final_norm(x) if plan.final_norm is not None else x), [{} for _ in stack.layers]
