"""Checkpoints: a directory of config.json + model.safetensors + tokenizer.json (+ labels.json, metrics.json).

A checkpoint imported from Hugging Face (``python -m training import``) keeps that model's tokenizer and
settings files under ``hf/`` instead of tokenizer.json and labels.json; a Hugging Face model directory
itself loads too (model.hf).

No pickle anywhere: tensors go through safetensors, everything else is JSON. Writes are atomic
(a temporary sibling directory renamed into place; replacing an existing checkpoint moves it aside
to ``.<name>.old`` first, and a load finds it there if a crash fell between the two renames); loads
validate every file and tensor and name the culprit when something is missing, truncated or mismatched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from model.build import build_empty, load_into, resolve_device, resolve_dtype
from model.calibration import Calibration, CalibrationError
from model.config import ModelConfigError, TransformerConfig
from model.files import UnreadableFile, make_shareable, read_regular
from model.hf import hf_companions, is_hf_directory, load_hf_model
from model.hf.common import all_finite, read_safetensors
from model.hf.generation import GENERATION_FILE, GenerationRules, generation_rules
from model.hf.languages import Languages
from model.hf.sentence import EmbeddingDefaults
from model.lora_io import AdapterLayout
from model.placeholders import MAX_SENTINELS, sentinel
from model.quantize import model_mode
from model.tokenizer import Tokenizer, TokenizerError, file_limit
from model.vocab_map import (
    VMAP_FILE,
    VMAPS_DIR,
    AnyVocabularyMap,
    VocabularyMapError,
    load_language_maps,
    load_vocabulary_map,
)

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
SOURCE_TOKENIZER_FILE = "source_tokenizer.json"
LABELS_FILE = "labels.json"
HF_DIR = "hf"  # an imported checkpoint's Hugging Face companion files (tokenizer, generation config, ...)
METRICS_FILE = "metrics.json"
MAX_JSON_BYTES = 16 << 20  # config.json, labels.json, metrics.json: a few KB

logger = logging.getLogger(__name__)


# How each generative family's input text becomes token ids, as (add_bos, add_eos): causal_lm prompts are
# ``<s> text`` and seq2seq sources ``text </s>``, as training builds them. The service encodes with it and the
# Hugging Face export writes it as the tokenizer's template, so ``tokenizer(text)`` there feeds the same ids.
PROMPT_SPECIALS = {"causal_lm": (True, False), "seq2seq": (False, True)}


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or does not match its config."""


@dataclass
class Checkpoint:
    """A loaded model with everything stored beside it."""

    model: nn.Module
    config: TransformerConfig
    tokenizer: Tokenizer
    source_tokenizer: Tokenizer | None = None  # seq2seq with separate vocabularies
    labels: list[str] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    format: str = "tserve"  # "hf": a Hugging Face directory (model.hf), whose tokenizer brings its own template
    adapter_layout: AdapterLayout | None = None  # how PEFT adapters name its modules, when not as ours (HF)
    embedding: EmbeddingDefaults | None = None  # a sentence-transformers save's pooling and normalization
    generation: GenerationRules | None = None  # a generation_config.json's rules and defaults (model.hf.generation)
    calibration: Calibration | None = None  # a classifier's calibration.json (model.calibration)
    score_activation: str | None = None  # a CrossEncoder's (model.hf.sentence.score_activation)
    languages: Languages | None = None  # a multilingual translator's language codes (model.hf.languages)

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def src_tokenizer(self) -> Tokenizer:
        return self.source_tokenizer or self.tokenizer

    @property
    def prompt_tokenizer(self) -> Tokenizer:
        """The tokenizer of the model's input text: the source side of a seq2seq, else the only one."""
        return self.src_tokenizer if self.family == "seq2seq" else self.tokenizer

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of a generative model's input texts (:func:`encode_prompts`)."""
        return encode_prompts(self.prompt_tokenizer, self.family, texts)


