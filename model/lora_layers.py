"""LoRA layers: an nn.Linear with named low-rank adapters (:class:`LoRALinear`), several resident at once and
selected per batch row (:class:`Routing`), and a head's module with adapters' own full copies (:class:`HeadCopies`).

Each targeted ``nn.Linear`` is wrapped in a :class:`LoRALinear` computing
``y = W x + b + (alpha / r) * B(A(dropout(x)))`` for the adapter its batch row selects. An adapter may also carry
its own full copy of a head (PEFT's ``modules_to_save``: a classifier's head, its Linears and LayerNorm each, a
language model's lm_head, or its token embeddings): each module is wrapped in a :class:`HeadCopies`, routed per row
like the LoRALinears.
model.lora attaches, selects and merges adapters across a whole model.

Merging is an optimisation, never a change of meaning: with adapter ``m`` merged into W, rows that
select ``m`` cost nothing extra, and every other row (base only, or another adapter) gets ``m``'s
delta subtracted, so outputs depend only on the selection, not on what is merged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.layout import input_major
from model.lora_config import AdapterError, LoRAConfig


class _AdapterDict(nn.ModuleDict):
    """nn.ModuleDict keyed by adapter name: '.' (illegal in module names) is stored as ':', and names
    that shadow ModuleDict attributes ('train', 'keys', ...) are allowed."""

    def __getitem__(self, name: str) -> nn.Module:
        return self._modules[name.replace(".", ":")]

    def __setitem__(self, name: str, module: nn.Module) -> None:
        self._modules[name.replace(".", ":")] = module

    def __delitem__(self, name: str) -> None:
        del self._modules[name.replace(".", ":")]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.replace(".", ":") in self._modules

    def __iter__(self) -> Iterator[str]:
        return (k.replace(":", ".") for k in self._modules)

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(self)

    def items(self) -> list[tuple[str, nn.Module]]:  # type: ignore[override]
        return [(k.replace(":", "."), m) for k, m in self._modules.items()]


@dataclass(frozen=True)
class Routing:
    """Adapter selection shared by every LoRALinear: one `name` for all rows, or per-row `groups`."""

    name: str | None = None
    groups: dict[str | None, torch.Tensor] | None = None  # adapter (None = base) -> LongTensor of rows
    rows: int = 0  # batch size the groups were built for
    # LoRALinear.row_deltas' scales, by what they depend on; shared by the layers alike
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def names(self) -> set[str]:
        return {n for n in (self.groups or {self.name: None}) if n is not None}


class _Stacked(NamedTuple):
    """A LoRALinear's resident adapters side by side, for mixed batches in inference.

    A non-finite weight anywhere (``finite`` False) sends mixed batches back to the per-group loop:
    in one GEMM over every adapter, 0 x NaN would reach the rows of the other adapters too.
    """

    key: tuple  # the layer's adapter revision, then the version counters of its adapters' A and B weights
    a: torch.Tensor  # (sum of ranks, in)
    b: torch.Tensor  # (out, sum of ranks)
    spans: tuple[tuple[str, int, int, float], ...]  # (name, first column, end column, scaling)
    finite: bool


class RowDeltas(NamedTuple):
    """What an inference forward adds to a LoRALinear's base output, in two GEMMs: ((x A^T) * scales) B^T.

    Each row's scales hold its adapter's scaling on that adapter's columns of A (and minus the merged
    adapter's on its columns when the row selects another); one row of scales when every row selects alike.
    """

    a: torch.Tensor  # (columns, in)
    b: torch.Tensor  # (out, columns)
    scales: torch.Tensor  # (rows or 1, columns)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x.to(self.a.dtype), self.a)  # (rows, ..., columns)
        return F.linear(h * self.scales.view(self.scales.shape[0], *([1] * (h.dim() - 2)), -1), self.b)


def _linear_from(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear holding `weight` (out, in), without running an init."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight)
    return layer


class _KeptDeltas(NamedTuple):
    """LoRALinear.row_deltas' last answer and what it was computed under."""

    routing: Routing
    state: tuple  # (merged adapter, adapter revision)
    stacked: _Stacked | None  # the stacked adapters it used (None: one adapter's own weights, or no delta)
    deltas: RowDeltas | None


