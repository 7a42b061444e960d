"""PEFT-layout adapter files: ``adapter_config.json`` + ``adapter_model.safetensors``.

Saving writes PEFT's keys (``base_model.model.<module path>.lora_{A,B}.weight``, and
``base_model.model.<head path>.{weight,bias}`` for an adapter's own head copies: ``modules_to_save``)
atomically, in the module names of the Hugging Face model ours was imported from when given its
:class:`AdapterLayout`; loading reads only those two files (never pickle) and validates every tensor against
the model's target Linears and heads before the model is touched (:func:`check_adapter` does only that).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from model.config import TransformerConfig
from model.files import make_shareable
from model.lora import (
    check_new_name,
    find_targets,
    get_adapter_config,
    head_copies,
    layers_with,
    public_path,
    wrap_heads,
    wrap_targets,
)
from model.lora_config import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE, AdapterError, LoRAConfig, quote
from model.lora_layers import HeadCopies, HeadModule, LoRALinear, plain_module
from model.quantize import QUANTIZED_LINEARS

logger = logging.getLogger(__name__)

PICKLE_FILE = "adapter_model.bin"
KEY_PREFIX = "base_model.model."
_KEY_RE = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
_COPY_RE = re.compile(r"base_model\.model\.(.+)\.(weight|bias)")  # a head copy's (modules_to_save), when not _KEY_RE
# a targeted lm_head's or embedding's own weight, which PEFT saves beside its LoRA (save_embedding_layers)
_BASE_LAYER_RE = re.compile(r"base_model\.model\.(.+)\.base_layer\.weight")
Copies = dict[str, tuple[torch.Tensor, torch.Tensor | None]]  # head path -> an adapter's copy: weight, bias
# An adapter's update scaling * B @ A may reach at most this many times its layer's largest weight. Trained
# adapters stay well under 10x (the test suite's deliberately overtrained ones: 2-3x); far beyond,
# activations leave float range and every output is NaN (lora_alpha 1e30 or 1e300 with r 4).
MAX_UPDATE_RATIO = 1e3


def lora_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name`'s tensors under PEFT's keys: base_model.model.<linear path>.lora_{A,B}.weight, and
    base_model.model.<head path>.{weight,bias} for its head copies."""
    out = {}
    for path, layer in layers_with(model, name).items():
        path = public_path(model, path)
        out[f"{KEY_PREFIX}{path}.lora_A.weight"] = layer.lora_A[name].weight.detach()
        out[f"{KEY_PREFIX}{path}.lora_B.weight"] = layer.lora_B[name].weight.detach()
    for path, heads in head_copies(model).items():
        if name in heads.copies:
            out |= {f"{KEY_PREFIX}{path}.{k}": t.detach() for k, t in heads.copies[name].named_parameters()}
    return out


def save_adapter(
    model: nn.Module,
    name: str,
    directory: str | os.PathLike,
    base_model_name_or_path: str | None = None,
    layout: AdapterLayout | None = None,
) -> None:
    """Write PEFT's layout into `directory`: built in a temp dir beside it, then renamed into place. With the
    `layout` of the Hugging Face model `model` was imported from: in that model's module names, as PEFT loads it
    there (:attr:`AdapterLayout.to_peft`)."""
    config = get_adapter_config(model, name)
    if base_model_name_or_path is not None:
        config = replace(config, base_model_name_or_path=base_model_name_or_path)
    peft_config, tensors = config.to_peft_dict(), {k: v.cpu() for k, v in lora_state_dict(model, name).items()}
    if layout is not None:
        peft_config, tensors = layout.to_peft(config, tensors, model.config)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        make_shareable(tmp)
        if target.exists():  # a directory cannot be renamed over a non-empty one: swap via a side name
            old = tmp.with_name(tmp.name + ".old")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved LoRA adapter %r to %s", name, target)


PeftFiles = tuple[dict[str, Any], dict[str, torch.Tensor]]  # adapter_config.json's contents, the tensors


