"""Command-line options shared by `train` and `lora` (argparse only: no torch import, so --help is fast).

The flags' defaults are the defaults of the typed runs (training.runs), written there once.
"""

from __future__ import annotations

import argparse
import math

from training.runs import DEVICE, Loop


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return n


def non_negative_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return n


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return x


def non_negative_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}") from None
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return x


def probability(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value!r}") from None
    if not 0.0 <= x < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value}")
    return x


def add_io_options(parser: argparse.ArgumentParser, out_help: str) -> None:
    """--train, --valid, --out and --skip-malformed (training.runs.Data)."""
    parser.add_argument(
        "--train", required=True, metavar="FILE", help="training data file (or directory for causal_lm)"
    )
    parser.add_argument("--valid", required=True, metavar="FILE", help="validation data file (same format as --train)")
    parser.add_argument("--out", required=True, metavar="DIR", help=out_help)
    parser.add_argument(
        "--skip-malformed", action="store_true", help="skip malformed data lines (and report the count)"
    )


def add_loop_options(parser: argparse.ArgumentParser, loop: Loop) -> None:
    """Optimisation, schedule, checkpointing and device flags, with ``loop``'s values as their defaults."""
    g = parser.add_argument_group("training loop")
    g.add_argument(
        "--max-steps",
        type=positive_int,
        metavar="N",
        default=loop.max_steps,
        help="optimizer steps in all (default %(default)s)",
    )
    g.add_argument(
        "--max-minutes",
        type=positive_float,
        metavar="X",
        default=loop.max_minutes,
        help="stop this run after N minutes",
    )
    g.add_argument(
        "--batch-tokens",
        type=positive_int,
        metavar="N",
        default=loop.batch_tokens,
        help="padded tokens per batch and process (default %(default)s)",
    )
    g.add_argument(
        "--accum-steps",
        type=positive_int,
        metavar="N",
        default=loop.accum_steps,
        help="batches per step (default %(default)s)",
    )
    g.add_argument(
        "--lr", type=positive_float, metavar="X", default=loop.lr, help="peak learning rate (default %(default)s)"
    )
    g.add_argument(
        "--warmup",
        type=positive_int,
        metavar="N",
        default=loop.warmup,
        help="linear warm-up steps (default %(default)s)",
    )
    g.add_argument(
        "--label-smoothing",
        type=probability,
        metavar="X",
        default=loop.label_smoothing,
        help="label smoothing (default 0.1 for seq2seq, 0 otherwise)",
    )
    g.add_argument(
        "--clip-norm",
        type=non_negative_float,
        metavar="X",
        default=loop.clip_norm,
        help="max gradient norm; 0 disables (default %(default)s)",
    )
    g.add_argument(
        "--seed", type=non_negative_int, metavar="N", default=loop.seed, help="random seed (default %(default)s)"
    )
    g.add_argument("--resume", action="store_true", help="continue from the last saved state in <out>.state/")
    g.add_argument("--device", default=DEVICE, help="auto, cpu, cuda or cuda:N (default %(default)s)")
    g.add_argument(
        "--eval-every",
        type=positive_int,
        metavar="N",
        default=loop.eval_every,
        help="validate every N steps (default %(default)s)",
    )
    g.add_argument(
        "--save-every",
        type=positive_int,
        metavar="N",
        default=loop.save_every,
        help="save the state every N steps (default %(default)s)",
    )
    g.add_argument(
        "--valid-examples",
        type=positive_int,
        metavar="N",
        default=loop.valid_examples,
        help="validation examples decoded for BLEU during seq2seq training (default %(default)s)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar (progress lines are logged instead)")
