"""`train`: build (or resume) a model of one family and train it; see training.session for the layout."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
from torch import nn

from model.checkpoint import CONFIG_FILE, FORMAT_VERSION, build_model, load_config, parameter_count, save_checkpoint
from model.config import TransformerConfig
from model.tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerError
from training import distributed
from training.arch import ModelSizes, describe
from training.distributed import DistContext
from training.errors import UserError
from training.session import (
    deadline_of,
    finish,
    log_files,
    open_state,
    run_phase,
    seed_everything,
    task_options,
    trainer_config,
    write_param_digest,
)
from training.state import StateStore, TrainState
from training.tasks import TASKS, Task
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

    def files(self) -> dict[str, bytes]:
        files = {
            CONFIG_FILE: json.dumps({"format_version": FORMAT_VERSION, **self.config.to_dict()}, indent=2).encode(),
            TOKENIZER_FILE: self.tokenizer.backend.to_str(pretty=True).encode(),
        }
        if self.labels is not None:
            files[LABELS_FILE] = json.dumps(self.labels).encode()
        return files

    @classmethod
    def from_state(cls, state: TrainState) -> Setup:
        labels_path = state.file(LABELS_FILE)
        labels = json.loads(labels_path.read_text()) if labels_path.is_file() else None
        return cls(Tokenizer.load(state.file(TOKENIZER_FILE)), load_config(state.directory), labels)


def sizes_from(args: argparse.Namespace) -> ModelSizes:
    return ModelSizes(
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        ffn=args.ffn,
        max_len=args.max_len,
        dropout=args.dropout,
        arch=args.arch,
        encoder_layers=getattr(args, "encoder_layers", None),
        decoder_layers=getattr(args, "decoder_layers", None),
    )


def make_tokenizer(args: argparse.Namespace, texts: Any, ctx: DistContext) -> Tokenizer:
    """--tokenizer, or a byte-level BPE trained on rank 0 and shared with the other ranks."""
    if args.tokenizer:
        try:
            return Tokenizer.load(args.tokenizer)
        except TokenizerError as e:
            raise UserError(str(e)) from e
    if args.vocab_size < MIN_VOCAB:
        raise UserError(f"--vocab-size must be at least {MIN_VOCAB} (7 special tokens + 256 bytes)")
    trained = Tokenizer.train(texts, vocab_size=args.vocab_size) if ctx.is_main else None
    if not ctx.distributed:
        return trained
    text = distributed.broadcast_bytes(trained.backend.to_str().encode() if trained else None, ctx)
    return Tokenizer(tokenizers.Tokenizer.from_str(text.decode()))


def new_setup(
    args: argparse.Namespace, task: Task, records: list[Any], extra_texts: list[str], ctx: DistContext
) -> Setup:
    tokenizer = make_tokenizer(args, itertools.chain(task.texts(records), extra_texts), ctx)
    labels = task.labels(records)
    config = task.config(sizes_from(args), tokenizer, labels)
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
    save_checkpoint(out, model, setup.tokenizer, labels=setup.labels, metrics=metrics, extra_files=log_files(state_dir))
    logger.info("step %d: new best %s %.4f -> %s", summary["step"], evaluation.metric_name, evaluation.metric, out)


def pretrain(
    args: argparse.Namespace,
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
        raise UserError(f"{args.pretrain_mlm}: no pairs of consecutive non-blank lines")
    objective = Pretraining(setup.config.vocab_size)
    logger.info("pre-training (MLM + sentence order) for %d steps on %d pairs", args.pretrain_steps, len(pairs))
    trainer = run_phase(
        model,
        objective.loss,
        pairs,
        objective.collate,
        args=args,
        config=trainer_config(args, max_steps=args.pretrain_steps, find_unused_parameters=True),
        ctx=ctx,
        store=store,
        hooks=Hooks(state_files=setup.files),
        state=state,
        deadline=deadline,
    )
    return not trainer.timed_out


def train(args: argparse.Namespace) -> None:
    """The `train` command."""
    ctx = distributed.init_distributed(args.device)
    try:
        _train(args, ctx)
    finally:
        distributed.shutdown(ctx)


def _train(args: argparse.Namespace, ctx: DistContext) -> None:
    deadline = deadline_of(args)
    out = Path(args.out)
    store = open_state(out, args.resume)
    pre_store = StateStore(store.directory / "pretrain")
    pretraining = bool(getattr(args, "pretrain_mlm", None))
    state = store.load() if args.resume else None
    pre_state = pre_store.load() if args.resume and pretraining and state is None else None
    seed_everything(args.seed)
    task = TASKS[args.family](task_options(args, args.family))
    train_records, valid_records = task.read(Path(args.train)).records, task.read(Path(args.valid)).records
    lines = read_segments(Path(args.pretrain_mlm), args.skip_malformed) if pretraining else []
    saved = state or pre_state
    setup = Setup.from_state(saved) if saved else new_setup(args, task, train_records, lines, ctx)
    torch.manual_seed(args.seed)
    model = build_model(setup.config).to(ctx.device)
    train_examples = task.encode(train_records, setup.tokenizer, setup.config, setup.labels, Path(args.train))
    valid_examples = task.encode(valid_records, setup.tokenizer, setup.config, setup.labels, Path(args.valid))
    torch.manual_seed(args.seed + ctx.rank)  # dropout differs across processes
    if pretraining and state is None and not pretrain(args, ctx, model, setup, lines, pre_store, pre_state, deadline):
        logger.info("out of time during pre-training; --resume continues it")
        return
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
        args=args,
        # A fine-tuned classifier leaves its pre-training heads idle.
        config=trainer_config(args, find_unused_parameters=setup.config.family == "classifier"),
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
    write_param_digest(model, ctx)
