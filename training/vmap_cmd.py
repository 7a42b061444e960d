"""`python -m training build-vmap`: a translation model's vocabulary map from its training pairs (model.vocab_map);
with ``--target-lang`` a multilingual model's map for one target language (vmaps/<code>.txt)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from training.errors import UserError
from training.options import positive_int
from training.runs import BuildVmapRun, command

if TYPE_CHECKING:
    from model.checkpoint import Checkpoint

SAMPLE = 1000  # training sources whose candidate counts the report averages


def _run(run: BuildVmapRun) -> None:
    from model.checkpoint import CheckpointError, checkpoint_vocabulary_map, load_checkpoint
    from model.vocab_map import build_vocabulary_map
    from training.tasks import TASKS, TaskOptions
    from training.tasks.base import TokenIds

    try:
        ckpt = load_checkpoint(run.model, device="cpu")
    except CheckpointError as e:
        raise UserError(f"--model: {e}") from e
    if ckpt.family != "seq2seq":
        raise UserError(f"--model: a vocabulary map is for seq2seq models; {run.model} is a {ckpt.family}")
    out, language = _destination(run, ckpt)
    if not run.train.is_file():
        raise UserError(f"--train: {run.train}: no such file")
    task = TASKS["seq2seq"](TaskOptions(skip_malformed=run.skip_malformed, ids=TokenIds.of(ckpt.config)))
    examples = task.encode(task.read(run.train).records, ckpt.tokenizer, ckpt.config, None, run.train,
                           ckpt.source_tokenizer)
    if not examples:
        raise UserError(f"--train: {run.train} holds no pairs")
    vmap = build_vocabulary_map(((e.source, e.target) for e in examples), run.per_token, run.always,
                                copy_source=ckpt.config.src_vocab_size is None)
    source, target = ckpt.src_tokenizer.id_to_token, ckpt.tokenizer.id_to_token
    out.parent.mkdir(exist_ok=True)
    out.write_text(vmap.dump(source, target), encoding="utf-8")
    loaded = checkpoint_vocabulary_map(load_checkpoint(run.model, device="cpu"))  # read back as the service will
    counts = [len(loaded.candidates_in(e.source, language)) for e in examples[:SAMPLE]]
    always = loaded.maps[language].always if run.target_lang else loaded.always
    report = {"vmap": str(out), "pairs": len(examples), "source_tokens": len(vmap.entries),
              "always": len(always), "vocab_size": ckpt.config.vocab_size,
              "mean_candidates": round(sum(counts) / len(counts), 1)}
    if run.target_lang:
        report["target_lang"] = run.target_lang
    sys.stdout.write(json.dumps(report, indent=2) + "\n")


def _destination(run: BuildVmapRun, ckpt: Checkpoint) -> tuple[Path, int | None]:
    """Where the map goes (vmap.txt, or with --target-lang vmaps/<code>.txt) and the target language's token."""
    from model.hf.languages import LanguageError
    from model.vocab_map import VMAP_FILE, VMAPS_DIR, language_map_path

    if run.target_lang is None:
        if (run.model / VMAPS_DIR).exists():
            raise UserError(f"--model: {run.model} keeps maps per target language ({VMAPS_DIR}/): name one with "
                            "--target-lang")
        return run.model / VMAP_FILE, None
    if ckpt.languages is None:
        raise UserError(f"--target-lang: {run.model} has no language codes (maps per target language are for "
                        "NLLB-200, M2M100 and mBART-50 models)")
    try:
        token = ckpt.languages.target_id(run.target_lang)
    except LanguageError as e:
        raise UserError(f"--target-lang: {e}") from None
    if (run.model / VMAP_FILE).exists():
        raise UserError(f"--target-lang: {run.model} holds {VMAP_FILE}, one map for every language; maps per "
                        f"target language replace it: remove it first")
    return language_map_path(run.model, run.target_lang), token


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `build-vmap`."""
    p = subparsers.add_parser(
        "build-vmap",
        help="write a translation model's vocabulary map (vmap.txt, or vmaps/CODE.txt per target language) from "
        "its training pairs",
        description="Count which target tokens appear with each source token in TRAIN's pairs and write the "
        "model's vmap.txt (CTranslate2's format): per source token its --per-token most associated target tokens "
        "(Dice's coefficient), and the --always most frequent target tokens for every source. The service then "
        "restricts each translation to its source's candidates (request field use_vmap); evaluate --vmap "
        "measures what it costs in BLEU. A multilingual model (NLLB-200, M2M100, mBART-50) keeps one map per "
        "target language: --target-lang CODE writes vmaps/CODE.txt from pairs into CODE. Prints a JSON report.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="translation (seq2seq) checkpoint; vmap.txt goes "
                   "into it")
    p.add_argument("--train", required=True, metavar="FILE", help="parallel training file (source<TAB>target)")
    p.add_argument("--per-token", type=positive_int, default=BuildVmapRun.per_token, metavar="N",
                   help="candidates per source token (default %(default)s)")
    p.add_argument("--always", type=positive_int, default=BuildVmapRun.always, metavar="N",
                   help="most frequent target tokens every source may use (default %(default)s)")
    p.add_argument("--target-lang", metavar="CODE", help="a multilingual model's target language (its code, as "
                   "target_lang names it): TRAIN's targets are in it, and the map goes to vmaps/CODE.txt, used for "
                   "the rows translating into CODE")
    p.add_argument("--skip-malformed", action="store_true", help="skip malformed lines of TRAIN")
    p.set_defaults(func=command(BuildVmapRun, _run))
