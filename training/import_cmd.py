"""`python -m training import --from hf SRC --out CKPT`: a Hugging Face model directory as our checkpoint.

The weights are mapped onto our modules (model.hf) and saved in our layout (the int8 copy, our export and
training then apply); the model's tokenizer and settings files (tokenizer, generation_config.json,
sentence-transformers' modules) are kept as they are under ``CKPT/hf/``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from training.runs import ImportRun, command

logger = logging.getLogger(__name__)

FORMATS = ("hf",)


def import_hf(source: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write HF model directory ``source`` as our checkpoint ``out``; returns ``out``."""
    import torch

    from model.checkpoint import HF_DIR, load_hf_checkpoint, save_checkpoint
    from model.hf import HFImportError, companion_files
    from training.errors import UserError

    out = Path(out)
    if out.exists() and not (out.is_dir() and (overwrite or not any(out.iterdir()))):
        raise UserError(f"{out} already exists and is not an empty directory (pass --overwrite to replace it)")
    try:
        checkpoint = load_hf_checkpoint(source, device="cpu", dtype=torch.float32)
    except (HFImportError, OSError) as exc:
        raise UserError(f"{source}: {exc}") from None
    files = {f"{HF_DIR}/{name}": data for name, data in companion_files(Path(source)).items()}
    save_checkpoint(out, checkpoint.model, None, extra_files=files)
    logger.info("imported %s (%s) into %s", source, checkpoint.family, out)
    return out


def _run(run: ImportRun) -> None:
    """The `import` command (--from hf)."""
    import_hf(run.source, run.out, overwrite=run.overwrite)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `import`."""
    parser = subparsers.add_parser(
        "import",
        help="convert another library's model directory into a checkpoint",
        description="MarianMTModel -> seq2seq, GPT2LMHeadModel -> causal_lm, BertForSequenceClassification / "
        "BertModel -> classifier; outputs stay equal to transformers'; a config we cannot express is refused.",
    )
    parser.add_argument("--from", dest="source_format", required=True, choices=FORMATS, help="source format")
    parser.add_argument("source", help="the model directory (config.json, model.safetensors, tokenizer files)")
    parser.add_argument("--out", required=True, help="checkpoint directory (created; must be empty or absent)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.set_defaults(func=command(ImportRun, _run))
