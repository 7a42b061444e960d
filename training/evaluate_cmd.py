"""`python -m training evaluate`: the command line (work in training.evaluate_run)."""

from __future__ import annotations

import argparse
import json
import sys

from model.quantize import QUANTIZE_MODES
from training.options import positive_int
from training.runs import DEVICE, EvalRun, from_namespace


def _run(args: argparse.Namespace) -> None:
    from training.evaluate_run import evaluate

    result = evaluate(from_namespace(EvalRun, args), metrics_key=args.metrics_key)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `evaluate`."""
    p = subparsers.add_parser(
        "evaluate",
        help="score a checkpoint (and adapter) on a test file",
        description="Print the family's test metrics and merge them into metrics.json of the checkpoint "
        "(or of the adapter with --adapter): BLEU and chrF (seq2seq), accuracy and macro-F1 (classifier), "
        "perplexity over max-len windows (causal_lm).",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--adapter", default=None, metavar="DIR", help="LoRA adapter directory (PEFT layout) to apply")
    p.add_argument("--test", required=True, metavar="FILE", help="test data file (or directory for causal_lm)")
    p.add_argument(
        "--beams",
        type=positive_int,
        metavar="N",
        default=EvalRun.beams,
        help="seq2seq beam size; 1 = greedy (default %(default)s)",
    )
    p.add_argument(
        "--max-examples", type=positive_int, metavar="N", default=None, help="score only the first N examples"
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        metavar="N",
        default=EvalRun.max_new_tokens,
        help="seq2seq output cap in tokens, also <= 2 x source + 10 (default %(default)s)",
    )
    p.add_argument(
        "--batch-tokens",
        type=positive_int,
        metavar="N",
        default=EvalRun.batch_tokens,
        help="padded tokens per batch (default %(default)s)",
    )
    p.add_argument("--device", default=DEVICE, help="auto, cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_MODES,
        default=EvalRun.quantize,
        help="int8: dynamic int8 linear weights, bf16: bfloat16 linear weights (CPU only), to compare with fp32; "
        'the metrics are merged under the mode\'s name ("int8", "bf16") in metrics.json (default %(default)s)',
    )
    p.add_argument(
        "--vmap",
        action="store_true",
        help="seq2seq: decode with the model's vocabulary map (its vmap.txt: python -m training build-vmap), to "
        'compare with the full vocabulary; its metrics are merged under "vmap" in metrics.json',
    )
    p.add_argument("--skip-malformed", action="store_true", help="skip malformed test lines (and report the count)")
    p.add_argument(
        "--metrics-key",
        default=None,
        metavar="KEY",
        help="merge the metrics into metrics.json as the entry KEY (e.g. test-heldout for the package-held-out "
        "split), replacing it, instead of at the top level where they replace the last test's",
    )
    p.set_defaults(func=_run)