def encode_prompts(tokenizer: Tokenizer, family: str, texts: Sequence[str]) -> list[list[int]]:
    """Input ids of a generative ``family``: wrapped as PROMPT_SPECIALS says by our tokenizers, by its own
    template by an imported one (what ``tokenizer(text)`` gives in `transformers`)."""
    if tokenizer.uses_own_template:
        return tokenizer.encode_templated(texts)
    add_bos, add_eos = PROMPT_SPECIALS[family]
    return tokenizer.encode_batch(texts, add_bos=add_bos, add_eos=add_eos)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Map each state-dict key that shares storage with an earlier key to that key (tied weights)."""
    first: dict[tuple[int, int, tuple[int, ...]], str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        # on the meta device (model.build.build_empty) there is no storage: a tie is one Parameter there
        where = (id(tensor), -1) if tensor.is_meta else (tensor.data_ptr(), tensor.storage_offset())
        key = (*where, tuple(tensor.shape))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    tokenizer: Tokenizer | None,
    *,
    source_tokenizer: Tokenizer | None = None,
    labels: list[str] | None = None,
    metrics: dict[str, Any] | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write the checkpoint directory atomically and return its path. ``tokenizer`` None: ``extra_files`` bring
    one (an imported checkpoint's ``hf/`` files); their names may hold subdirectories."""
    directory = Path(directory)
    quantized = model_mode(model)
    if quantized != "none":  # its layers keep their weights outside the state_dict, in their kernels' layouts
        raise CheckpointError(f"the model's linear layers are quantised ({quantized}): for inference only; save the "
                              "float model and quantise it when loading (the quantize setting)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        aliases = tied_aliases(model)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if k not in aliases}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format_version": str(FORMAT_VERSION)})
        config = {"format_version": FORMAT_VERSION, **model.config.to_dict()}
        _write_json(tmp / CONFIG_FILE, config)
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
        if source_tokenizer is not None:
            source_tokenizer.save(tmp / SOURCE_TOKENIZER_FILE)
        if labels is not None:
            _write_json(tmp / LABELS_FILE, labels)
        if metrics is not None:
            _write_json(tmp / METRICS_FILE, metrics)
        for name, data in (extra_files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        make_shareable(tmp)
        _fsync_dir(tmp)
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_config(directory: str | Path) -> TransformerConfig:
    """Read and validate ``config.json`` of a checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    data = _read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    version = data.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
    try:
        return TransformerConfig.from_dict(data)
    except ModelConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def load_checkpoint(
    directory: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype | None = None
) -> Checkpoint:
    """Load a checkpoint directory onto ``device`` ("auto": CUDA when available) in ``dtype``: ours, or a Hugging
    Face model directory (model.hf)."""
    directory = Path(directory)
    if not directory.is_dir():
        old = old_sibling(directory)
        if not old.is_dir():
            raise CheckpointError(f"{directory}: checkpoint directory not found")
        logger.warning("%s is missing: loading %s, which a save interrupted between its renames left", directory, old)
        directory = old
    if is_hf_directory(directory):
        return load_hf_checkpoint(directory, device, dtype)
    config = load_config(directory)
    model = build_empty(config)  # the tensors read become its parameters: the weights are held once
    load_weights(model, directory / WEIGHTS_FILE)
    _place(model, device, dtype)
    metrics = _read_json(directory / METRICS_FILE) if (directory / METRICS_FILE).exists() else {}
    if (directory / HF_DIR).is_dir():  # imported (python -m training import): its HF tokenizer and settings
        return Checkpoint(model, config, metrics=metrics, path=directory, **hf_companions(directory / HF_DIR, config))
    tokenizer = _load_tokenizer(directory / TOKENIZER_FILE, config.vocab_size)
    source_path = directory / SOURCE_TOKENIZER_FILE
    source_size = getattr(config, "src_vocab_size", None) or config.vocab_size
    source_tokenizer = _load_tokenizer(source_path, source_size) if source_path.exists() else None
    _check_vocab(directory / TOKENIZER_FILE, tokenizer, config.vocab_size)
    if source_tokenizer is not None:
        _check_vocab(source_path, source_tokenizer, source_size)
    labels = _read_json(directory / LABELS_FILE) if (directory / LABELS_FILE).exists() else None
    if config.family == "classifier" and not (isinstance(labels, list) and len(labels) == config.num_labels
                                              or labels is None and config.num_labels == 0):  # 0: an embedder
        raise CheckpointError(f"{directory / LABELS_FILE}: expected a list of {config.num_labels} label names")
    # A generation_config.json beside our own checkpoint is read as transformers reads one (model.hf.generation).
    generation = generation_rules(directory, config) if (directory / GENERATION_FILE).is_file() and \
        config.family != "classifier" else None
    try:
        calibration = Calibration.load(directory) if config.family == "classifier" else None
    except CalibrationError as exc:
        raise CheckpointError(str(exc)) from None
    return Checkpoint(model, config, tokenizer, source_tokenizer, labels, metrics, directory, generation=generation,
                      calibration=calibration)


def load_hf_checkpoint(
    directory: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype | None = None
) -> Checkpoint:
    """An HF directory as a Checkpoint (format "hf"): the model (model.hf) on ``device`` in ``dtype``, and what else
    the directory brings (:func:`model.hf.hf_companions`)."""
    directory = Path(directory)
    model, config = load_hf_model(directory)
    _place(model, device, dtype)
    return Checkpoint(model, config, path=directory, format="hf", **hf_companions(directory, config))


def _place(model: nn.Module, device: str | torch.device, dtype: str | torch.dtype | None) -> None:
    """Move ``model`` onto ``device`` ("auto": CUDA when available) in ``dtype``, for inference."""
    torch_device = resolve_device(device)
    try:
        torch_dtype = resolve_dtype(dtype, torch_device)
    except ValueError as exc:  # an unknown dtype name
        raise CheckpointError(str(exc)) from None
    model.to(device=torch_device, dtype=torch_dtype).eval()


def load_weights(model: nn.Module, path: Path) -> None:
    """Make the tensors of a safetensors file the weights of ``model`` (built by model.build.build_empty), checking
    names, shapes, dtypes and values."""
    if not path.is_file():
        raise CheckpointError(f"{path}: weights file not found")
    try:
        tensors = read_safetensors(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    aliases = tied_aliases(model)
    expected = {k: v for k, v in model.state_dict().items() if k not in aliases}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all)")
    for name, tensor in tensors.items():
        want = expected[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want.shape)}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, expected a floating dtype")
        if not all_finite(tensor):
            raise CheckpointError(f"{path}: tensor {name!r} contains NaN or infinite values")
    load_into(model, {**tensors, **{k: tensors[v] for k, v in aliases.items()}})


def parameter_count(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def checkpoint_vocabulary_map(checkpoint: Checkpoint) -> AnyVocabularyMap | None:
    """The vocabulary map of a seq2seq checkpoint (its directory's vmap.txt, in its vocabularies' tokens; a
    multilingual model's vmaps/<code>.txt, one per target language: model.vocab_map), or None without one. Every
    special token and placeholder sentinel (model.placeholders) of the target side is always a candidate; the
    source's own tokens are where the model shares one vocabulary. Raises VocabularyMapError."""
    if checkpoint.family != "seq2seq" or checkpoint.path is None:
        return None
    single, per_language = checkpoint.path / VMAP_FILE, checkpoint.path / VMAPS_DIR
    if not single.is_file() and not per_language.exists():
        return None
    if single.is_file() and per_language.exists():
        raise VocabularyMapError(f"{checkpoint.path}: holds both {VMAP_FILE} and {VMAPS_DIR}/; keep one (a "
                                 f"multilingual model: {VMAPS_DIR}/<code>.txt per target language)")
    target, config = checkpoint.tokenizer, checkpoint.config
    always = {i for i in (target.pad_id, target.bos_id, target.eos_id, target.unk_id, config.pad_id, config.bos_id,
                          config.eos_id) if i is not None}
    for n in range(MAX_SENTINELS):
        always.update(target.encode(sentinel(n)))
    lookups = (checkpoint.src_tokenizer.token_to_id, target.token_to_id)
    if per_language.exists():
        if checkpoint.languages is None or not per_language.is_dir():
            raise VocabularyMapError(f"{per_language}: maps per target language are for a multilingual model's "
                                     "directory (NLLB-200, M2M100, mBART-50); this model has no language codes")
        return load_language_maps(per_language, checkpoint.languages.ids, *lookups, always,
                                  copy_source=config.src_vocab_size is None)
    try:
        return load_vocabulary_map(single, *lookups, always, copy_source=config.src_vocab_size is None)
    except VocabularyMapError as exc:
        raise VocabularyMapError(f"{single}: {exc}") from None


def _load_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    try:
        return Tokenizer.load(path, file_limit(vocab_size))
    except TokenizerError as exc:
        raise CheckpointError(str(exc)) from exc


def _check_vocab(path: Path, tokenizer: Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary holds {vocab_size}"
        )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_regular(path, MAX_JSON_BYTES).decode("utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: file not found") from exc
    except UnreadableFile as exc:  # a FIFO, a device, too large: refused before a byte is read
        raise CheckpointError(f"{path}: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({str(exc)[:200]})") from exc


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")


def _fsync_dir(directory: Path) -> None:
    """Flush every file under ``directory`` (subdirectories included) to disk."""
    for p in directory.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def old_sibling(directory: Path) -> Path:
    """Where a save moves the checkpoint it replaces, until the new one is in place."""
    return directory.with_name(f".{directory.name}.old")


def _replace_dir(tmp: Path, target: Path) -> None:
    """Swap ``tmp`` into ``target``: the old directory is moved aside first, then removed.

    A directory cannot be renamed over a non-empty one, so there is a moment with no ``target``; a
    process killed then leaves the complete previous checkpoint at ``old_sibling(target)``, where
    :func:`load_checkpoint` looks, and the next save clears it.
    """
    old = old_sibling(target)
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)  # a leftover of a save killed after its second rename
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
    logger.debug("checkpoint written to %s", target)


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "load_checkpoint",
    "load_hf_checkpoint",
    "save_checkpoint",
    "load_config",
    "old_sibling",
    "parameter_count",
    "checkpoint_vocabulary_map",
]