@dataclass(frozen=True)
class AdapterLayout:
    """How PEFT adapters of an imported Hugging Face model name its modules: maps their adapter_config.json
    (``config``) and tensors (``tensors``, given the model's config for the shapes of fused modules; AdapterError for
    one it cannot map) onto our module names (model.hf's importers provide one). A loaded adapter's targets are the
    modules its mapped tensors name, so ``config`` only has to make the file parseable: :func:`peft_targets`.
    ``to_peft`` goes the other way: our adapter's config and tensors (on the model imported, whose config it is
    given) as PEFT's files for the HF model."""

    config: Callable[[dict[str, Any]], dict[str, Any]]
    tensors: Callable[[dict[str, torch.Tensor], TransformerConfig], dict[str, torch.Tensor]]
    to_peft: Callable[[LoRAConfig, dict[str, torch.Tensor], TransformerConfig], PeftFiles]


def peft_targets(d: dict[str, Any], names: Mapping[str, tuple[str, ...]], model: str) -> dict[str, Any]:
    """``d`` with target_modules as our module names: each PEFT target (a module name or a suffix of its path,
    as PEFT matches them) by the longest key of ``names`` it ends with; a regex string provisionally as all of
    them. ``model`` names the architecture in errors."""
    targets = d.get("target_modules")
    if isinstance(targets, str):
        return {**d, "target_modules": sorted({n for ours in names.values() for n in ours})}
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"target_modules must be a list of {model} module names or a regex, got {quote(targets)}")
    ours: set[str] = set()
    unknown = []
    for target in targets:
        suffixes = [k for k in names if target == k or target.endswith(f".{k}")]
        if suffixes:
            ours.update(names[max(suffixes, key=len)])
        else:
            unknown.append(target)
    if unknown:
        raise AdapterError(f"target_modules {quote(unknown)} are not {model} projections we adapt "
                           f"({', '.join(sorted(names))})")
    return {**d, "target_modules": sorted(ours)}


def peft_files(config: LoRAConfig, tensors: dict[str, torch.Tensor], task_type: str | None, **fields: Any
               ) -> PeftFiles:
    """PEFT's files of an adapter whose ``tensors`` name a Hugging Face model's modules: target_modules are the
    full paths of those modules (PEFT then adapts no other module, whatever their names share), task_type and
    ``fields`` override ``config``'s."""
    modules = sorted({match[1] for key in tensors if (match := _KEY_RE.fullmatch(key))})
    return {**config.to_peft_dict(), "task_type": task_type, "target_modules": modules, **fields}, tensors


def unmapped_tensor(key: str, model: str, names: Iterable[str]) -> AdapterError:
    """The error of an AdapterLayout's ``tensors`` for a tensor of no ``model`` projection in ``names``."""
    return AdapterError(f"tensor {quote(key)} is not a LoRA tensor of a {model} projection we adapt "
                        f"({', '.join(sorted(names))})")


def read_config(directory: str | os.PathLike, name: str, layout: AdapterLayout | None = None) -> LoRAConfig:
    """``directory``'s adapter_config.json, parsed within model.lora_config's size and depth limits."""
    path = Path(directory) / CONFIG_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise AdapterError(f"adapter {name!r}: cannot read {path}: {e}") from e
    try:
        return LoRAConfig.from_json(raw, source=str(path), rename=layout.config if layout is not None else None)
    except AdapterError as e:
        raise AdapterError(f"adapter {name!r}: {e}") from None


def _read_tensors(path: Path, name: str, device: str | torch.device | None) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(device or "cpu"))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterError(f"adapter {name!r}: {path} is not a readable safetensors file: {e}") from e


