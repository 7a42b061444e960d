"""Resume state: the last training state, kept beside the best checkpoint, without pickle.

Layout of a state directory (``<out>.state/`` next to the checkpoint directory ``<out>/``)::

    LATEST                      name of the newest complete step directory (replaced atomically)
    step-00000200/
        trainable.safetensors   the parameters being trained (all, or only a LoRA adapter's A and B)
        optimizer.safetensors   optimizer state tensors, keys "<param index>.<name>" (Adam: step,
                                exp_avg, exp_avg_sq)
        state.json              step, data position, tokens, elapsed time, best validation result,
                                LR schedule, optimizer param groups, every rank's RNG states
        <setup files>           what the command needs to rebuild the model (config.json, tokenizer.json, ...)

A step directory is written under a temporary name and renamed into place; LATEST is replaced
next; older step directories are deleted last. A run killed at any point (SIGKILL mid-save
included) leaves LATEST naming a complete directory, and stray temporaries are ignored.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from training.errors import UserError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST = "LATEST"
STATE_FILE = "state.json"
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


class StateError(UserError):
    """A resume state is missing, unreadable, or does not match the model being trained."""


@dataclass
class TrainState:
    """One saved step: tensors plus the JSON metadata."""

    directory: Path
    meta: dict[str, Any]
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]

    def file(self, name: str) -> Path:
        return self.directory / name


def state_dir_for(out: Path) -> Path:
    """``<out>.state`` beside the checkpoint directory ``out``."""
    return out.with_name(out.name + ".state")


def write_json(path: Path, data: Any) -> None:
    """Write JSON via a temporary file and a rename."""
    write_bytes_atomic(path, (json.dumps(data, indent=2, allow_nan=False) + "\n").encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class StateStore:
    """The step directories and LATEST pointer of one state directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def latest(self) -> Path | None:
        pointer = self.directory / LATEST
        if not pointer.is_file():
            return None
        step_dir = self.directory / pointer.read_text(encoding="utf-8").strip()
        if not (step_dir / STATE_FILE).is_file():
            raise StateError(f"{pointer} names {step_dir.name}, which is missing or incomplete")
        return step_dir

    def save(
        self,
        step: int,
        *,
        trainable: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        meta: dict[str, Any],
        files: dict[str, bytes],
    ) -> Path:
        """Write step ``step`` and make it the latest; returns its directory."""
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.directory))
        try:
            save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, str(tmp / TRAINABLE_FILE))
            save_file({k: v.detach().cpu().contiguous() for k, v in optimizer.items()}, str(tmp / OPTIMIZER_FILE))
            for file_name, data in files.items():  # names may hold subdirectories (an HF model's hf/)
                (tmp / file_name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / file_name).write_bytes(data)
            (tmp / STATE_FILE).write_text(
                json.dumps({"format_version": FORMAT_VERSION, "step": step, **meta}, indent=2, allow_nan=False)
            )
            for p in (p for p in tmp.rglob("*") if p.is_file()):
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            target = self.directory / name
            shutil.rmtree(target, ignore_errors=True)  # a leftover from a run that died after the rename
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_bytes_atomic(self.directory / LATEST, f"{name}\n".encode())
        for old in self.directory.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.directory.glob(".step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        logger.debug("saved training state %s", target)
        return target

    def load(self) -> TrainState | None:
        """The latest complete state, or None when there is none."""
        step_dir = self.latest()
        if step_dir is None:
            return None
        path = step_dir / STATE_FILE
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
            trainable = load_file(str(step_dir / TRAINABLE_FILE))
            optimizer = load_file(str(step_dir / OPTIMIZER_FILE))
        except (OSError, ValueError, SafetensorError) as e:
            raise StateError(f"{step_dir}: unreadable training state ({e})") from e
        if meta.get("format_version") != FORMAT_VERSION:
            raise StateError(f"{path}: format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}")
        return TrainState(step_dir, meta, trainable, optimizer)


# ---- parameters -----------------------------------------------------------------------------------


def trainable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that receive gradients, by name (tied parameters once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable(model: nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Copy saved trainable tensors into ``model``; names and shapes must match exactly."""
    params = trainable_tensors(model)
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise StateError(f"{where}: saved parameters do not match the model (missing {missing[:3]}, extra {extra[:3]})")
    for name, p in params.items():
        if p.shape != tensors[name].shape:
            raise StateError(f"{where}: {name} has shape {tuple(tensors[name].shape)}, expected {tuple(p.shape)}")
        p.copy_(tensors[name])


# ---- optimizer ------------------------------------------------------------------------------------


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (for safetensors) and JSON-able metadata."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, fields in sd["state"].items():
        for key, value in fields.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def restore_optimizer(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any], where: Path
) -> None:
    """Load what :func:`optimizer_state` saved into ``optimizer`` (same parameter layout required)."""
    current = optimizer.state_dict()["param_groups"]
    saved = meta["param_groups"]
    if [g["params"] for g in saved] != [g["params"] for g in current]:
        raise StateError(f"{where}: optimizer parameter groups do not match the model being trained")
    groups = [
        {k: tuple(v) if isinstance(cur.get(k), tuple) else v for k, v in g.items()}
        for g, cur in zip(saved, current, strict=True)
    ]
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = tensor
    for index, fields in meta["scalars"].items():
        state.setdefault(int(index), {}).update(fields)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---- random number generators --------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """torch (CPU and CUDA), Python ``random`` and NumPy global RNG states as JSON-able values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
