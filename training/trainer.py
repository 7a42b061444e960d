"""A family-agnostic training loop: model + loss function + batch stream + evaluation callable.

One optimiser step consumes ``accum_steps`` micro-batches per process. Their loss sums are
normalised by the step's total unit count over all micro-batches and processes, so the gradient is
that of the mean loss of everything the step saw, however it was split. On CUDA the forward runs
under bf16 autocast (fp32 master weights); on CPU there is no autocast.

Only rank 0 evaluates, writes the best checkpoint, the resume state and the log; every rank
contributes its RNG state to the resume state. Rank 0 decides when time is up and all ranks stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from training import distributed
from training.batching import Batch, BatchStream, Position
from training.distributed import DistContext
from training.optim import InverseSqrtSchedule
from training.progress import ProgressDisplay
from training.run_log import RunLog
from training.state import (
    StateStore,
    TrainState,
    capture_rng,
    load_trainable,
    optimizer_state,
    restore_optimizer,
    restore_rng,
    trainable_tensors,
)

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]  # (model, batch) -> summed loss over batch.count units


@dataclass
class TrainerConfig:
    """How long to train and how often to evaluate and save."""

    max_steps: int
    accum_steps: int = 1  # micro-batches per optimiser step
    clip_norm: float | None = 1.0  # max global gradient norm; None = no clipping
    eval_every: int = 500
    save_every: int = 500
    find_unused_parameters: bool = False  # DDP: some trainable parameters get no gradient (idle heads)
    quiet: bool = False  # no progress bar (training.progress logs lines instead)
    name: str = ""  # what the progress lines call the run (e.g. its output directory's name)


@dataclass
class Evaluation:
    """A validation result: the loss, and the metric that picks the best checkpoint."""

    loss: float
    metric: float
    metric_name: str
    higher_is_better: bool
    extra: dict[str, float] = field(default_factory=dict)

    def key(self) -> list[float]:
        """Larger is better: the metric, ties broken by the lower loss."""
        return [self.metric if self.higher_is_better else -self.metric, -self.loss]

    def metrics(self, prefix: str = "valid_") -> dict[str, float]:
        values = {"loss": self.loss, self.metric_name: self.metric, **self.extra}
        return {f"{prefix}{k}": v for k, v in values.items()}


@dataclass
class Progress:
    """Counters that survive a resume."""

    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0  # training wall time over all invocations, seconds
    best_key: list[float] | None = None
    best_step: int | None = None
    best_metrics: dict[str, float] | None = None


@dataclass
class Hooks:
    """What the command plugs into the loop (all called on rank 0 only)."""

    evaluate: Callable[[], Evaluation] | None = None
    on_best: Callable[[Evaluation, dict[str, Any]], None] | None = None  # write the best checkpoint
    state_files: Callable[[], dict[str, bytes]] = dict  # files a resume needs to rebuild the model


class _Objective(nn.Module):
    """The model and its loss as one module, so DDP sees every forward pass."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