def _validate(
    where: str, config: LoRAConfig, found: dict[str, nn.Module], tensors: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Check loaded tensors against the model's target Linears; returns module path -> (A, B)."""
    if not found:
        raise AdapterError(f"{where}: the model has no nn.Linear named any of {quote(list(config.target_modules))}")
    for key in tensors:
        match = _KEY_RE.fullmatch(key)
        if match is None:
            raise AdapterError(f"{where}: unexpected tensor {quote(key)}; expected "
                               f"{KEY_PREFIX}<module>.lora_A/B.weight")
        if match[1] not in found:
            raise AdapterError(f"{where}: tensor {quote(key)} names module {quote(match[1])}, not a target "
                               f"nn.Linear of this model (targets: {quote(list(config.target_modules))})")
    weights = {}
    for path, module in found.items():
        base = module.base if isinstance(module, LoRALinear) else module
        expected = {"A": (config.r, base.in_features), "B": (base.out_features, config.r)}
        pair = []
        for kind, shape in expected.items():
            key = f"{KEY_PREFIX}{path}.lora_{kind}.weight"
            t = tensors.get(key)
            if t is None:
                raise AdapterError(f"{where}: missing tensor {key!r}")
            if tuple(t.shape) != shape:
                raise AdapterError(f"{where}: tensor {key!r} has shape {tuple(t.shape)}, expected {shape} "
                                   f"(r={config.r}, base in={base.in_features}, out={base.out_features})")
            if not t.is_floating_point():
                raise AdapterError(f"{where}: tensor {key!r} has dtype {t.dtype}, expected a floating dtype")
            if not torch.isfinite(t).all():
                raise AdapterError(f"{where}: tensor {key!r} has non-finite values")
            pair.append(t)
        _check_update(where, path, config, base, pair[0], pair[1])
        weights[path] = (pair[0], pair[1])
    return weights


def _validate_copies(where: str, config: LoRAConfig, model: nn.Module, tensors: dict[str, torch.Tensor]) -> Copies:
    """Check the head copies' tensors (``tensors``: the keys of no LoRA tensor) against the model's heads named in
    modules_to_save; returns head path -> (weight, bias). A copy may lack the bias of a head whose bias is zero (a
    Hugging Face head without one, which ours holds as zeros): its copy has none either, the same outputs."""
    heads = {}
    for path, module in model.named_modules():
        parent, _, leaf = path.rpartition(".")
        # not a wrapper's base, nor an adapter's copy or LoRA matrix (kept in ModuleDicts by adapter name)
        inner = isinstance(model.get_submodule(parent), HeadCopies | LoRALinear | nn.ModuleDict)
        # a head another adapter's LoRA wraps, or one quantised (its copies stay float), too
        if leaf in (config.modules_to_save or ()) and not inner and isinstance(
                module, (HeadModule, HeadCopies, LoRALinear, *QUANTIZED_LINEARS)):
            heads[path] = plain_module(module)
    for key in tensors:
        match = _COPY_RE.fullmatch(key)
        if match is None or match[1] not in heads:
            raise AdapterError(f"{where}: unexpected tensor {quote(key)}; expected {KEY_PREFIX}<module>.lora_A/B."
                               f"weight or a head copy's weight/bias of modules_to_save {quote(list(heads))}")
    copies = {}
    for path, head in heads.items():
        bias = getattr(head, "bias", None)  # an nn.Embedding has none
        shapes = {"weight": tuple(head.weight.shape), "bias": None if bias is None else tuple(bias.shape)}
        pair = []
        for kind, shape in shapes.items():
            key = f"{KEY_PREFIX}{path}.{kind}"
            t = tensors.get(key)
            if shape is None:
                if t is not None:
                    raise AdapterError(f"{where}: unexpected tensor {key!r}: the model's {path!r} has no bias")
            elif t is None and kind == "bias" and not bias.detach().any():
                pass  # a copy without a bias (see above)
            elif t is None:
                raise AdapterError(f"{where}: missing tensor {key!r} (modules_to_save {quote(config.modules_to_save)})")
            elif tuple(t.shape) != shape or not t.is_floating_point() or not torch.isfinite(t).all():
                raise AdapterError(f"{where}: tensor {key!r} must be finite floats of shape {shape}, got "
                                   f"{t.dtype} {tuple(t.shape)}")
            pair.append(t)
        copies[path] = (pair[0], pair[1])
    return copies


def _check_update(where: str, path: str, config: LoRAConfig, base: nn.Module, a: torch.Tensor, b: torch.Tensor
                  ) -> None:
    """Refuse an update scaling * B @ A out of all proportion to the layer's weights (lora_alpha 1e300: NaN outputs)."""
    peak = float((b.float() @ a.float()).abs().max()) * config.scaling  # a Python float: inf, not an overflow
    base_peak = float(base.weight.detach().float().abs().max())
    if not peak <= MAX_UPDATE_RATIO * base_peak:  # also refuses inf and NaN
        raise AdapterError(f"{where}: lora_alpha / r = {config.scaling:.3g} makes the update of {path!r} reach "
                           f"{peak:.3g}, over {MAX_UPDATE_RATIO:g} times the layer's largest weight ({base_peak:.3g})")


def _without_base_layers(where: str, model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` less the base weights PEFT saves beside a LoRA on an lm_head or embedding layer: taken when they are
    the model's own (a base with another vocabulary or other weights is refused by name)."""
    kept = {}
    for key, t in tensors.items():
        match = _BASE_LAYER_RE.fullmatch(key)
        if match is None:
            kept[key] = t
            continue
        try:
            module = model.get_submodule(match[1])
        except AttributeError:
            raise AdapterError(f"{where}: tensor {quote(key)} names module {quote(match[1])}, not one of this model") \
                from None
        base = plain_module(module)
        weight = getattr(base, "weight", None)  # an int8 base's is dequantised: its shape is checked, not its values
        same = weight is not None and tuple(t.shape) == tuple(weight.shape) and (
            not isinstance(base, nn.Linear | nn.Embedding) or torch.equal(t.to(weight.device, weight.dtype), weight))
        if not same:
            raise AdapterError(f"{where}: tensor {quote(key)} holds weights of {quote(match[1])} other than the "
                               "model's (an adapter saved on another base or a resized vocabulary): not supported")
    return kept


def _read(
    model: nn.Module, directory: Path, name: str, device: str | torch.device | None, layout: AdapterLayout | None
) -> tuple[LoRAConfig, dict[str, nn.Module], dict[str, tuple[torch.Tensor, torch.Tensor]], Copies]:
    """Config, target modules, validated (A, B) per module path and head copies; reads the model, changes nothing."""
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        if (directory / PICKLE_FILE).exists():
            raise AdapterError(f"adapter {name!r}: {directory} has only {PICKLE_FILE}; pickle files are not "
                               f"loaded, convert it to {WEIGHTS_FILE}")
        raise AdapterError(f"adapter {name!r}: {weights_path} not found")
    where = f"adapter {name!r} ({weights_path})"
    config = read_config(directory, name, layout)
    tensors = _read_tensors(weights_path, name, device)
    adapted: set[str] = set()  # with a layout: the module paths its mapped tensors name
    if layout is not None:
        try:
            tensors = layout.tensors(tensors, model.config)
        except AdapterError as e:
            raise AdapterError(f"{where}: {e}") from None
        adapted = {match[1] for key in tensors if (match := _KEY_RE.fullmatch(key))}
    tensors = _without_base_layers(where, model, tensors)
    if adapted:  # PEFT's target names and regexes may match some of our modules of a name only
        config = replace(config, target_modules=tuple(sorted({path.rpartition(".")[2] for path in adapted})))
    found = find_targets(model, config.target_modules)
    if adapted:
        found = {path: module for path, module in found.items() if path in adapted}
    copies: Copies = {}
    if config.modules_to_save:
        copies = _validate_copies(where, config, model, {k: t for k, t in tensors.items() if not _KEY_RE.fullmatch(k)})
        tensors = {k: t for k, t in tensors.items() if _KEY_RE.fullmatch(k)}
    return config, found, _validate(where, config, found, tensors), copies


def check_adapter(
    model: nn.Module, directory: str | os.PathLike, name: str, layout: AdapterLayout | None = None
) -> LoRAConfig:
    """Everything :func:`load_adapter` checks of ``directory``'s files, without changing the model."""
    return _read(model, Path(directory), name, None, layout)[0]


def load_adapter(
    model: nn.Module,
    directory: str | os.PathLike,
    name: str,
    device: str | torch.device | None = None,
    layout: AdapterLayout | None = None,
) -> LoRAConfig:
    """Load a PEFT-layout adapter as `name`, fully validated before the model is touched.

    Only adapter_config.json and adapter_model.safetensors are read (never pickle). `device` is where
    the file is read to (default CPU); the adapter then lives on each base layer's device and dtype.
    `layout` maps an adapter trained on a Hugging Face model onto our module names.
    """
    check_new_name(model, name)
    directory = Path(directory)
    config, found, weights, copies = _read(model, directory, name, device, layout)
    layers = wrap_targets(model, found)
    for path, (a, b) in weights.items():
        layers[path].add(name, config, a, b)
    heads = wrap_heads(model, {path: model.get_submodule(path) for path in copies})
    for path, (weight, bias) in copies.items():
        heads[path].add(name, weight, bias)
    logger.info("loaded LoRA adapter %r (r=%d) from %s", name, config.r, directory)
    return config
