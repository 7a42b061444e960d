"""`python -m training translate-po`: the command line (work in training.translate_po)."""

from __future__ import annotations

import argparse
import json
import sys

from training.errors import UserError
from training.runs import DEVICE, TranslatePoRun, command


def _run(run: TranslatePoRun) -> None:
    import torch

    from model.checkpoint import CheckpointError, load_checkpoint
    from model.lora import AdapterError
    from model.lora_io import load_adapter
    from training.distributed import user_device
    from training.translate_po import LineTranslator, translate_catalog

    if not run.catalog.is_file():
        raise UserError(f"{run.catalog}: no such catalog")
    if run.beams < 1 or run.max_new_tokens < 1:
        raise UserError("--beams and --max-new-tokens must be at least 1")
    try:
        checkpoint = load_checkpoint(run.model, device=user_device(run.device), dtype=torch.float32)
        adapters = None
        if run.adapter:
            load_adapter(checkpoint.model, run.adapter, "translate-po", layout=checkpoint.adapter_layout)
            adapters = "translate-po"
        translator = LineTranslator(checkpoint, adapters, run.beams, run.max_new_tokens, run.target_lang)
        report = translate_catalog(run.catalog, run.out, translator)
    except (CheckpointError, AdapterError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    sys.stdout.write(json.dumps({"out": str(run.out), **report.as_dict()}, indent=2) + "\n")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `translate-po`."""
    p = subparsers.add_parser(
        "translate-po",
        help="fill a gettext catalog's empty translations (marked fuzzy) with a translation model",
        description="Every untranslated entry of CATALOG (plural forms included, as many as its Plural-Forms "
        "header says) gets a machine translation marked fuzzy; existing translations are kept. Placeholders "
        "(printf, braces, $VAR, tags, URLs, e-mails, --options) come through intact: an entry whose translation "
        "would lose one stays untranslated (training/translate_po.py). Prints a JSON report.",
    )
    p.add_argument("catalog", metavar="IN.po", help="the catalog to fill")
    p.add_argument("--model", required=True, metavar="DIR", help="translation (seq2seq) checkpoint")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter of the model (say, a package's own style)")
    p.add_argument("--out", required=True, metavar="OUT.po", help="where to write the filled catalog")
    p.add_argument("--beams", type=int, default=4, help="beam size (1: greedy; default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest translation of one line, in tokens")
    p.add_argument("--device", default=DEVICE, help="auto (default: CUDA when there is one), cpu, cuda, cuda:N")
    p.add_argument("--target-lang", metavar="CODE", help="a multilingual model's (NLLB-200, M2M100, mBART-50) "
                   "target language code, e.g. fra_Latn; default: the one the catalog's Language: header names")
    p.set_defaults(func=command(TranslatePoRun, _run))
