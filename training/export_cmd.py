"""`python -m training export --model CKPT --to hf --out DIR`: a checkpoint as a `transformers` model directory."""

from __future__ import annotations

import argparse

from training.runs import ExportRun, command

FORMATS = ("hf",)


def _run(run: ExportRun) -> None:
    """The `export` command (--to hf)."""
    from training.export import export_hf  # torch is imported only when the command runs

    export_hf(run.model, run.out, overwrite=run.overwrite)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `export`."""
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint in another library's format",
        description="seq2seq -> MarianMTModel, causal_lm -> GPT2LMHeadModel, classifier -> "
        "BertForSequenceClassification (loadable without trust_remote_code); a config the "
        "architecture cannot express exactly is refused.",
    )
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--to", required=True, choices=FORMATS, help="target format")
    parser.add_argument("--out", required=True, help="output directory (created; must be empty or absent)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.set_defaults(func=command(ExportRun, _run))
