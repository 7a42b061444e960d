"""`train`: build (or resume) a model of one family and train it; see training.session for the layout.

``--init-from DIR`` fine-tunes every parameter of a checkpoint instead (ours, an imported one or a Hugging
Face directory, model.hf): its config, tokenizer(s), labels and special ids are kept; an HF model's tokenizer
and settings files go under ``hf/`` of the checkpoint and of the resume state, as ``import`` saves them.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tokenizers
import torch
from torch import nn

from model.build import build_model
from model.checkpoint import (
    CONFIG_FILE,
    FORMAT_VERSION,
    HF_DIR,
    SOURCE_TOKENIZER_FILE,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    load_config,
    parameter_count,
    save_checkpoint,
)
from model.config import TransformerConfig
from model.hf import companion_files, hf_companions, is_hf_directory
from model.tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerError
from training import distributed
from training.arch import describe
from training.distributed import DistContext
from training.errors import UserError
from training.runs import TrainRun
from training.session import (
    deadline_of,
    finish,
    log_files,
    open_state,
    run_phase,
    seed_everything,
    task_options,
    trainer_config,
)
from training.state import StateStore, TrainState
from training.tasks import TASKS, Task
from training.tasks.base import TokenIds
from training.tasks.pretrain import Pretraining, read_segments, segment_pairs
from training.trainer import Evaluation, Hooks

logger = logging.getLogger(__name__)

LABELS_FILE = "labels.json"
MIN_VOCAB = 263  # 7 special tokens + 256 bytes


@dataclass
class Setup:
    """What defines the model beyond its weights; saved in every resume state."""

    tokenizer: Tokenizer
    config: TransformerConfig
    labels: list[str] | None
    source_tokenizer: Tokenizer | None = None
    hf_files: dict[str, bytes] | None = None  # an HF model's tokenizer and settings ("hf/<name>"): they hold the rest

    def files(self) -> dict[str, bytes]:
        files = {
            CONFIG_FILE: json.dumps({"format_version": FORMAT_VERSION, **self.config.to_dict()}, indent=2).encode()
        }
        if self.hf_files is not None:
            return {**files, **self.hf_files}
        files[TOKENIZER_FILE] = self.tokenizer.backend.to_str(pretty=True).encode()
        if self.source_tokenizer is not None:
            files[SOURCE_TOKENIZER_FILE] = self.source_tokenizer.backend.to_str(pretty=True).encode()
        if self.labels is not None:
            files[LABELS_FILE] = json.dumps(self.labels).encode()
        return files

    def checkpoint_files(self) -> dict[str, Any]:
        """save_checkpoint's arguments for what defines the model beside its weights."""
        if self.hf_files is not None:
            return {"tokenizer": None, "extra_files": self.hf_files}
        return {"tokenizer": self.tokenizer, "source_tokenizer": self.source_tokenizer, "labels": self.labels}

    @classmethod
    def from_state(cls, state: TrainState) -> Setup:
        config = load_config(state.directory)
        if state.file(HF_DIR).is_dir():
            return cls.from_hf(config, state.file(HF_DIR))
        labels_path, source_path = state.file(LABELS_FILE), state.file(SOURCE_TOKENIZER_FILE)
        labels = json.loads(labels_path.read_text()) if labels_path.is_file() else None
        source = Tokenizer.load(source_path) if source_path.is_file() else None
        return cls(Tokenizer.load(state.file(TOKENIZER_FILE)), config, labels, source)

    @classmethod
    def from_hf(cls, config: TransformerConfig, directory: Path) -> Setup:
        """The setup an HF model directory (or an imported checkpoint's ``hf/``) brings for ``config``."""
        found = hf_companions(directory, config)
        files = {f"{HF_DIR}/{name}": data for name, data in companion_files(directory).items()}
        return cls(found["tokenizer"], config, found["labels"], found["source_tokenizer"], files)

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> Setup:
        """The setup of a loaded checkpoint (``--init-from``)."""
        path = checkpoint.path
        for directory in (path, path / HF_DIR):
            if is_hf_directory(directory):
                return cls.from_hf(checkpoint.config, directory)
        return cls(checkpoint.tokenizer, checkpoint.config, checkpoint.labels, checkpoint.source_tokenizer)


def make_tokenizer(run: TrainRun, texts: Any, ctx: DistContext) -> Tokenizer:
    """--tokenizer, or a byte-level BPE trained on rank 0 and shared with the other ranks."""
    if run.tokenizer:
        try:
            return Tokenizer.load(run.tokenizer)
        except TokenizerError as e:
            raise UserError(str(e)) from e
    if run.vocab_size < MIN_VOCAB:
        raise UserError(f"--vocab-size must be at least {MIN_VOCAB} (7 special tokens + 256 bytes)")
    trained = Tokenizer.train(texts, vocab_size=run.vocab_size) if ctx.is_main else None
    if not ctx.distributed:
        return trained
    text = distributed.broadcast_bytes(trained.backend.to_str().encode() if trained else None, ctx)
    return Tokenizer(tokenizers.Tokenizer.from_str(text.decode()))


def load_init(run: TrainRun, ctx: DistContext) -> Checkpoint:
    """The ``--init-from`` checkpoint in float32, checked against the command's family and flags."""
    if run.tokenizer or run.pretrain_mlm:
        raise UserError("--init-from keeps the checkpoint's tokenizer and weights: drop --tokenizer / --pretrain-mlm")
    try:
        base = load_checkpoint(run.init_from, device=ctx.device, dtype=torch.float32)
    except CheckpointError as e:
        raise UserError(f"--init-from: {e}") from e
    if base.family != run.family:
        raise UserError(f"--init-from {run.init_from}: a {base.family} model, not {run.family}")
    if base.family == "classifier" and not base.labels:
        raise UserError(f"--init-from {run.init_from}: the classifier has no classification head (an embedding "
                        "model)")
    logger.info("fine-tuning %s (%s); the model flags are ignored", run.init_from, describe(base.config))
    return base


