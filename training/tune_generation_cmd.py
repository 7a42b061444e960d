"""`python -m training tune-generation`: the command line (work in training.generation_tuning)."""

from __future__ import annotations

import argparse
import sys

from training.errors import UserError
from training.runs import TuneGenerationRun, command


def _run(run: TuneGenerationRun) -> None:
    from model.checkpoint import load_checkpoint
    from training.generation_tuning import table, tune, write_defaults

    if not run.valid.is_file():
        raise UserError(f"{run.valid}: valid text file not found")
    checkpoint = load_checkpoint(run.model, device="cpu")
    try:
        scores, chosen = tune(checkpoint, run.valid.read_text(encoding="utf-8"), run.prompts, run.prompt_tokens,
                              run.new_tokens)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    sys.stdout.write(table(scores, chosen, run.prompts) + "\n")
    if run.write:
        sys.stdout.write(f"wrote {write_defaults(run.model, chosen)}\n")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tune-generation`."""
    p = subparsers.add_parser(
        "tune-generation",
        help="choose a causal LM's repetition_penalty / no_repeat_ngram_size on its valid split",
        description="Complete windows of the valid text greedily under each repetition_penalty x "
        "no_repeat_ngram_size setting; report each setting's loop rate and chrF against the true continuations; "
        "choose the best chrF among the settings that at least halve the plain loop rate "
        "(training/generation_tuning.py). --write stores it in the checkpoint's generation_config.json, the "
        "model's defaults when served.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="causal LM checkpoint")
    p.add_argument("--valid", required=True, metavar="FILE", help="valid split text (e.g. data/code/valid.txt)")
    p.add_argument("--prompts", type=int, default=200, help="valid windows per setting (default 200)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each prompt (default 32)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens each completion makes (default 48)")
    p.add_argument("--write", action="store_true", help="write the chosen setting into generation_config.json")
    p.set_defaults(func=command(TuneGenerationRun, _run))
