"""sentence-transformers' modules.json: which pooling an embedding model uses, and whether it normalizes.

A directory saved by sentence-transformers holds the Transformer at its root, ``modules.json`` listing the
modules in order, and ``1_Pooling/config.json`` naming the pooling (cls, mean or max here), then optionally
a Normalize module (unit-length vectors). Modules that change the vectors otherwise (Dense, weighted-mean or
last-token pooling) are refused by name. A CrossEncoder (one-label head) names the activation its scores go
through in config.json (:func:`score_activation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.hf.common import HFImportError, read_json

MODULES_FILE = "modules.json"
MAX_FILE_BYTES = 1 << 16
TRANSFORMER, POOLING, NORMALIZE = (f"sentence_transformers.models.{m}" for m in ("Transformer", "Pooling", "Normalize"))
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max"}
UNSUPPORTED_MODES = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                     "pooling_mode_lasttoken")
# A CrossEncoder's activation as config.json names it (a torch class path) -> ours (service.engine.rerank applies it)
SCORE_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.Sigmoid": "sigmoid",
                     "torch.nn.modules.linear.Identity": "identity", "torch.nn.Identity": "identity",
                     "torch.nn.modules.activation.Tanh": "tanh", "torch.nn.Tanh": "tanh"}


@dataclass(frozen=True)
class EmbeddingDefaults:
    """How an embedding model's vectors are made when a request does not say."""

    pooling: str = "mean"  # model.classifier.POOLINGS
    normalize: bool = False  # unit length (sentence-transformers' Normalize module)


def embedding_defaults(directory: Path) -> EmbeddingDefaults | None:
    """The defaults ``directory``'s modules.json names; None when it has none (not a sentence-transformers save)."""
    if not (directory / MODULES_FILE).is_file():
        return None
    modules = read_json(directory / MODULES_FILE, MAX_FILE_BYTES, list)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise HFImportError(f"{MODULES_FILE}: expected a list of modules")
    pooling, normalize = "mean", False
    for module in modules:
        kind = module.get("type")
        if kind == POOLING:
            pooling = _pooling(directory, module.get("path"))
        elif kind == NORMALIZE:
            normalize = True
        elif kind != TRANSFORMER:
            raise HFImportError(f"{MODULES_FILE}: module {str(kind)[:80]!r} is not supported (only Transformer, "
                                "Pooling and Normalize)")
    return EmbeddingDefaults(pooling, normalize)


def sentence_files(directory: Path) -> list[str]:
    """The files :func:`embedding_defaults` reads in ``directory`` (relative names; none without modules.json)."""
    if not (directory / MODULES_FILE).is_file():
        return []
    modules = read_json(directory / MODULES_FILE, MAX_FILE_BYTES, list)
    pooling = [m.get("path") for m in modules if isinstance(m, dict) and m.get("type") == POOLING] \
        if isinstance(modules, list) else []
    inside = [p for p in pooling if isinstance(p, str) and p and not Path(p).is_absolute()
              and ".." not in Path(p).parts]
    return [MODULES_FILE, *(f"{path}/config.json" for path in inside)]


def _pooling(directory: Path, path: Any) -> str:
    if not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts:
        raise HFImportError(f"{MODULES_FILE}: the Pooling module's path {str(path)[:80]!r} must lie in the directory")
    config = read_json(directory / path / "config.json", MAX_FILE_BYTES)
    used = [mode for mode in UNSUPPORTED_MODES if config.get(mode)]
    if used:
        raise HFImportError(f"{path}/config.json: {used[0]} is not supported (cls, mean or max pooling)")
    chosen = [pooling for mode, pooling in POOLING_MODES.items() if config.get(mode)]
    if len(chosen) != 1:
        raise HFImportError(f"{path}/config.json: expected exactly one of {sorted(POOLING_MODES)}, got {chosen}")
    return chosen[0]


def score_activation(hf: Mapping[str, Any]) -> str | None:
    """The activation a CrossEncoder saved in config.json applies to its scores
    (``sentence_transformers.activation_fn``; before sentence-transformers 4 ``sbert_ce_default_activation_function``):
    "sigmoid", "identity" or "tanh"; None when it names none, or a class outside torch, which CrossEncoder too
    ignores without trust_remote_code (its default then: sigmoid for one label). Another torch class is refused."""
    saved = hf.get("sentence_transformers")
    path = saved.get("activation_fn") if isinstance(saved, dict) else None
    path = path if path is not None else hf.get("sbert_ce_default_activation_function")
    if path is None or (isinstance(path, str) and not path.startswith("torch.")):
        return None
    if not isinstance(path, str) or path not in SCORE_ACTIVATIONS:
        raise HFImportError(f"config.json: the CrossEncoder activation {str(path)[:80]!r} is not supported "
                            f"(supported: torch.nn's Sigmoid, Identity, Tanh)")
    return SCORE_ACTIVATIONS[path]