def new_setup(run: TrainRun, task: Task, records: list[Any], extra_texts: list[str], ctx: DistContext) -> Setup:
    """A new tokenizer (or ``run.tokenizer``), the labels of ``records`` and the config of ``run.sizes``."""
    tokenizer = make_tokenizer(run, itertools.chain(task.texts(records), extra_texts), ctx)
    labels = task.labels(records)
    config = task.config(run.sizes, tokenizer, labels)
    logger.info("model config: %s", describe(config))
    return Setup(tokenizer, config, labels)


def save_best(
    out: Path, state_dir: Path, model: nn.Module, setup: Setup, evaluation: Evaluation, summary: dict[str, Any]
) -> None:
    """Write the best checkpoint with its metrics.json (rank 0)."""
    metrics = {
        "family": setup.config.family,
        **evaluation.metrics(),
        "best_step": summary["step"],
        **summary,
        "parameters": parameter_count(model),
        "sizes": describe(setup.config),
    }
    files = setup.checkpoint_files()
    extra = {**files.pop("extra_files", {}), **log_files(state_dir)}
    save_checkpoint(out, model, metrics=metrics, extra_files=extra, **files)
    logger.info("step %d: new best %s %.4f -> %s", summary["step"], evaluation.metric_name, evaluation.metric, out)


def pretrain(
    run: TrainRun,
    ctx: DistContext,
    model: nn.Module,
    setup: Setup,
    lines: list[str],
    store: StateStore,
    state: TrainState | None,
    deadline: float | None,
) -> bool:
    """MLM + sentence-order pre-training of a classifier for --pretrain-steps; False if time ran out."""
    pairs = segment_pairs(lines, setup.tokenizer, setup.config.max_len)
    if not pairs:
        raise UserError(f"{run.pretrain_mlm}: no pairs of consecutive non-blank lines")
    objective = Pretraining(setup.config.vocab_size)
    logger.info("pre-training (MLM + sentence order) for %d steps on %d pairs", run.pretrain_steps, len(pairs))
    trainer = run_phase(
        model,
        objective.loss,
        pairs,
        objective.collate,
        loop=run.loop,
        config=trainer_config(run.loop, run.out.name, max_steps=run.pretrain_steps, find_unused_parameters=True),
        ctx=ctx,
        store=store,
        hooks=Hooks(state_files=setup.files),
        state=state,
        deadline=deadline,
    )
    return not trainer.timed_out


def train(run: TrainRun) -> nn.Module:
    """The `train` command; returns the trained model (its last step's weights, on every rank)."""
    ctx = distributed.init_distributed(run.device)
    try:
        return _train(run, ctx)
    finally:
        distributed.shutdown(ctx)


def _train(run: TrainRun, ctx: DistContext) -> nn.Module:
    deadline = deadline_of(run.loop)
    out, loop = run.out, run.loop
    store = open_state(out, run.resume)
    pre_store = StateStore(store.directory / "pretrain")
    pretraining = run.pretrain_mlm is not None
    state = store.load() if run.resume else None
    pre_state = pre_store.load() if run.resume and pretraining and state is None else None
    seed_everything(loop.seed)
    saved = state or pre_state
    base = load_init(run, ctx) if run.init_from and not saved else None
    setup = Setup.from_state(saved) if saved else Setup.of(base) if base else None
    options = task_options(loop, run.data, run.family)
    task = TASKS[run.family](replace(options, ids=TokenIds.of(setup.config)) if setup else options)
    train_records, valid_records = task.read(run.data.train).records, task.read(run.data.valid).records
    lines = read_segments(run.pretrain_mlm, run.data.skip_malformed) if pretraining else []
    setup = setup or new_setup(run, task, train_records, lines, ctx)
    torch.manual_seed(loop.seed)
    model = base.model.train() if base else build_model(setup.config).to(ctx.device)
    train_examples, valid_examples = (
        task.encode(records, setup.tokenizer, setup.config, setup.labels, path, setup.source_tokenizer)
        for records, path in ((train_records, run.data.train), (valid_records, run.data.valid))
    )
    torch.manual_seed(loop.seed + ctx.rank)  # dropout differs across processes
    if pretraining and state is None and not pretrain(run, ctx, model, setup, lines, pre_store, pre_state, deadline):
        logger.info("out of time during pre-training; --resume continues it")
        return model
    hooks = Hooks(
        evaluate=lambda: task.validate(model, valid_examples, setup.tokenizer),
        on_best=lambda evaluation, summary: save_best(out, store.directory, model, setup, evaluation, summary),
        state_files=setup.files,
    )
    trainer = run_phase(
        model,
        task.loss,
        train_examples,
        task.collate,
        loop=loop,
        # A fine-tuned classifier leaves its pre-training heads idle.
        config=trainer_config(loop, out.name, find_unused_parameters=setup.config.family == "classifier"),
        ctx=ctx,
        store=store,
        hooks=hooks,
        state=state,
        deadline=deadline,
    )
    if ctx.is_main:
        p = trainer.progress
        finish(
            out,
            store.directory,
            {"steps_trained": p.step, "total_wall_time_s": round(p.elapsed, 3), "total_train_tokens": p.tokens},
        )
    return model
