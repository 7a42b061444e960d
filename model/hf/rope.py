"""An HF config's rotary fields -> our config's (``rope_theta``, ``rope_scaling``, ``rotary_dim``), for every importer.

Read as transformers 5 standardizes them: ``rope_scaling`` (older files) or else ``rope_parameters``; the type
from ``rope_type`` (or the older ``type``); ``rope_theta`` and ``partial_rotary_factor`` from that dict, else the
top level, else the defaults; ``original_max_position_embeddings`` for llama3 / yarn / longrope from the top level
(Phi-3 keeps it there), else the dict, else ``max_position_embeddings``; a yarn or longrope ``factor`` left out
is ``max_position_embeddings / original_max_position_embeddings``. Keys a type does not read are ignored, as
transformers ignores them; a type we do not compute (model.rope.ROPE_TYPES) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.hf.common import CONFIG_FILE, HFImportError, field
from model.rope import ROPE_TYPES, SCALING_KEYS, check_scaling


def rope_fields(hf: Mapping[str, Any], head_dim: int, *, layer_type: str | None = None,
                default_theta: float = 10000.0, default_max_positions: int = 2048,
                aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Our config's rope keyword arguments for ``hf`` (config.json) with heads of ``head_dim``.

    ``layer_type`` picks one entry of rope_parameters given per layer type (Gemma 3's "sliding_attention");
    ``aliases`` renames legacy types (Phi-3's "su" / "yarn" mean longrope). HFImportError names what we cannot
    compute.
    """
    params = _parameters(hf, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = (aliases or {}).get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise HFImportError(f"{CONFIG_FILE}: rope type {rope_type!r} is not supported (supported: {list(ROPE_TYPES)})")
    theta = params.get("rope_theta", field(hf, "rope_theta", (int, float), default_theta))
    partial = params.get("partial_rotary_factor", field(hf, "partial_rotary_factor", (int, float), 1.0))
    if not _number(theta) or theta <= 0 or not _number(partial) or not 0 < partial <= 1:
        raise HFImportError(f"{CONFIG_FILE}: rope_theta={theta!r} / partial_rotary_factor={partial!r} must be "
                            "positive numbers (the factor at most 1)")
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2:
        raise HFImportError(f"{CONFIG_FILE}: partial_rotary_factor={partial!r} gives an odd rotary width "
                            f"({rotary_dim} of head_dim {head_dim}), which is not supported")
    scaling = _scaling(rope_type, params, hf, field(hf, "max_position_embeddings", default=default_max_positions))
    try:
        check_scaling(scaling, rotary_dim)
    except ValueError as exc:
        raise HFImportError(f"{CONFIG_FILE}: rope_parameters {exc}") from None
    return {"rope_theta": float(theta), "rope_scaling": scaling,
            "rotary_dim": None if rotary_dim == head_dim else rotary_dim}


def max_length(hf: Mapping[str, Any], default: int = 2048) -> int:
    """The longest sequence to serve: max_position_embeddings, times the factor under dynamic scaling (there it is
    the original length the frequencies grow from, and transformers sets no limit)."""
    length = field(hf, "max_position_embeddings", default=default)
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or params.get("rope_type", params.get("type")) != "dynamic":
        return length
    factor = params.get("factor")
    return int(length * factor) if _number(factor) and factor > 1 else length


def _parameters(hf: Mapping[str, Any], layer_type: str | None) -> Mapping[str, Any]:
    """The rope dict that applies: rope_scaling over rope_parameters (as transformers), one layer type's entry."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise HFImportError(f"{CONFIG_FILE}: rope_parameters / rope_scaling must be an object")
    if layer_type is not None and layer_type in params:
        params = params[layer_type] or {}
        if not isinstance(params, Mapping):
            raise HFImportError(f"{CONFIG_FILE}: rope_parameters[{layer_type!r}] must be an object")
    nested = sorted(k for k, v in params.items() if isinstance(v, Mapping))
    if nested:
        raise HFImportError(f"{CONFIG_FILE}: rope_parameters per layer type ({nested}) are not supported here")
    return params


def _scaling(rope_type: str, params: Mapping[str, Any], hf: Mapping[str, Any], max_positions: int
             ) -> dict[str, Any] | None:
    """Our rope_scaling dict: the keys ``rope_type`` reads, defaults resolved where they need the HF config."""
    if rope_type == "default":
        return None
    required, optional = SCALING_KEYS[rope_type]
    scaling: dict[str, Any] = {"rope_type": rope_type}
    if rope_type == "dynamic":  # grows past max_position_embeddings, transformers' "original" for dynamic
        scaling["original_max_position_embeddings"] = max_positions
    elif "original_max_position_embeddings" in required:
        scaling["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings", params.get("original_max_position_embeddings", max_positions))
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        original = scaling["original_max_position_embeddings"]
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise HFImportError(f"{CONFIG_FILE}: original_max_position_embeddings={original!r} must be a positive "
                                "integer")
        scaling["factor"] = max_positions / original
    for key in (*required, *optional):
        if key not in scaling and params.get(key) is not None:
            scaling[key] = params[key]
    missing = [key for key in required if key not in scaling]
    if missing:
        raise HFImportError(f"{CONFIG_FILE}: rope type {rope_type!r} needs {missing} in rope_parameters")
    return scaling


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