class LoRALinear(nn.Module):
    """nn.Linear plus any number of named low-rank adapters: y = W x + b + sum_selected (alpha/r) * B(A(dropout(x)))."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_A = _AdapterDict()  # name -> nn.Linear(in, r, bias=False)
        self.lora_B = _AdapterDict()  # name -> nn.Linear(r, out, bias=False)
        self.scaling: dict[str, float] = {}
        self.configs: dict[str, LoRAConfig] = {}
        self.merged: str | None = None  # adapter whose delta is currently added into base.weight
        self.routing = Routing()
        self._stacked: _Stacked | None = None  # see _stack
        self._revision = 0  # bumped when an adapter is added or removed
        self._kept: _KeptDeltas | None = None  # see row_deltas
        self.train(base.training)  # a wrapper made after model.eval() must not switch dropout on

    def add(self, name: str, config: LoRAConfig, a: torch.Tensor, b: torch.Tensor) -> None:
        """Attach adapter `name` with copies of A (r, in) and B (out, r) on the base's device and dtype.

        The copies are normal tensors even when made under ``torch.inference_mode`` (a service loading an
        adapter between steps): :meth:`_stack` keys on their version counters, which inference tensors lack.
        """
        w = self.base.weight
        self._revision += 1
        with torch.inference_mode(False):
            self.lora_A[name] = _linear_from(a.detach().to(w.device, w.dtype, copy=True))
            self.lora_B[name] = _linear_from(b.detach().to(w.device, w.dtype, copy=True))
        self.scaling[name] = config.scaling
        self.configs[name] = config

    def remove(self, name: str) -> None:
        del self.lora_A[name], self.lora_B[name], self.scaling[name], self.configs[name]
        self._revision += 1

    def delta_weight(self, name: str) -> torch.Tensor:
        """scale * B @ A as (out, in) in the base weight's dtype (the product is taken in >= float32)."""
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        dtype = torch.promote_types(a.dtype, torch.float32)
        return (b.to(dtype) @ a.to(dtype) * self.scaling[name]).to(self.base.weight.dtype)

    def _delta(self, name: str, x: torch.Tensor, dropout: float) -> torch.Tensor:
        a = self.lora_A[name]
        x = F.dropout(x.to(a.weight.dtype), dropout, self.training)
        return self.lora_B[name](a(x)) * self.scaling[name]

    def _terms(self, name: str | None) -> tuple[str | None, str | None]:
        """(adapter to add, merged adapter to subtract) for rows selecting `name`."""
        if name == self.merged:
            return None, None
        return (name if name in self.lora_A else None), self.merged

    def _correction(self, terms: tuple[str | None, str | None], x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        add, sub = terms
        # The merged delta sits in W and acts on the un-dropped input, so it is subtracted without dropout.
        delta = self._delta(add, x, self.configs[add].lora_dropout) if add is not None else 0
        return (delta - self._delta(sub, x, 0.0) if sub is not None else delta).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (rows, ..., in) -> (rows, ..., out); mixed routings index rows on dim 0."""
        out = self.base(x)
        routing = self.routing
        if routing.groups is None:
            terms = self._terms(routing.name)
            return out if terms == (None, None) else out + self._correction(terms, x, out.dtype)
        if x.shape[0] != routing.rows:
            raise AdapterError(f"per-row adapters were set for {routing.rows} rows but the input has {x.shape[0]}")
        if self.stackable():  # inference
            deltas = self.row_deltas(x.shape[0])
            return out if deltas is None else out + deltas(x).to(out.dtype)
        for name, idx in routing.groups.items():
            terms = self._terms(name)
            if terms != (None, None):
                idx = idx.to(x.device)
                out.index_add_(0, idx, self._correction(terms, x.index_select(0, idx), out.dtype))
        return out

    def stackable(self) -> bool:
        """Whether forwards may take :meth:`row_deltas` now: inference (eval mode, no autograd), and finite
        adapter weights where rows mix adapters or the merged one is taken out (see :class:`_Stacked`)."""
        if self.training or torch.is_grad_enabled():
            return False
        return (self.routing.groups is None and self.merged is None) or self._stack().finite

    def row_deltas(self, rows: int) -> RowDeltas | None:
        """The adapter deltas an inference forward over ``rows`` rows adds to the base's output under the
        current routing and merge, or None where no row gets one. Call :meth:`stackable` first (it also
        brings the stacked adapters up to date with in-place changes).

        Asked once per decoding step: the answer is kept while the routing object, the merge, the resident
        adapters and (for stacked ones) their weights' versions stay the same."""
        routing = self.routing
        if routing.groups is not None and rows != routing.rows:
            raise AdapterError(f"per-row adapters were set for {routing.rows} rows but the input has {rows}")
        state = (self.merged, self._revision)
        kept = self._kept
        if kept is not None and kept.routing is routing and kept.state == state and (
            kept.stacked is None or kept.stacked is self._stacked  # stackable()'s _stack() rebuilt it if changed
        ):
            return kept.deltas
        stacked, deltas = self._current_deltas()
        self._kept = _KeptDeltas(routing, state, stacked, deltas)
        return deltas

    def _current_deltas(self) -> tuple[_Stacked | None, RowDeltas | None]:
        """(the stacked adapters used, or None; the deltas) for row_deltas."""
        routing = self.routing
        selected = routing.groups if routing.groups is not None else {routing.name: None}
        terms = {name: self._terms(name) for name in selected}
        if all(t == (None, None) for t in terms.values()):
            return None, None
        add, sub = terms[routing.name] if routing.groups is None else (None, None)
        if add is not None and sub is None:  # one adapter on every row, none merged: its own A and B
            key = ("one", add, self.scaling[add])
            a, b = self.lora_A[add].weight, self.lora_B[add].weight  # no autograd here: no detach needed
            scales = routing.masks.get(key)
            if scales is None:
                scales = routing.masks[key] = torch.full((1, a.shape[0]), key[2], dtype=a.dtype, device=a.device)
            return None, RowDeltas(a, b, scales)  # the Parameters themselves: in-place changes reach it
        stacked = self._stack()
        key = ("rows", stacked.spans, self.merged)  # shared by the layers holding the same adapters alike
        scales = routing.masks.get(key)
        if scales is None:
            columns = {name: (lo, hi, scale) for name, lo, hi, scale in stacked.spans}
            scales = torch.zeros(routing.rows if routing.groups is not None else 1, stacked.a.shape[0],
                                 dtype=stacked.a.dtype, device=stacked.a.device)
            for name, rows_of in selected.items():
                target = slice(None) if rows_of is None else rows_of.to(scales.device)
                for adapter, sign in zip(terms[name], (1.0, -1.0), strict=True):
                    if adapter is not None:
                        lo, hi, scale = columns[adapter]
                        scales[target, lo:hi] += sign * scale
            routing.masks[key] = scales
        return stacked, RowDeltas(stacked.a, stacked.b, scales)

    def adapters_key(self) -> tuple:
        """What the resident adapters' weights are: changed when one is added or removed, or changed in place."""
        a, b = self.lora_A._modules, self.lora_B._modules  # read directly: this runs every inference step
        # the revision tells a re-added adapter (new tensors start at version 0 again) from the old one
        return (self._revision, *(m._parameters["weight"]._version for m in a.values()),
                *(m._parameters["weight"]._version for m in b.values()))

    def _stack(self) -> _Stacked:
        """Every resident adapter concatenated (see :class:`_Stacked`), rebuilt when one is added, removed
        or changed in place (the tensors' version counters are part of the key)."""
        key = self.adapters_key()
        if self._stacked is None or self._stacked.key != key:
            names = list(self.lora_A)
            spans, start = [], 0
            for name in names:
                r = self.configs[name].r
                spans.append((name, start, start + r, self.scaling[name]))
                start += r
            a_cat = torch.cat([self.lora_A[n].weight for n in names]).detach()
            # B input-major: a row adds only its own adapter's columns of B^T (lora_delta.cpp), and MKL
            # likes that layout too (model/layout.py)
            b_cat = input_major(torch.cat([self.lora_B[n].weight for n in names], dim=1).detach())
            finite = bool(torch.isfinite(a_cat).all() and torch.isfinite(b_cat).all())
            self._stacked = _Stacked(key, a_cat, b_cat, tuple(spans), finite)
        return self._stacked

    def extra_repr(self) -> str:
        return f"adapters={list(self.configs)}, merged={self.merged!r}"


HeadModule = nn.Linear | nn.Embedding | nn.LayerNorm  # what HeadCopies copies


class HeadCopies(nn.Module):
    """A head's module (an nn.Linear, a LayerNorm over the last dimension, or token embeddings: an nn.Embedding) plus
    adapters' own full copies of it (PEFT's ``modules_to_save``): each row gets its adapter's copy, or the base where
    its adapter has none. Routed like :class:`LoRALinear`. The base may be a LoRALinear (other adapters' LoRAs on the
    head, for the rows without a copy: a copy replaces the whole module for its rows) or quantised (model.quantize:
    the copies stay in its float dtype)."""

    def __init__(self, base: HeadModule | LoRALinear) -> None:
        super().__init__()
        self.base = base
        self.copies = _AdapterDict()  # name -> a module like base (nn.Linear, nn.LayerNorm or nn.Embedding)
        self.routing = Routing()
        self.train(base.training)

    @property
    def weight(self) -> torch.Tensor:
        """The base's weight: what the model reads of the wrapped module (its dtype and device, a tied head)."""
        return plain_module(self.base).weight

    def add(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Attach adapter `name`'s copy (weight shaped like the base's, bias (out,) or None: a copy without one) on
        the base's device and dtype."""
        base = plain_module(self.base)
        w = base.weight
        with torch.inference_mode(False):
            weight = weight.detach().to(w.device, w.dtype, copy=True)
            if isinstance(base, nn.Embedding):
                layer = nn.Embedding.from_pretrained(weight, freeze=False, padding_idx=base.padding_idx)
            elif isinstance(base, nn.LayerNorm):  # the base's class: ours runs on the kernels where it has a bias
                layer = type(base)(base.normalized_shape, base.eps, bias=bias is not None, device="meta")
                layer.weight = nn.Parameter(weight)
            else:
                layer = _linear_from(weight)
            if bias is not None:
                layer.bias = nn.Parameter(bias.detach().to(w.device, w.dtype, copy=True))
        self.copies[name] = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (rows, ..., in) -> (rows, ..., out); mixed routings index rows on dim 0."""
        routing = self.routing
        if routing.groups is None:
            name = routing.name
            return self.copies[name](x) if name in self.copies else self.base(x)
        if x.shape[0] != routing.rows:
            raise AdapterError(f"per-row adapters were set for {routing.rows} rows but the input has {x.shape[0]}")
        out = self.base(x)
        for name, idx in routing.groups.items():
            if name in self.copies:
                idx = idx.to(x.device)
                out = out.index_copy(0, idx, self.copies[name](x.index_select(0, idx)).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"copies={list(self.copies)}"


def plain_module(module: nn.Module) -> nn.Module:
    """The module ``module`` wraps (through a LoRALinear and a HeadCopies around it), or ``module`` itself."""
    while isinstance(module, LoRALinear | HeadCopies):
        module = module.base
    return module
