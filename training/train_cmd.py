"""`python -m training train {seq2seq,classifier,causal_lm}`: the command line (work in training.train_run).

Launch with `torchrun --nproc_per_node N -m training train ...` for DistributedDataParallel.
"""

from __future__ import annotations

import argparse

from training.arch import ARCH_PRESETS, ModelSizes
from training.options import (
    add_io_options,
    add_loop_options,
    positive_int,
    probability,
)
from training.runs import Loop, TrainRun, command

FAMILY_HELP = {
    "seq2seq": "encoder-decoder translation model (data: .tsv source<TAB>target or .jsonl)",
    "classifier": "BERT-style text classifier (data: .tsv text<TAB>label or .jsonl)",
    "causal_lm": "GPT-style language model (data: .txt/.py file or a directory of them)",
}
OUT_HELP = "best checkpoint directory; the resume state goes to <out>.state/"


SIZES = ModelSizes()  # the size flags' defaults


def _run(run: TrainRun) -> None:
    from training.train_run import train

    train(run)


def _model_options(parser: argparse.ArgumentParser, family: str) -> None:
    g = parser.add_argument_group("model")
    g.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="fine-tune every parameter of this checkpoint (ours, an imported one or a Hugging Face directory) "
        "instead of a new model: its config, tokenizer and labels are kept, so the other model flags are ignored "
        "and --tokenizer / --pretrain-mlm are refused; a --resume continues from the state, not from DIR",
    )
    g.add_argument(
        "--arch",
        choices=tuple(ARCH_PRESETS),
        default=SIZES.arch,
        help="paper: post-LN, sinusoidal, ReLU, scaled+tied embeddings; gpt2: learned positions, pre-LN, "
        "gelu_tanh; bert: learned positions, post-LN, GELU, embedding LayerNorm, eps 1e-12; "
        "llama (causal_lm only): pre-RMSNorm, rotary positions, SwiGLU, no biases, tied embeddings; "
        "default (the default): pre-LN, sinusoidal, ReLU, scaled+tied embeddings",
    )
    g.add_argument(
        "--layers",
        type=positive_int,
        metavar="N",
        default=SIZES.layers,
        help="layers (per stack for seq2seq; default %(default)s)",
    )
    if family == "seq2seq":
        g.add_argument(
            "--encoder-layers", type=positive_int, metavar="N", default=None, help="encoder layers (default --layers)"
        )
        g.add_argument(
            "--decoder-layers", type=positive_int, metavar="N", default=None, help="decoder layers (default --layers)"
        )
    g.add_argument(
        "--d-model", type=positive_int, metavar="N", default=SIZES.d_model, help="model width (default %(default)s)"
    )
    g.add_argument(
        "--heads", type=positive_int, metavar="N", default=SIZES.heads, help="attention heads (default %(default)s)"
    )
    if family == "causal_lm":
        g.add_argument(
            "--kv-heads",
            type=positive_int,
            metavar="N",
            default=None,
            help="grouped-query attention: key/value heads, dividing --heads (default --heads)",
        )
    g.add_argument(
        "--ffn", type=positive_int, metavar="N", default=SIZES.ffn, help="feed-forward width (default %(default)s)"
    )
    g.add_argument(
        "--vocab-size",
        type=positive_int,
        metavar="N",
        default=TrainRun.vocab_size,
        help="BPE vocabulary (default %(default)s)",
    )
    g.add_argument(
        "--max-len",
        type=positive_int,
        metavar="N",
        default=SIZES.max_len,
        help="longest sequence in tokens (default %(default)s)",
    )
    g.add_argument(
        "--dropout", type=probability, metavar="X", default=SIZES.dropout, help="dropout (default %(default)s)"
    )
    g.add_argument(
        "--tokenizer", default=None, metavar="FILE", help="reuse this tokenizer.json instead of training one"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `train` with one subcommand per model family."""
    parser = subparsers.add_parser("train", help="train a model", description="Train a model of one family.")
    families = parser.add_subparsers(dest="family", required=True, metavar="{seq2seq,classifier,causal_lm}")
    for family, help_text in FAMILY_HELP.items():
        p = families.add_parser(family, help=help_text, description=f"Train a {family} model: {help_text}.")
        add_io_options(p, OUT_HELP)
        _model_options(p, family)
        add_loop_options(p, Loop())
        if family == "classifier":
            g = p.add_argument_group("pre-training")
            g.add_argument(
                "--pretrain-mlm",
                default=None,
                metavar="TEXT_FILE",
                help="first pre-train with masked LM + sentence order on consecutive lines of this file",
            )
            g.add_argument(
                "--pretrain-steps",
                type=positive_int,
                metavar="N",
                default=TrainRun.pretrain_steps,
                help="pre-training steps (default %(default)s)",
            )
        p.set_defaults(func=command(TrainRun, _run))
