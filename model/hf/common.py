"""What every Hugging Face importer shares: the error, reading config.json and the weights, config checks.

Only ``config.json`` and ``*.safetensors`` are read: pickle weights (``.bin``, ``.pt``, ``.pth``) are never
unpickled; the error names the file and says to convert it. A config field we cannot express is refused
with its name, before any tensor is read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from model.files import UnreadableFile, read_regular

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded weights: {"weight_map": {tensor: shard file}}
MAX_INDEX_BYTES = 1 << 24
PICKLE_WEIGHTS = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth")
MAX_CONFIG_BYTES = 1 << 20  # HF configs are a few KB
# HF activation names (transformers' ACT2FN) that our ACTIVATIONS compute exactly.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "silu": "silu", "swish": "silu"}

Tensors = dict[str, torch.Tensor]


class HFImportError(ValueError):
    """A Hugging Face directory cannot be loaded exactly; the message names the file or config field."""


@dataclass(frozen=True)
class Unsupported:
    """A config field whose value changes the math in a way our families do not express."""

    field: str
    allowed: tuple[Any, ...]  # values that are fine (the field missing counts as its HF default, the first)
    meaning: str


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of ``directory`` as a dict (bounded size)."""
    return read_json(directory / CONFIG_FILE, MAX_CONFIG_BYTES)


