"""`python -m training lora`: the command line (work in training.lora_run)."""

from __future__ import annotations

import argparse

from training.options import add_io_options, add_loop_options, positive_float, positive_int, probability

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,out_proj"


def target_list(value: str) -> list[str]:
    names = [t.strip() for t in value.split(",") if t.strip()]
    unknown = sorted(set(names) - set(LORA_TARGETS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma list of {','.join(LORA_TARGETS)}; got {value!r}")
    return list(dict.fromkeys(names))


def _run(args: argparse.Namespace) -> None:
    from training.lora_run import lora

    lora(args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `lora`."""
    p = subparsers.add_parser(
        "lora",
        help="train a LoRA adapter on a frozen checkpoint",
        description="Train only a LoRA adapter on a frozen base checkpoint (its tokenizer is reused) and "
        "save it in the PEFT layout, with metrics.json comparing adapter and base on the valid split. On a "
        "Hugging Face base (GPT-2, a BERT classifier, OPUS-MT) the adapter is written in that model's module "
        "names: peft.PeftModel.from_pretrained loads it on the model (GPT-2's q/k/v adapters become one "
        "rank-3r LoRA on c_attn).",
    )
    p.add_argument("--base", required=True, metavar="DIR",
                   help="base checkpoint directory: ours, or a Hugging Face model directory")
    add_io_options(p, "adapter directory (PEFT layout); the resume state goes to <out>.state/")
    g = p.add_argument_group("adapter")
    g.add_argument("--rank", type=positive_int, metavar="N", default=8, help="LoRA rank r (default %(default)s)")
    g.add_argument(
        "--alpha",
        type=positive_float,
        metavar="X",
        default=16.0,
        help="LoRA alpha; scaling = alpha / r (default %(default)s)",
    )
    g.add_argument(
        "--dropout",
        type=probability,
        metavar="X",
        default=0.0,
        help="dropout on the adapter input (default %(default)s)",
    )
    g.add_argument(
        "--targets",
        type=target_list,
        default=target_list(DEFAULT_TARGETS),
        help=f"comma list of Linear names to adapt, from {','.join(LORA_TARGETS)} (default {DEFAULT_TARGETS})",
    )
    add_loop_options(p, lr=1e-3, warmup=100)
    p.set_defaults(func=_run)
