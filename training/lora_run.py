"""`lora`: train one LoRA adapter on a frozen base checkpoint and save it in PEFT's layout.

The adapter directory ``--out`` holds the best adapter by validation metric (adapter_config.json +
adapter_model.safetensors, base_model_name_or_path set to the base checkpoint) and a metrics.json
comparing it with the base model on the valid split; ``<out>.state/`` holds the resume state.

The base may be a Hugging Face directory (model.hf: GPT-2, BERT classifier, OPUS-MT, the Llama family), or our
checkpoint imported from one: data is encoded with its tokenizer(s) and special ids as the service encodes inputs,
and the adapter is written in the HF model's module names (its AdapterLayout), so
``peft.PeftModel.from_pretrained`` loads it on that model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.lora import AdapterError, LoRAConfig, add_adapter, mark_only_lora_trainable, use_adapters
from model.lora_io import AdapterLayout, save_adapter
from training import distributed
from training.distributed import DistContext
from training.errors import UserError
from training.runs import AdapterSpec, LoRARun
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
from training.state import write_bytes_atomic, write_json
from training.tasks import TASKS
from training.tasks.base import TokenIds
from training.trainer import Evaluation, Hooks, LossFn

logger = logging.getLogger(__name__)

ADAPTER = "default"  # the adapter's name inside the model while training (not saved)
PEFT_TASK_TYPES = {"seq2seq": "SEQ_2_SEQ_LM", "classifier": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}


def with_adapter(loss_fn: LossFn, name: str) -> LossFn:
    """``loss_fn`` with adapter ``name`` selected for the forward pass."""

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        with use_adapters(model, name):
            return loss_fn(model, batch)

    return loss


def load_base(path: Path, device: torch.device) -> Checkpoint:
    """The frozen base checkpoint in float32."""
    try:
        return load_checkpoint(path, device=device, dtype=torch.float32)
    except CheckpointError as e:
        raise UserError(f"--base: {e}") from e


def lora_config(spec: AdapterSpec, family: str, base_path: str) -> LoRAConfig:
    """The PEFT config of an adapter of shape ``spec`` on the ``family`` model at ``base_path``."""
    try:
        return LoRAConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=spec.targets,
            task_type=PEFT_TASK_TYPES[family],
            base_model_name_or_path=base_path,
        )
    except AdapterError as e:
        raise UserError(str(e)) from e


def save_best_adapter(
    out: Path,
    state_dir: Path,
    model: nn.Module,
    base_metrics: dict[str, float],
    evaluation: Evaluation,
    summary: dict[str, Any],
    info: dict[str, Any],
    layout: AdapterLayout | None,
) -> None:
    """Write the adapter (PEFT layout; ``layout``: in an imported HF model's module names) with metrics.json
    (adapter vs base) and the log so far."""
    save_adapter(model, ADAPTER, out, base_model_name_or_path=info["base_model"], layout=layout)
    write_json(
        out / "metrics.json",
        {**info, **evaluation.metrics(), "best_step": summary["step"], **summary, "base": base_metrics},
    )
    for name, data in log_files(state_dir).items():
        write_bytes_atomic(out / name, data)
    logger.info("step %d: new best %s %.4f -> %s", summary["step"], evaluation.metric_name, evaluation.metric, out)


def lora(run: LoRARun) -> nn.Module:
    """The `lora` command; returns the model it trained (the base with adapter "default", on every rank)."""
    ctx = distributed.init_distributed(run.device)
    try:
        return _lora(run, ctx)
    finally:
        distributed.shutdown(ctx)


def _lora(run: LoRARun, ctx: DistContext) -> nn.Module:
    loop, out = run.loop, run.out
    deadline = deadline_of(loop)
    store = open_state(out, run.resume)
    state = store.load() if run.resume else None
    seed_everything(loop.seed)
    base = load_base(run.base, ctx.device)
    if base.family == "classifier" and not base.labels:
        raise UserError(f"{run.base}: the classifier has no classification head (an embedding model): a LoRA "
                        "classifier adapter needs labelled data for a head")
    base_path = str(run.base.resolve())
    model, tokenizer = base.model, base.tokenizer
    task = TASKS[base.family](replace(task_options(loop, run.data, base.family), ids=TokenIds.of(base.config)))
    encoded = {}
    for split, path in (("train", run.data.train), ("valid", run.data.valid)):
        records = task.read(path).records
        encoded[split] = task.encode(records, tokenizer, base.config, base.labels, path, base.source_tokenizer)
    config = lora_config(run.adapter, base.family, base_path)
    try:
        add_adapter(model, ADAPTER, config, seed=loop.seed)
    except AdapterError as e:
        raise UserError(str(e)) from e
    trainable = mark_only_lora_trainable(model, ADAPTER)
    torch.manual_seed(loop.seed + ctx.rank)
    base_metrics = task.validate(model, encoded["valid"], tokenizer).metrics() if ctx.is_main else {}
    info = {
        "family": base.family,
        "base_model": base_path,
        "rank": config.r,
        "alpha": config.lora_alpha,
        "targets": list(config.target_modules),
        "trainable_parameters": sum(p.numel() for p in trainable),
    }
    hooks = Hooks(
        evaluate=lambda: task.validate(model, encoded["valid"], tokenizer, adapters=ADAPTER),
        on_best=lambda evaluation, summary: save_best_adapter(
            out, store.directory, model, base_metrics, evaluation, summary, info, base.adapter_layout
        ),
        state_files=lambda: {"adapter_config.json": json.dumps(config.to_peft_dict(), indent=2).encode()},
    )
    trainer = run_phase(
        model,
        with_adapter(task.loss, ADAPTER),
        encoded["train"],
        task.collate,
        loop=loop,
        config=trainer_config(loop, out.name),
        ctx=ctx,
        store=store,
        hooks=hooks,
        state=state,
        deadline=deadline,
    )
    if ctx.is_main:
        p = trainer.progress
        finish(out, store.directory, {"steps_trained": p.step, "total_wall_time_s": round(p.elapsed, 3)})
    return model
