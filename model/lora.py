"""LoRA adapters on a whole model: attach (:func:`add_adapter`), select per batch row (:func:`set_adapters`,
:func:`use_adapters`), merge, delete and train them. The layers they live in are model.lora_layers'.

Configs follow PEFT's LoraConfig; model.lora_io reads and writes PEFT's files, so adapters move between the two.
Merging never changes outputs (model.lora_layers): rows that select another adapter get the merged one's delta
subtracted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from model.lora_config import NAME_RULE, AdapterError, LoRAConfig, is_valid_name, quote
from model.lora_layers import HeadCopies, LoRALinear, Routing
from model.quantize import QUANTIZED_LINEARS, quantized_mode

logger = logging.getLogger(__name__)

AdapterSelection = str | None | Sequence[str | None]


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
    """Plain nn.Linear (float, or quantised: model.quantize.QUANTIZED_LINEARS) or LoRALinear modules named in
    `targets`; a head with adapters' copies (HeadCopies) gives the Linear it wraps, under its own path (see
    :func:`public_path`)."""
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        parent, _, leaf = path.rpartition(".")
        if leaf not in targets:
            continue
        if isinstance(module, HeadCopies):  # its LoRAs go inside the copies (see _wrap)
            module = module.base
        elif isinstance(model.get_submodule(parent), LoRALinear | nn.MultiheadAttention):
            continue  # a LoRALinear's own base is not a target; nn.MultiheadAttention reads out_proj.weight directly
        if isinstance(module, (nn.Linear, LoRALinear, *QUANTIZED_LINEARS)):
            found[path] = module
    return found


def _weight_holders(model: nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> every name it has in ``model`` (several where weights are tied)."""
    holders: dict[int, list[str]] = {}
    for path, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(path)
    return holders


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def public_path(model: nn.Module, path: str) -> str:
    """The path PEFT names the module at ``path`` by: a LoRALinear inside a HeadCopies (``<head>.base``) is the
    head's."""
    parent, _, leaf = path.rpartition(".")
    return parent if leaf == "base" and isinstance(model.get_submodule(parent), HeadCopies) else path


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
            outer = model.get_submodule(path)
            # a LoRALinear goes inside a head's copies (which replace the whole module for their rows)
            outer_copies = kind is LoRALinear and isinstance(outer, HeadCopies)
            _set_module(model, f"{path}.base" if outer_copies else path, module)
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
    quantized = [quantized_mode(layer.base) for layer in layers.values() if not isinstance(layer.base, nn.Linear)]
    if quantized:
        raise AdapterError(f"cannot merge {name!r}: the model's weights are quantised ({quantized[0]}); adapters run "
                           "unmerged")
    holders = _weight_holders(model)
    for path, layer in layers.items():
        others = [p for p in holders[id(layer.base.weight)] if p != f"{path}.base.weight"]
        if others:  # a head tied to the embeddings: merging would change the embeddings too
            raise AdapterError(f"cannot merge {name!r}: {path}'s weight is also {others[0]} (tied); adapters on it "
                               "run unmerged")
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
