"""What `train` and `lora` share: the output layout, seeding, and running one phase of training.

Output layout for ``--out DIR``::

    DIR/          the best checkpoint by validation metric (what the service serves), with
                  metrics.json, and copies of train_log.csv and loss.png
    DIR.state/    the last training state for --resume (see training.state), and the live
                  train_log.csv, loss.png (and tensorboard/ when installed)
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from training.batching import BatchStream, Collate
from training.distributed import DistContext
from training.errors import UserError
from training.optim import InverseSqrtSchedule, build_optimizer
from training.run_log import LOG_FILE, PLOT_FILE, RunLog
from training.runs import Data, Loop
from training.state import StateStore, TrainState, state_dir_for, write_json
from training.tasks.base import TaskOptions
from training.trainer import Hooks, LossFn, Trainer, TrainerConfig

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"


def trainer_config(
    loop: Loop, name: str, max_steps: int | None = None, find_unused_parameters: bool = False
) -> TrainerConfig:
    """The trainer's settings for ``loop`` (``max_steps`` instead of the loop's, e.g. for pre-training)."""
    return TrainerConfig(
        max_steps=max_steps if max_steps is not None else loop.max_steps,
        accum_steps=loop.accum_steps,
        clip_norm=loop.clip_norm if loop.clip_norm > 0 else None,
        eval_every=loop.eval_every,
        save_every=loop.save_every,
        quiet=loop.quiet,
        find_unused_parameters=find_unused_parameters,
        name=name,
    )


def task_options(loop: Loop, data: Data, family: str) -> TaskOptions:
    """The task settings of a training run (label smoothing by default 0.1 for seq2seq, else 0)."""
    smoothing = loop.label_smoothing
    if smoothing is None:
        smoothing = 0.1 if family == "seq2seq" else 0.0
    return TaskOptions(
        skip_malformed=data.skip_malformed,
        label_smoothing=smoothing,
        batch_tokens=loop.batch_tokens,
        valid_examples=loop.valid_examples,
    )


def deadline_of(loop: Loop) -> float | None:
    """When ``loop.max_minutes`` of this invocation run out, as a ``time.perf_counter()`` value."""
    return None if loop.max_minutes is None else time.perf_counter() + loop.max_minutes * 60


def seed_everything(seed: int) -> None:
    """Seed torch, Python's ``random`` and NumPy."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def open_state(out: Path, resume: bool) -> StateStore:
    """The state store beside ``out``; an existing state needs --resume (never silently overwritten)."""
    store = StateStore(state_dir_for(out))
    if store.directory.exists() and any(store.directory.rglob("LATEST")) and not resume:
        raise UserError(
            f"{store.directory} holds a previous run's state: pass --resume to continue it, "
            "or remove it (and the checkpoint) to start over"
        )
    return store


def run_phase(
    model: nn.Module,
    loss_fn: LossFn,
    examples: Sequence[Any],
    collate: Collate,
    *,
    loop: Loop,
    config: TrainerConfig,
    ctx: DistContext,
    store: StateStore,
    hooks: Hooks,
    state: TrainState | None,
    deadline: float | None = None,
) -> Trainer:
    """Train ``model``'s trainable parameters on ``examples`` from scratch or from ``state``.

    ``deadline`` is a ``time.perf_counter()`` value (see :func:`deadline_of`).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    stream = BatchStream(
        examples, [e.length for e in examples], collate, loop.batch_tokens, loop.seed, ctx.rank, ctx.world_size
    )
    logger.info(
        "%d examples, %d batches per epoch per process, %d trainable parameters",
        len(examples),
        stream.batches_per_epoch(),
        sum(p.numel() for p in params),
    )
    run_log = None
    if ctx.is_main:
        run_log = RunLog(store.directory, resume_step=state.meta["progress"]["step"] if state else None)
    trainer = Trainer(
        model,
        loss_fn,
        build_optimizer(params, loop.lr),
        InverseSqrtSchedule(loop.lr, loop.warmup),
        stream,
        config,
        ctx,
        store=store,
        run_log=run_log,
        hooks=hooks,
    )
    if state is not None:
        trainer.restore(state)
    try:
        trainer.run(deadline)
    finally:
        if run_log is not None:
            run_log.close()
    return trainer


def log_files(state_dir: Path) -> dict[str, bytes]:
    """The current train_log.csv and loss.png, to copy next to a checkpoint."""
    return {name: (state_dir / name).read_bytes() for name in (LOG_FILE, PLOT_FILE) if (state_dir / name).is_file()}


def finish(out: Path, state_dir: Path, updates: dict[str, Any]) -> None:
    """Copy the final log and plot into ``out`` and merge ``updates`` into its metrics.json."""
    if not out.is_dir():
        logger.warning("no checkpoint was written to %s", out)
        return
    for name in (LOG_FILE, PLOT_FILE):
        if (state_dir / name).is_file():
            shutil.copyfile(state_dir / name, out / name)
    merge_metrics(out, updates)


def merge_metrics(directory: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """Update ``directory/metrics.json`` with ``updates`` (keeping other keys) and return the result."""
    path = directory / METRICS_FILE
    metrics: dict[str, Any] = {}
    if path.is_file():
        try:
            metrics = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            logger.warning("%s is not valid JSON; rewriting it", path)
    metrics.update(updates)
    write_json(path, metrics)
    return metrics
