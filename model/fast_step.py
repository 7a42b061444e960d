"""The decoder stack of one decoding step without nn.Module dispatch: the inference fast path.

A decode step at batch 1 spends as long in Python as in some of its GEMMs: every layer makes a
dozen nn.Module calls (hooks machinery, attribute lookups) around a dozen tensor ops. This module
walks the same layers once, keeps for each one plain callables bound to the same parameters
(``torch.layer_norm`` / ``model.kernel_layers.linear`` on the Parameter objects, an ``Int8Linear``'s or a
``LoRALinear``'s own forward), and replays them per step. It computes exactly what
``LayerStack.forward`` computes in eval mode with a cache (tests compare the two in float64);
training, attention weights and ``keep_last`` take the general path.

The plan is rebuilt when a module or a bound Parameter object is swapped (LoRA wrapping, int8
quantisation, a new Parameter assigned: noticed through torch's registration hooks, so a swap is an assignment, not
a ``del`` or a write into ``_modules``); in-place weight changes (``load_state_dict``, LoRA merge, ``model.layout``)
reach it through the shared Parameters.

Which blocks it implements is one predicate, :func:`unsupported` (of the config; ``LayerStack.native`` holds its
verdict): GPT-2's, BERT's and Marian's blocks, and Llama's (RMSNorm, rotary positions at each row's position with
every scaling of model/rope.py and partial rotary widths, grouped-query attention, a head width other than
d_model / heads, the gated FFN, optional biases) with Mistral's, Qwen3's and Gemma 3's (q/k norms, sliding-window
layers, (1 + weight) RMSNorms, sandwich norms, a scale of q.k, the window layers' own rotary base), and T5's (the
scale of q.k in cross-attention too, the relative position bias). Rotary cos/sin are computed once per step here
(``Rotary.cos_sin``) for each distinct rotary of the layers, the window layers' mask once per step
(``within_window``, as MultiHeadAttention applies it), and T5's float self-attention mask of the bias once per step
(``RelativePositionBias.attention_mask``, as LayerStack.forward makes it). The stack as the C++ step binds it is
model/native_step.py's.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from model import native
from model.attention import KERNEL_MAX_QUERIES, MultiHeadAttention, decode_attention
from model.kernel_layers import is_layer_norm, is_plain, linear
from model.kv_cache import KVCache, within_window
from model.layers import LayerStack, TransformerLayer
from model.lora_layers import LoRALinear
from model.native_step import Angles, Masks, NativeStep, is_rms_norm, rotary_kinds
from model.rope import Rotary, apply_rotary

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
    q_norm: Op | None = None  # norms of each head of q and k, before rotation
    k_norm: Op | None = None
    query_scale: float = 1.0  # q's factor after rotation (MultiHeadAttention.query_scale)

    @classmethod
    def of(cls, attn: MultiHeadAttention) -> _Attention:
        qkv = _op(attn.qkv_proj) if attn.fused else None
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
        norms = (_op(attn.q_norm), _op(attn.k_norm)) if attn.q_norm is not None else (None, None)
        return cls(*(_op(p) for p in projections), qkv, attn.split_heads, attn.split_qkv, *norms, attn.query_scale)

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
    up: Op | None  # a gated FFN's
    self_post_norm: Op | None  # sandwich norms: of each sub-layer's output, before the residual add
    ffn_post_norm: Op | None

    @classmethod
    def of(cls, layer: TransformerLayer) -> _Layer:
        cross = layer.cross_attn is not None
        sandwich = layer.self_attn_post_norm is not None
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
            up=_op(layer.ffn.up) if layer.ffn.up is not None else None,
            self_post_norm=_op(layer.self_attn_post_norm) if sandwich else None,
            ffn_post_norm=_op(layer.ffn_post_norm) if sandwich else None,
        )

    def sublayer(self, x: torch.Tensor, norm: Op, f: Callable[[torch.Tensor], torch.Tensor],
                 post: Op | None = None) -> torch.Tensor:
        """Pre-LN: x + f(LN(x)), with a ``post`` norm x + post(f(LN(x))); post-LN: LN(x + f(x)) (eval: no dropout)."""
        if self.pre_norm:
            out = f(norm(x))
            return x + (out if post is None else post(out))
        return norm(x + f(x))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, memory_mask: torch.Tensor | None, cache: KVCache, i: int,
        angles: Angles | None = None,
    ) -> torch.Tensor:
        """One layer's step; ``angles``: this step's rotary cos/sin (rotary stacks)."""
        attn = self.self_attn

        def self_attention(h: torch.Tensor) -> torch.Tensor:
            if attn.qkv is not None:
                q, k, v = attn.split_qkv(attn.qkv(h))
            else:
                q, k, v = attn.heads(attn.q(h)), attn.heads(attn.k(h)), attn.heads(attn.v(h))
            if attn.q_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            if angles is not None:
                q, k = apply_rotary(q, *angles), apply_rotary(k, *angles)
            if attn.query_scale != 1.0:
                q = q * attn.query_scale
            k, v = cache.write(i, k, v)
            if k.dtype != q.dtype:  # a cache kept in another dtype
                k, v = k.to(q.dtype), v.to(q.dtype)
            return attn.merge(decode_attention(q, k, v, mask, cache.prefix, i))

        x = self.sublayer(x, self.self_norm, self_attention, self.self_post_norm)
        if self.cross_attn is not None:
            cross, memory = self.cross_attn, cache.cross

            def cross_attention(h: torch.Tensor) -> torch.Tensor:
                q = cross.heads(cross.q(h))
                if cross.query_scale != 1.0:
                    q = q * cross.query_scale
                out = _grouped_attention(q, memory.keys[i], memory.values[i], memory_mask, memory.group_size)
                return cross.merge(out)

            x = self.sublayer(x, self.cross_norm, cross_attention)
        return self.sublayer(x, self.ffn_norm, self.ffn, self.ffn_post_norm)

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """fc2(act(fc1 h)), gated: fc2(act(fc1 h) * up(h))."""
        inner = self.activation(self.fc1(h))
        return self.fc2(inner if self.up is None else inner * self.up(h))


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
    "layer": ("self_attn_norm", "self_attn", "cross_attn_norm", "cross_attn", "ffn_norm", "ffn", "self_attn_post_norm",
              "ffn_post_norm"),
    "attention": ("q_proj", "k_proj", "v_proj", "out_proj", "qkv_proj", "q_norm", "k_norm"),
    "ffn": ("fc1", "fc2", "up"),
}


class _AssignmentCounter:
    """How many submodules and parameters any module has been assigned (``setattr``, ``add_module``,
    ``register_parameter``: torch's global registration hooks) since import: a plan compares its bindings again
    only after the count moved."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, _module: nn.Module, _name: str, _value: object) -> None:
        self.count += 1


_ASSIGNMENTS = _AssignmentCounter()
torch.nn.modules.module.register_module_module_registration_hook(_ASSIGNMENTS)
torch.nn.modules.module.register_module_parameter_registration_hook(_ASSIGNMENTS)


def _watched(stack: LayerStack) -> list[tuple[dict, str, object]]:
    """(dict, name, value) of every module and parameter the plan binds, to notice a swap: the module
    dicts of the stack (its final norm, T5's bias), of the layers and their attention/FFN blocks, and the parameter
    dicts of the bound Linear/LayerNorm layers (a new Parameter object assigned to one of them)."""
    watched: list[tuple[dict, str, object]] = [(stack._modules, name, stack._modules.get(name))
                                               for name in ("final_norm", "relative_bias")]
    for layer in stack.layers:
        parents = [(layer, "layer"), (layer.self_attn, "attention"), (layer.ffn, "ffn")]
        if layer.cross_attn is not None:
            parents.append((layer.cross_attn, "attention"))
        for parent, kind in parents:
            watched += [(parent._modules, name, parent._modules.get(name)) for name in _WATCHED[kind]]
    for module in stack.modules():
        if is_plain(module) or is_layer_norm(module) or is_rms_norm(module):
            watched += [(module._parameters, name, p) for name, p in module._parameters.items()]
    return watched


class DecodePlan:
    """The layers of a ``LayerStack`` bound for replay; see the module docstring."""

    def __init__(self, stack: LayerStack) -> None:
        self.layers = [_Layer.of(layer) for layer in stack.layers]
        self.final_norm = _op(stack.final_norm) if stack.final_norm is not None else None
        self.kernels = native.kernels()  # the process's kernels when the plan was built (plan_for compares)
        self.native = NativeStep.of(stack, self.kernels) if self.kernels is not None else None
        self.rotaries, self.rotary_of = rotary_kinds(stack)  # the distinct rotaries, each layer's among them
        self.windows = [layer.self_attn.window for layer in stack.layers]
        self.window = next((w for w in self.windows if w is not None), None)  # NativeStep: one for all window layers
        self.relative_bias = stack.relative_bias  # T5's: the self-attention mask carries it (a float mask)
        self._parents, self._names, self._children = zip(*_watched(stack), strict=True)
        self._compared_at = _ASSIGNMENTS.count  # the assignments counted when the plan last matched its stack

    def current(self) -> bool:
        """Whether the stack still holds the modules and parameters this plan was built from (q/k/v and
        qkv_proj included, so the fused projection's use follows too). Runs every step: compared one by one only
        after an assignment somewhere since the last comparison (:data:`_ASSIGNMENTS`); the comparison touches
        ~600 dicts that the step's weights have pushed out of the caches (90 us a SmolLM2 step)."""
        if self._compared_at == _ASSIGNMENTS.count:
            return True
        count = _ASSIGNMENTS.count
        same = all(map(operator.is_, map(dict.get, self._parents, self._names), self._children))
        if same:
            self._compared_at = count
        return same

    def __call__(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache, memory_mask: torch.Tensor | None = None,
        prefill: bool = False,
    ) -> torch.Tensor:
        """One step of x (B, t, D) into ``cache``; ``prefill``: a prompt's tokens (NativeStep.prefill)."""
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
        angles = [_angles(rotary, cache) for rotary in self.rotaries]
        if self.relative_bias is not None:  # once per step for every layer, as LayerStack.forward makes it
            mask = self.relative_bias.attention_mask(mask, x.shape[1], cache)
        if deltas is not None:
            window = None if self.window is None else _window_mask(mask, cache, x.shape[1], self.window)
            masks: Masks = (mask, window)
            native_step = self.native.prefill if prefill else self.native
            x = native_step(kernels, x, masks, cache, memory_mask, deltas, angles)
        else:
            by_window = {w: _window_mask(mask, cache, x.shape[1], w) for w in set(self.windows) - {None}}
            for i, layer in enumerate(self.layers):
                window = self.windows[i]
                x = layer.forward(x, mask if window is None else by_window[window], memory_mask, cache, i,
                                  angles[self.rotary_of[i]] if angles else None)
        return self.final_norm(x) if self.final_norm is not None else x


def _window_mask(mask: torch.Tensor | None, cache: KVCache, tokens: int, window: int) -> torch.Tensor | None:
    """This step's self-attention mask of a layer attending within ``window`` (``within_window``, as
    MultiHeadAttention narrows it); ``mask`` itself while every visible key is within the window of every query."""
    positions = MultiHeadAttention._own_positions(None, cache)  # the rows' own positions; refuses a shared prefix
    visible = cache.max_length + tokens
    if visible <= window:
        return mask
    return within_window(mask, positions[:1] if cache.uniform else positions, visible, window)


def _angles(rotary: Rotary, cache: KVCache) -> Angles:
    """This step's rotary cos and sin at each row's positions (its write positions after its shared prefix, as
    MultiHeadAttention rotates them), contiguous float32: (1, t, R) while every row is at the same position (then
    sliced from the rotary's table where it keeps one: ``Rotary.cos_sin_from``)."""
    positions = cache.write_positions
    if cache.uniform and cache.prefix is None:
        found = rotary.cos_sin_from(cache.max_length, positions.shape[1], positions.device)
        if found is not None:
            return found
    if cache.prefix is not None:
        positions = positions + cache.prefix.lengths[:, None]
    elif cache.uniform:
        positions = positions[:1]
    cos, sin = rotary.cos_sin(positions)
    return cos.contiguous(), sin.contiguous()


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
    if stack.training or not stack.native:  # blocks the plan does not implement (unsupported()): PyTorch
        return stack(x, mask, memory_mask=memory_mask, cache=cache)[0]
    return plan_for(stack)(x, mask, cache, memory_mask)


def run_prefill(stack: LayerStack, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
    """A causal prompt's forward into ``cache`` (``stack(x, mask, cache=cache)[0]``): through the stack's plan, and
    so the C++ step, while it takes the prompt in one step (``MAX_STEP_TOKENS`` tokens a row); LayerStack.forward
    beyond: the interpreter's time per layer is then saved on the prompt too (32-token prompts: 1.2-1.5x faster on
    SmolLM2 and Qwen2.5, fp32 and int8; docs/benchmarks.md, "Batch-1 decoding near the weight-read floor")."""
    kernels = native.kernels()
    if (kernels is None or x.shape[1] > kernels.MAX_STEP_TOKENS or x.device.type != "cpu" or stack.training
            or not stack.native):
        return stack(x, mask, cache=cache)[0]
    return plan_for(stack)(x, mask, cache, None, prefill=True)


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
    """One forward of the stack. Rows of up to ``MAX_ENCODE_TOKENS`` positions in float32 CPU inference without
    active adapters take the C++ stack (``DecoderStack.encode``), which saves the interpreter's time per layer
    (about 0.1 ms, a tenth of BERT-base's forward over 16 tokens); ``keep_last`` may then be None or the first
    position alone. Past decode_attention's queries its layers attend through the layers' own attention
    (model.attention.decode_attention, called back), so the two paths give the same floats."""
    plan = (None if stack.training or attention_weights or x.dtype != torch.float32 or not stack.native
            else plan_for(stack))
    native_step = plan.native if plan is not None else None
    if (
        native_step is None
        or plan.rotaries
        or plan.window is not None
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
        or x.shape[1] > plan.kernels.MAX_ENCODE_TOKENS
        or keep_last not in (None, slice(0, 1))
        or (mask is not None and mask.dtype != torch.bool)
        or (plan.relative_bias is not None and keep_last is not None)  # which LayerStack.forward refuses
        or native_step.deltas(x.shape[0], x.shape[1]) != []
    ):
        return stack(x, mask, attention_weights=attention_weights, keep_last=keep_last)
    if plan.relative_bias is not None:  # T5's encoder: the bias as a float mask, as LayerStack.forward makes it
        mask = plan.relative_bias.attention_mask(mask, x.shape[1], None)
    rows = x.shape[0] * x.shape[1]
    attention = None  # the kernel the layers pick for longer rows (a bf16 model's bf16 products)
    if x.shape[1] > KERNEL_MAX_QUERIES:
        attention = partial(decode_attention, mask=mask, bf16_products=stack.layers[0].self_attn.bf16_products)
    x = native_step.stack.encode(x, mask, native_step.panels(plan.kernels, rows), keep_last is not None, attention)
    return (plan.final_norm(x) if plan.final_norm is not None else x), [{} for _ in stack.layers]