class Trainer:
    """Runs optimiser steps until ``max_steps`` or the time budget, evaluating and saving on the way."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        schedule: InverseSqrtSchedule,
        stream: BatchStream,
        config: TrainerConfig,
        ctx: DistContext,
        *,
        store: StateStore | None = None,
        run_log: RunLog | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        self.model = model
        self.objective = distributed.wrap(_Objective(model, loss_fn), ctx, config.find_unused_parameters)
        self.optimizer = optimizer
        self.schedule = schedule
        self.stream = stream
        self.config = config
        self.ctx = ctx
        self.store = store
        self.run_log = run_log if ctx.is_main else None
        self.hooks = hooks or Hooks()
        self.progress = Progress()
        self.timed_out = False  # the last run() stopped at its deadline
        self._metric_name = "valid_metric"  # plot label, from the latest evaluation
        self._params = [p for group in optimizer.param_groups for p in group["params"]]

    # ---- resume -----------------------------------------------------------------------------------

    def restore(self, state: TrainState) -> None:
        """Continue from ``state``: weights, optimiser, schedule, counters, data position, RNG."""
        meta = state.meta
        load_trainable(self.model, state.trainable, state.directory)
        restore_optimizer(self.optimizer, state.optimizer, meta["optimizer"], state.directory)
        saved_schedule = InverseSqrtSchedule(**meta["schedule"])
        if saved_schedule != self.schedule:
            logger.warning("resuming with the saved LR schedule %s (not %s)", saved_schedule, self.schedule)
            self.schedule = saved_schedule
        self.progress = Progress(**meta["progress"])
        self.stream.position = Position(**meta["position"])
        rng = meta["rng"]
        if len(rng) == self.ctx.world_size:
            restore_rng(rng[self.ctx.rank])
        else:
            logger.warning(
                "state saved by %d process(es), resuming with %d: RNG streams restart", len(rng), self.ctx.world_size
            )
        logger.info("resumed from %s at step %d", state.directory, self.progress.step)

    def _save_state(self) -> None:
        rng = [json.loads(b) for b in distributed.all_gather_bytes(json.dumps(capture_rng()).encode(), self.ctx)]
        if self.store is None or not self.ctx.is_main:
            return
        optimizer_tensors, optimizer_meta = optimizer_state(self.optimizer)
        meta = {
            "progress": asdict(self.progress),
            "position": asdict(self.stream.position),
            "schedule": asdict(self.schedule),
            "optimizer": optimizer_meta,
            "rng": rng,
            "world_size": self.ctx.world_size,
        }
        self.store.save(
            self.progress.step,
            trainable=trainable_tensors(self.model),
            optimizer=optimizer_tensors,
            meta=meta,
            files=self.hooks.state_files(),
        )

    # ---- one step ---------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.ctx.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP all-reduces gradients only on the last micro-batch of a step."""
        if last or not self.ctx.distributed:
            return contextlib.nullcontext()
        return self.objective.no_sync()

    def _step(self) -> tuple[float, int, float]:
        """One optimiser step; returns (mean loss over all processes, tokens processed, lr)."""
        self.objective.train()
        micro = [next(self.stream).to(self.ctx.device) for _ in range(self.config.accum_steps)]
        (count,) = distributed.all_sum([float(sum(b.count for b in micro))], self.ctx)
        scale = self.ctx.world_size / max(count, 1.0)  # DDP averages over processes; undo that, divide by count
        total = torch.zeros((), device=self.ctx.device)
        for i, batch in enumerate(micro):
            with self._sync(i == len(micro) - 1):
                with self._autocast():
                    loss = self.objective(batch)
                (loss * scale).backward()
            total += loss.detach().float()
        if self.config.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.config.clip_norm)
        lr = self.schedule.apply(self.optimizer, self.progress.step + 1)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, tokens = distributed.all_sum([total.item(), float(sum(b.num_tokens for b in micro))], self.ctx)
        return loss_sum / max(count, 1.0), int(tokens), lr

    # ---- the loop ---------------------------------------------------------------------------------

    def _evaluate(self) -> Evaluation | None:
        if self.hooks.evaluate is None or not self.ctx.is_main:
            return None
        evaluation = self.hooks.evaluate()
        p = self.progress
        if p.best_key is None or evaluation.key() > p.best_key:
            p.best_key, p.best_step, p.best_metrics = evaluation.key(), p.step, evaluation.metrics()
            if self.hooks.on_best is not None:
                self.hooks.on_best(evaluation, self.summary())
        return evaluation

    def summary(self) -> dict[str, Any]:
        """Counters for metrics.json: steps, tokens, wall time and throughput."""
        p = self.progress
        return {
            "step": p.step,
            "train_tokens": p.tokens,
            "wall_time_s": round(p.elapsed, 3),
            "tokens_per_s": round(p.tokens / p.elapsed, 1) if p.elapsed > 0 else None,
        }

    def run(self, deadline: float | None = None) -> Progress:
        """Train until ``max_steps`` (counted over resumes) or the ``time.perf_counter()`` ``deadline``."""
        p, cfg = self.progress, self.config
        start, elapsed0, tokens0 = time.perf_counter(), p.elapsed, p.tokens
        display = ProgressDisplay.for_stderr(
            p.step, cfg.max_steps, main=self.ctx.is_main, quiet=cfg.quiet, name=cfg.name, deadline=deadline
        )
        with display:
            while p.step < cfg.max_steps:
                loss, tokens, lr = self._step()
                now = time.perf_counter() - start
                p.step, p.tokens, p.elapsed = p.step + 1, p.tokens + tokens, elapsed0 + now
                time_up = deadline is not None and time.perf_counter() >= deadline
                stop = self.timed_out = distributed.broadcast_flag(time_up, self.ctx)
                last = stop or p.step >= cfg.max_steps
                evaluation = self._evaluate() if p.step % cfg.eval_every == 0 or last else None
                tokens_per_s = (p.tokens - tokens0) / now if now > 0 else 0.0
                self._log(loss, lr, tokens_per_s, evaluation)
                if p.step % cfg.save_every == 0 or last:
                    self._save_state()
                display.update(p.step, loss, tokens_per_s, last)
                if stop:
                    logger.info("stopping at step %d: out of time", p.step)
                    break
        if self.run_log is not None:
            self.run_log.plot(self._metric_name)
        return p

    def _log(self, loss: float, lr: float, tokens_per_s: float, evaluation: Evaluation | None) -> None:
        p = self.progress
        if evaluation is not None:
            logger.info(
                "step %d: loss %.4f, valid loss %.4f, %s %.4f, %.0f tokens/s",
                p.step,
                loss,
                evaluation.loss,
                evaluation.metric_name,
                evaluation.metric,
                tokens_per_s,
            )
        if self.run_log is None:
            return
        self.run_log.log(
            {
                "step": p.step,
                "epoch": self.stream.position.epoch,
                "loss": loss,
                "lr": lr,
                "tokens": p.tokens,
                "tokens_per_s": round(tokens_per_s, 1),
                "elapsed": round(p.elapsed, 3),
                "valid_loss": evaluation.loss if evaluation else None,
                "valid_metric": evaluation.metric if evaluation else None,
            }
        )
        if evaluation is not None:
            self._metric_name = evaluation.metric_name
            self.run_log.plot(self._metric_name, force=False)
