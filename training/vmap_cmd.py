"""`python -m training build-vmap`: a translation model's vocabulary map from its training pairs (model.vocab_map)."""

from __future__ import annotations

import argparse
import json
import sys

from training.errors import UserError
from training.options import positive_int
from training.runs import BuildVmapRun, command

SAMPLE = 1000  # training sources whose candidate counts the report averages


def _run(run: BuildVmapRun) -> None:
    from model.checkpoint import CheckpointError, checkpoint_vocabulary_map, load_checkpoint
    from model.vocab_map import VMAP_FILE, build_vocabulary_map
    from training.tasks import TASKS, TaskOptions
    from training.tasks.base import TokenIds

    try:
        ckpt = load_checkpoint(run.model, device="cpu")
    except CheckpointError as e:
        raise UserError(f"--model: {e}") from e
    if ckpt.family != "seq2seq":
        raise UserError(f"--model: a vocabulary map is for seq2seq models; {run.model} is a {ckpt.family}")
    if not run.train.is_file():
        raise UserError(f"--train: {run.train}: no such file")
    task = TASKS["seq2seq"](TaskOptions(skip_malformed=run.skip_malformed, ids=TokenIds.of(ckpt.config)))
    examples = task.encode(task.read(run.train).records, ckpt.tokenizer, ckpt.config, None, run.train,
                           ckpt.source_tokenizer)
    if not examples:
        raise UserError(f"--train: {run.train} holds no pairs")
    vmap = build_vocabulary_map(((e.source, e.target) for e in examples), run.per_token, run.always,
                                copy_source=ckpt.config.src_vocab_size is None)
    source, target = ckpt.src_tokenizer.backend.id_to_token, ckpt.tokenizer.backend.id_to_token
    (run.model / VMAP_FILE).write_text(vmap.dump(source, target), encoding="utf-8")
    loaded = checkpoint_vocabulary_map(load_checkpoint(run.model, device="cpu"))  # read back as the service will
    counts = [len(loaded.candidates(e.source)) for e in examples[:SAMPLE]]
    report = {"vmap": str(run.model / VMAP_FILE), "pairs": len(examples), "source_tokens": len(vmap.entries),
              "always": len(loaded.always), "vocab_size": ckpt.config.vocab_size,
              "mean_candidates": round(sum(counts) / len(counts), 1)}
    sys.stdout.write(json.dumps(report, indent=2) + "\n")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `build-vmap`."""
    p = subparsers.add_parser(
        "build-vmap",
        help="write a translation model's vocabulary map (vmap.txt) from its training pairs",
        description="Count which target tokens appear with each source token in TRAIN's pairs and write the "
        "model's vmap.txt (CTranslate2's format): per source token its --per-token most associated target tokens "
        "(Dice's coefficient), and the --always most frequent target tokens for every source. The service then "
        "restricts each translation to its source's candidates (request field use_vmap); evaluate --vmap "
        "measures what it costs in BLEU. Prints a JSON report.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="translation (seq2seq) checkpoint; vmap.txt goes "
                   "into it")
    p.add_argument("--train", required=True, metavar="FILE", help="parallel training file (source<TAB>target)")
    p.add_argument("--per-token", type=positive_int, default=BuildVmapRun.per_token, metavar="N",
                   help="candidates per source token (default %(default)s)")
    p.add_argument("--always", type=positive_int, default=BuildVmapRun.always, metavar="N",
                   help="most frequent target tokens every source may use (default %(default)s)")
    p.add_argument("--skip-malformed", action="store_true", help="skip malformed lines of TRAIN")
    p.set_defaults(func=command(BuildVmapRun, _run))