def read_bytes(path: Path, limit: int, hint: str = "") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (model.files.read_regular; HFImportError
    naming the file, ``hint`` saying what to do when it cannot be read)."""
    try:
        return read_regular(path, limit)
    except UnreadableFile as exc:  # a FIFO, a device, too large: refused before a byte is read
        raise HFImportError(f"{path.name}: {exc}") from None
    except OSError as exc:
        raise HFImportError(f"{path.name}: cannot read it ({exc.strerror or exc}){'; ' + hint if hint else ''}") \
            from None


def read_json(path: Path, limit: int, kind: type = dict, hint: str = "") -> Any:
    """The JSON value of ``path`` (at most ``limit`` bytes), which must be a ``kind``."""
    raw = read_bytes(path, limit, hint)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise HFImportError(f"{path.name}: not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(value, kind):
        raise HFImportError(f"{path.name}: expected a JSON {'object' if kind is dict else kind.__name__}")
    return value


def check_supported(config: Mapping[str, Any], rules: tuple[Unsupported, ...], architecture: str) -> None:
    """Raise HFImportError naming the first field of ``config`` outside its allowed values."""
    for rule in rules:
        value = config.get(rule.field, rule.allowed[0])
        if value not in rule.allowed:
            raise HFImportError(f"{CONFIG_FILE}: {rule.field}={value!r} is not supported for {architecture} "
                                f"({rule.meaning}; supported: {list(rule.allowed)})")


def field(config: Mapping[str, Any], name: str, kind: type | tuple[type, ...] = int, default: Any = ...) -> Any:
    """``config[name]``, checked to be a ``kind`` (bools are not ints); ``default`` when it is missing."""
    if name not in config or config[name] is None:
        if default is ...:
            raise HFImportError(f"{CONFIG_FILE}: the field {name!r} is missing")
        return default
    value = config[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise HFImportError(f"{CONFIG_FILE}: {name}={value!r} has the wrong type")
    return value


def token_id_field(config: Mapping[str, Any], name: str, vocab: int, default: int) -> int:
    """``config[name]``, a token id of a vocabulary of ``vocab`` (a list's first: our configs keep one end id);
    ``default`` when it is missing or null."""
    value = config.get(name)
    if isinstance(value, list):
        value = value[0] if value else None
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise HFImportError(f"{CONFIG_FILE}: {name}={value!r} is outside the vocabulary (vocab_size={vocab})")
    return value


def activation(config: Mapping[str, Any], name: str, default: str) -> str:
    """Our activation for HF's ``config[name]``."""
    value = field(config, name, str, default)
    if value not in ACTIVATIONS:
        raise HFImportError(f"{CONFIG_FILE}: {name}={value!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[value]


def read_weights(directory: Path) -> Tensors:
    """Every tensor of ``directory``'s model.safetensors, or of the shards its index names (pickle files are
    refused, never opened)."""
    if (directory / WEIGHTS_INDEX).is_file() and not (directory / WEIGHTS_FILE).is_file():
        return _read_shards(directory)
    path = directory / WEIGHTS_FILE
    if path.exists() and not path.is_file():  # a FIFO would block the reader: refused by name
        raise HFImportError(f"{WEIGHTS_FILE}: not a regular file")
    if not path.is_file():
        pickled = [name for name in PICKLE_WEIGHTS if (directory / name).exists()]
        if pickled:
            raise HFImportError(f"{pickled[0]}: pickle weights are not loaded; convert them to {WEIGHTS_FILE} "
                                "(e.g. save_pretrained(..., safe_serialization=True))")
        raise HFImportError(f"{WEIGHTS_FILE}: not found")
    return _read_safetensors(path)


# safetensors' dtype names -> torch's (those a model's tensors come in)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def read_safetensors(path: Path) -> Tensors:
    """Every tensor of the safetensors file ``path``, each read into memory of its own (raises what safetensors
    raises for a malformed file: SafetensorError, OSError, ValueError).

    Not mapped, as safetensors' load_file maps the file: the file's pages touched stay in the resident set beside
    the model as long as one tensor of the file lives (and it would keep the whole file's then, with 2x the weights
    resident once a model re-lays or converts some), a file rewritten in place would change a served model's
    weights or kill it (SIGBUS). Read with readinto, the peak is the tensors themselves, once.
    """
    with safe_open(str(path), framework="pt"):  # safetensors checks the header: offsets, shapes, dtypes
        pass
    tensors: Tensors = {}
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{name!r} has dtype {entry['dtype']}, which is not read "
                                 f"(read: {sorted(SAFETENSORS_DTYPES)})")
            begin, end = entry["data_offsets"]
            tensor = torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
            f.seek(8 + size + begin)
            if f.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != end - begin:
                raise ValueError(f"{name!r}: the file ends inside its data")
            tensors[name] = tensor
    return tensors


def _read_safetensors(path: Path) -> Tensors:
    try:
        return read_safetensors(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise HFImportError(f"{path.name}: not a readable safetensors file: {str(exc)[:200]}") from None


def _read_shards(directory: Path) -> Tensors:
    """The tensors of the shards model.safetensors.index.json maps them to: files of this directory only, each
    tensor in the shard the index names."""
    weight_map = read_json(directory / WEIGHTS_INDEX, MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFImportError(f"{WEIGHTS_INDEX}: weight_map must map tensor names to shard files")
    tensors: Tensors = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or not shard.endswith(".safetensors") or not (directory / shard).is_file():
            raise HFImportError(f"{WEIGHTS_INDEX}: shard {shard[:80]!r} is not a .safetensors file of this directory")
        for name, tensor in _read_safetensors(directory / shard).items():
            if weight_map.get(name) != shard:
                raise HFImportError(f"{shard}: holds {name[:80]!r}, which {WEIGHTS_INDEX} places elsewhere")
            tensors[name] = tensor
    missing = weight_map.keys() - tensors.keys()
    if missing:
        raise HFImportError(f"{WEIGHTS_INDEX}: {len(missing)} tensors are in no shard, e.g. {min(missing)[:80]!r}")
    return tensors


def take(tensors: Tensors, name: str, shape: tuple[int, ...], minus_inf: bool = False) -> torch.Tensor:
    """``tensors[name]`` as float, checked to have ``shape`` and finite values (``minus_inf``: or -inf, as a
    logit bias that rules a token out)."""
    t = tensors.get(name)
    if t is None:
        raise HFImportError(f"{WEIGHTS_FILE}: the tensor {name!r} is missing")
    if tuple(t.shape) != shape:
        raise HFImportError(f"{WEIGHTS_FILE}: {name!r} has shape {tuple(t.shape)}, expected {shape}")
    if not t.is_floating_point():
        raise HFImportError(f"{WEIGHTS_FILE}: {name!r} has dtype {t.dtype}, expected a floating dtype")
    if not all_finite(t, minus_inf):
        raise HFImportError(f"{WEIGHTS_FILE}: {name!r} has NaN or {'+' if minus_inf else ''}infinite values")
    return t


def all_finite(t: torch.Tensor, minus_inf: bool = False) -> bool:
    """Whether every value of the float tensor ``t`` is finite (``minus_inf``: or -inf), with no temporary of its
    size (a model's largest tensor would need one): its min and max carry any NaN (both are NaN) or infinity."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(high) and (torch.isfinite(low) or (minus_inf and torch.isneginf(low))))


def strip_prefix(tensors: Tensors, prefix: str) -> Tensors:
    """``tensors`` with ``prefix`` removed from the names that have it (a base model saved alone has none)."""
    return {k.removeprefix(prefix): v for k, v in tensors.items()}
