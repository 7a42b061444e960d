"""`evaluate`: a checkpoint (optionally with a LoRA adapter) on a test file; metrics.json is merged.

A Hugging Face directory (model.hf) is evaluated with its tokenizer(s) and special ids, and a PEFT adapter
trained on it is read in its module names (the checkpoint's AdapterLayout).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import CheckpointError, load_checkpoint
from model.layout import use_input_major_weights
from model.lora import AdapterError
from model.lora_io import load_adapter
from model.quantize import QuantizeError, quantize
from training.distributed import user_device
from training.errors import UserError
from training.session import merge_metrics
from training.tasks import TASKS, TaskOptions
from training.tasks.base import TokenIds

logger = logging.getLogger(__name__)

ADAPTER = "evaluated"


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """The `evaluate` command; returns what it printed and merged into metrics.json."""
    quantized = getattr(args, "quantize", "none") != "none"
    device = user_device("cpu" if quantized and args.device == "auto" else args.device)
    try:
        ckpt = load_checkpoint(args.model, device=device, dtype=torch.float32)
    except CheckpointError as e:
        raise UserError(f"--model: {e}") from e
    adapters = None
    if args.adapter:
        try:
            config = load_adapter(ckpt.model, args.adapter, ADAPTER, layout=ckpt.adapter_layout)
        except AdapterError as e:
            raise UserError(f"--adapter: {e}") from e
        base = config.base_model_name_or_path
        if base and Path(base).resolve() != Path(args.model).resolve():
            logger.warning("adapter %s was trained on %s, not %s", args.adapter, base, args.model)
        adapters = ADAPTER
    if quantized:
        try:
            quantize(ckpt.model, args.quantize)
        except QuantizeError as e:
            raise UserError(f"--quantize {args.quantize}: {e}") from e
    use_input_major_weights(ckpt.model)
    task = TASKS[ckpt.family](
        TaskOptions(
            skip_malformed=args.skip_malformed,
            batch_tokens=args.batch_tokens,
            beams=args.beams,
            max_new_tokens=args.max_new_tokens,
            ids=TokenIds.of(ckpt.config),
        )
    )
    test = Path(args.test)
    read = task.read(test)
    examples = task.encode(read.records, ckpt.tokenizer, ckpt.config, ckpt.labels, test, ckpt.source_tokenizer)
    examples = examples[: args.max_examples]
    with torch.no_grad():
        metrics = task.metric(ckpt.model, examples, ckpt.tokenizer, adapters, None)
    result: dict[str, Any] = {**metrics, "test_file": str(test), "test_examples": len(examples)}
    if args.skip_malformed:
        result["skipped_lines"] = read.skipped
    if ckpt.family == "seq2seq":
        result["beams"] = args.beams
    if args.adapter:
        result["base_model"] = str(Path(args.model).resolve())
    target = Path(args.adapter or args.model)
    if quantized:
        result["quantize"] = args.quantize
    merge_metrics(target, {args.quantize: result} if quantized else result)  # fp32 metrics stay as they were
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    logger.info("metrics merged into %s", target / "metrics.json")
    return result
