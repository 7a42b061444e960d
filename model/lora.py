"""LoRA: named low-rank adapters on nn.Linear layers, several resident at once, selectable per batch row.

Each targeted ``nn.Linear`` is wrapped in a :class:`LoRALinear` computing
``y = W x + b + (alpha / r) * B(A(dropout(x)))`` for the adapter its batch row selects. Configs follow
PEFT's LoraConfig; model.lora_io reads and writes PEFT's files, so adapters move between the two.

An adapter may also carry its own full copy of a classifier's head (PEFT's ``modules_to_save``): the head is
wrapped in a :class:`HeadCopies`, routed per row like the LoRALinears.

Merging is an optimisation, never a change of meaning: with adapter ``m`` merged into W, rows that
select ``m`` cost nothing extra, and every other row (base only, or another adapter) gets ``m``'s
delta subtracted, so outputs depend only on the selection, not on what is merged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.int8_linear import Int8Linear
from model.layout import input_major
from model.lora_config import NAME_RULE, AdapterError, LoRAConfig, is_valid_name, quote

logger = logging.getLogger(__name__)

AdapterSelection = str | None | Sequence[str | None]


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

    def _stack(self) -> _Stacked:
        """Every resident adapter concatenated (see :class:`_Stacked`), rebuilt when one is added, removed
        or changed in place (the tensors' version counters are part of the key)."""
        a, b = self.lora_A._modules, self.lora_B._modules  # read directly: this runs every inference step
        # the revision tells a re-added adapter (new tensors start at version 0 again) from the old one
        key = (self._revision, *(m._parameters["weight"]._version for m in a.values()),
               *(m._parameters["weight"]._version for m in b.values()))
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


class HeadCopies(nn.Module):
    """A classifier's head plus adapters' own full copies of it (PEFT's ``modules_to_save``): each row gets its
    adapter's copy, or the base where its adapter has none. Routed like :class:`LoRALinear`."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.copies = _AdapterDict()  # name -> nn.Linear shaped like base
        self.routing = Routing()
        self.train(base.training)

    def add(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Attach adapter `name`'s copy (weight (out, in), bias (out,)) on the base's device and dtype."""
        w = self.base.weight
        with torch.inference_mode(False):
            layer = _linear_from(weight.detach().to(w.device, w.dtype, copy=True))
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


# ---- model-level helpers -------------------------------------------------------------------------


def _check_name(name: Any) -> None:
    if not is_valid_name(name):
        raise AdapterError(f"invalid adapter name {quote(name)}: use {NAME_RULE}")


def _lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


def head_copies(model: nn.Module) -> dict[str, HeadCopies]:
    return {path: m for path, m in model.named_modules() if isinstance(m, HeadCopies)}


def _routed(model: nn.Module) -> list[LoRALinear | HeadCopies]:
    """Every module that follows the adapter selection."""
    return [m for m in model.modules() if isinstance(m, LoRALinear | HeadCopies)]


def layers_with(model: nn.Module, name: str) -> dict[str, LoRALinear]:
    layers = {path: m for path, m in _lora_layers(model).items() if name in m.configs}
    if not layers:
        raise AdapterError(f"unknown adapter {name!r}; resident adapters: {adapter_names(model)}")
    return layers


def check_new_name(model: nn.Module, name: str) -> None:
    _check_name(name)
    if name in adapter_names(model):
        raise AdapterError(f"adapter {name!r} already exists; delete_adapter it first")


def find_targets(model: nn.Module, targets: Sequence[str]) -> dict[str, nn.Module]:
    """Plain nn.Linear (float or model.int8_linear.Int8Linear) or LoRALinear modules named in `targets`."""
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        parent, _, leaf = path.rpartition(".")
        if leaf not in targets:
            continue
        # A LoRALinear's own base is not a target; nn.MultiheadAttention reads out_proj.weight directly.
        plain = isinstance(module, nn.Linear | Int8Linear) and not isinstance(
            model.get_submodule(parent), LoRALinear | nn.MultiheadAttention
        )
        if plain or isinstance(module, LoRALinear):
            found[path] = module
    return found


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def wrap_targets(model: nn.Module, found: dict[str, nn.Module]) -> dict[str, LoRALinear]:
    """Replace each plain Linear in `found` by a LoRALinear around it (same base parameters)."""
    return _wrap(model, found, LoRALinear)


def wrap_heads(model: nn.Module, found: dict[str, nn.Module]) -> dict[str, HeadCopies]:
    """Replace each plain head in `found` by a HeadCopies around it."""
    return _wrap(model, found, HeadCopies)


def _wrap(model: nn.Module, found: dict[str, nn.Module], kind: type) -> dict[str, Any]:
    existing = _routed(model)
    current = existing[0].routing if existing else Routing()
    wrapped = {}
    for path, module in found.items():
        if not isinstance(module, kind):
            module = kind(module)
            module.routing = current
            _set_module(model, path, module)
        wrapped[path] = module
    return wrapped


def _routing(adapters: AdapterSelection, layers: list[LoRALinear]) -> Routing:
    """Validate a selection against the resident adapters and turn it into a Routing."""
    if adapters is None:
        return Routing()
    rows = [adapters] if isinstance(adapters, str) else list(adapters)
    wrong = [a for a in rows if a is not None and not isinstance(a, str)]
    if not rows or wrong:
        raise AdapterError(f"adapters must be None, a name, or a non-empty per-row list of names/None; "
                           f"got {adapters!r}")
    known = {n for layer in layers for n in layer.configs}
    distinct = list(dict.fromkeys(rows))
    unknown = [a for a in distinct if a is not None and a not in known]
    if unknown:
        raise AdapterError(f"unknown adapter(s) {unknown}; resident adapters: {sorted(known)}")
    if len(distinct) == 1:
        return Routing(name=distinct[0])
    device = layers[0].base.weight.device
    groups = {n: torch.tensor([i for i, a in enumerate(rows) if a == n], dtype=torch.long, device=device)
              for n in distinct}
    return Routing(groups=groups, rows=len(rows))


# ---- public API ----------------------------------------------------------------------------------


def add_adapter(model: nn.Module, name: str, config: LoRAConfig, seed: int | None = None) -> None:
    """Wrap the target Linears of `model` (once) and attach a new adapter: A kaiming-uniform, B zero."""
    check_new_name(model, name)
    found = find_targets(model, config.target_modules)
    if not found:
        raise AdapterError(f"adapter {name!r}: the model has no nn.Linear named any of {list(config.target_modules)}")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    for layer in wrap_targets(model, found).values():
        # PEFT's init, drawn in float32 on CPU so a seed gives the same A on any device or dtype.
        a = torch.empty(config.r, layer.base.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        layer.add(name, config, a, torch.zeros(layer.base.out_features, config.r))
    logger.info("added LoRA adapter %r (r=%d) on %d modules", name, config.r, len(found))


def delete_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter `name` (its head copies too); modules left with no adapter go back to their plain nn.Linear."""
    layers = layers_with(model, name)
    if any(layer.merged == name for layer in layers.values()):
        raise AdapterError(f"adapter {name!r} is merged; unmerge_adapter first")
    routing = next(iter(layers.values())).routing
    if name in routing.names():
        raise AdapterError(f"adapter {name!r} is selected for the current forward passes; clear_adapters first")
    for path, layer in layers.items():
        layer.remove(name)
        if not layer.configs:
            _set_module(model, path, layer.base)
    for path, heads in head_copies(model).items():
        if name in heads.copies:
            del heads.copies[name]
            if not list(heads.copies):
                _set_module(model, path, heads.base)
    logger.info("deleted LoRA adapter %r", name)


def adapter_names(model: nn.Module) -> list[str]:
    """Resident adapters, sorted."""
    return sorted({n for layer in _lora_layers(model).values() for n in layer.configs})


def adapter_parameter_count(model: nn.Module) -> int:
    """Parameters the resident adapters add to ``model`` (their A and B matrices and head copies)."""
    held: list[nn.Module] = [m for layer in _lora_layers(model).values() for m in (layer.lora_A, layer.lora_B)]
    held += [copies.copies for copies in head_copies(model).values()]
    return sum(p.numel() for module in held for p in module.parameters())


def get_adapter_config(model: nn.Module, name: str) -> LoRAConfig:
    return next(iter(layers_with(model, name).values())).configs[name]


def set_adapters(model: nn.Module, adapters: AdapterSelection) -> None:
    """Select adapters for following forwards: None (base), a name (all rows), or one name/None per row."""
    routing = _routing(adapters, list(_lora_layers(model).values()))
    for module in _routed(model):
        module.routing = routing


def clear_adapters(model: nn.Module) -> None:
    """Back to base-only forwards."""
    set_adapters(model, None)


@contextmanager
def use_adapters(model: nn.Module, adapters: AdapterSelection) -> Iterator[None]:
    """set_adapters for the duration of the block, restoring the previous selection on exit."""
    routing = _routing(adapters, list(_lora_layers(model).values()))
    modules = _routed(model)
    previous = [module.routing for module in modules]
    for module in modules:
        module.routing = routing
    try:
        yield
    finally:
        for module, prev in zip(modules, previous, strict=True):
            module.routing = prev


@torch.no_grad()
def merge_adapter(model: nn.Module, name: str, safe: bool = True) -> None:
    """W += scale * B @ A for adapter `name` (one merged adapter at a time; outputs do not change)."""
    layers = layers_with(model, name)
    merged = {layer.merged for layer in _lora_layers(model).values()} - {None}
    if merged:
        raise AdapterError(f"cannot merge {name!r}: adapter {merged.pop()!r} is merged; unmerge_adapter first")
    if any(not isinstance(layer.base, nn.Linear) for layer in layers.values()):
        raise AdapterError(f"cannot merge {name!r}: the model's weights are quantised (int8); adapters run unmerged")
    if safe:  # check every layer before touching any, so a failure leaves the model unmerged
        for path, layer in layers.items():
            if not torch.isfinite(layer.base.weight + layer.delta_weight(name)).all():
                raise AdapterError(f"adapter {name!r}: merging into {path} gives non-finite weights; not merged")
    for layer in layers.values():
        layer.base.weight.add_(layer.delta_weight(name))
        layer.merged = name
    logger.info("merged LoRA adapter %r into %d modules", name, len(layers))


@torch.no_grad()
def unmerge_adapter(model: nn.Module) -> None:
    """Subtract the merged adapter's delta from the base weights (no-op if nothing is merged)."""
    for layer in _lora_layers(model).values():
        if layer.merged is not None:
            layer.base.weight.sub_(layer.delta_weight(layer.merged))
            layer.merged = None


def mark_only_lora_trainable(model: nn.Module, name: str) -> list[nn.Parameter]:
    """Freeze every parameter except adapter `name`'s A and B and its head copies, which are returned."""
    layers = layers_with(model, name)
    if any(layer.merged == name for layer in layers.values()):
        raise AdapterError(f"adapter {name!r} is merged; unmerge_adapter before training it")
    model.requires_grad_(False)
    params = [p for layer in layers.values() for p in (layer.lora_A[name].weight, layer.lora_B[name].weight)]
    params += [p for heads in head_copies(model).values() if name in heads.copies
               for p in heads.copies[name].parameters()]
    for p in params:
        p.requires_grad_(True)
    return params
