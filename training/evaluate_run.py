"""`evaluate`: a checkpoint (optionally with a LoRA adapter) on a test file; metrics.json is merged.

A Hugging Face directory (model.hf) is evaluated with its tokenizer(s) and special ids, and a PEFT adapter
trained on it is read in its module names (the checkpoint's AdapterLayout).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import Checkpoint, CheckpointError, checkpoint_vocabulary_map, load_checkpoint
from model.lora import AdapterError
from model.lora_io import load_adapter
from model.quantize import QuantizeError, prepare_for_inference
from model.vocab_map import VMAP_FILE, VMAPS_DIR, LanguageMaps, VocabularyMap, VocabularyMapError
from training.distributed import user_device
from training.errors import UserError
from training.runs import DEVICE, EvalRun
from training.session import merge_metrics
from training.tasks import TASKS, TaskOptions
from training.tasks.base import TokenIds

logger = logging.getLogger(__name__)

ADAPTER = "evaluated"


def evaluate(run: EvalRun, metrics_key: str | None = None) -> dict[str, Any]:
    """Score ``run.model`` (with ``run.adapter``) on ``run.test``; returns the metrics merged into metrics.json, at
    its top level, or as the entry ``metrics_key`` (replaced) to keep another test split's metrics apart."""
    quantized = run.quantize != "none"
    device = user_device("cpu" if quantized and run.device == DEVICE else run.device)
    try:
        ckpt = load_checkpoint(run.model, device=device, dtype=torch.float32)
    except CheckpointError as e:
        raise UserError(f"--model: {e}") from e
    adapters = None
    if run.adapter:
        try:
            config = load_adapter(ckpt.model, run.adapter, ADAPTER, layout=ckpt.adapter_layout)
        except AdapterError as e:
            raise UserError(f"--adapter: {e}") from e
        base = config.base_model_name_or_path
        if base and Path(base).resolve() != run.model.resolve():
            logger.warning("adapter %s was trained on %s, not %s", run.adapter, base, run.model)
        adapters = ADAPTER
    try:
        prepare_for_inference(ckpt.model, run.quantize)
    except QuantizeError as e:
        raise UserError(f"--quantize {run.quantize}: {e}") from e
    task = TASKS[ckpt.family](
        TaskOptions(
            skip_malformed=run.skip_malformed,
            batch_tokens=run.batch_tokens,
            beams=run.beams,
            max_new_tokens=run.max_new_tokens,
            ids=TokenIds.of(ckpt.config),
            vocab_map=_vocab_map(ckpt) if run.vmap else None,
        )
    )
    read = task.read(run.test)
    examples = task.encode(read.records, ckpt.tokenizer, ckpt.config, ckpt.labels, run.test, ckpt.source_tokenizer)
    examples = examples[: run.max_examples]
    with torch.no_grad():
        metrics = task.metric(ckpt.model, examples, ckpt.tokenizer, adapters, None)
    result: dict[str, Any] = {**metrics, "test_file": str(run.test), "test_examples": len(examples)}
    if run.skip_malformed:
        result["skipped_lines"] = read.skipped
    if ckpt.family == "seq2seq":
        result["beams"] = run.beams
    if run.adapter:
        result["base_model"] = str(run.model.resolve())
    target = run.adapter or run.model
    if quantized:
        result["quantize"] = run.quantize
    variant = "+".join([run.quantize] * quantized + ["vmap"] * run.vmap)
    updates = {variant: result} if variant else result  # the plain fp32 metrics stay as they were
    merge_metrics(target, {metrics_key: updates} if metrics_key else updates)
    logger.info("metrics merged into %s", target / "metrics.json")
    return result


def _vocab_map(ckpt: Checkpoint) -> VocabularyMap:
    """The checkpoint's vocabulary map, which --vmap needs."""
    try:
        found = checkpoint_vocabulary_map(ckpt)
    except VocabularyMapError as e:
        raise UserError(f"--vmap: {e}") from e
    if found is None:
        raise UserError(f"--vmap: {ckpt.path} has no {VMAP_FILE} (a seq2seq model's map: python -m training "
                        "build-vmap)")
    if isinstance(found, LanguageMaps):  # a row picks its map by its target language, which evaluate does not force
        raise UserError(f"--vmap: {ckpt.path} keeps maps per target language ({VMAPS_DIR}/<code>.txt); evaluate "
                        "decodes without a target language, so it would use none of them")
    return found
