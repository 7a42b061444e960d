"""`python -m training baselines`: the command line (work in training.baselines)."""

from __future__ import annotations

import argparse
import json
import sys

from training.runs import BaselinesRun, command


def _run(run: BaselinesRun) -> None:
    from training.baselines import baselines_for
    from training.state import write_json

    result = baselines_for(run.model, run.train, run.test, langdetect=run.langdetect)
    if run.out:
        write_json(run.out, result)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `baselines`."""
    p = subparsers.add_parser(
        "baselines",
        help="score trivial baselines on a model's test file",
        description="Score the trivial baselines of the checkpoint's family on a test file: copying the source "
        "(BLEU, chrF; seq2seq), the train split's majority class and langdetect (accuracy, macro-F1; "
        "classifier), an add-one unigram over the checkpoint's tokenizer fitted on --train (perplexity; "
        "causal_lm).",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint: its family, tokenizer and labels")
    p.add_argument("--train", required=True, metavar="FILE", help="train split the learned baselines are fitted on")
    p.add_argument("--test", required=True, metavar="FILE", help="test split (or directory for causal_lm)")
    p.add_argument(
        "--no-langdetect", dest="langdetect", action="store_false", help="skip the langdetect baseline (classifier)"
    )
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    p.set_defaults(func=command(BaselinesRun, _run))
