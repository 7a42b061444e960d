"""`python -m training lora`: the command line (work in training.lora_run)."""

from __future__ import annotations

import argparse

from training.options import add_io_options, add_loop_options, positive_float, positive_int, probability
from training.runs import LORA_LOOP, LORA_TARGETS, AdapterSpec, LoRARun, command

ADAPTER = AdapterSpec()  # the adapter flags' defaults


def target_list(value: str) -> tuple[str, ...]:
    names = [t.strip() for t in value.split(",") if t.strip()]
    unknown = sorted(set(names) - set(LORA_TARGETS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma list of {','.join(LORA_TARGETS)}; got {value!r}")
    return tuple(dict.fromkeys(names))


def _run(run: LoRARun) -> None:
    from training.lora_run import lora

    lora(run)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `lora`."""
    p = subparsers.add_parser(
        "lora",
        help="train a LoRA adapter on a frozen checkpoint",
        description="Train only a LoRA adapter on a frozen base checkpoint (its tokenizer is reused) and "
        "save it in the PEFT layout, with metrics.json comparing adapter and base on the valid split. On a "
        "Hugging Face base (GPT-2, a BERT classifier, OPUS-MT, Llama, Mistral, Qwen2/3, Gemma 3, Phi-3) the "
        "adapter is written in that model's module names: peft.PeftModel.from_pretrained loads it on the model "
        "(GPT-2's q/k/v adapters become one rank-3r LoRA on c_attn, Phi-3's one on qkv_proj; the gated "
        "feed-forward's gate, up and down projections are fc1, up and fc2).",
    )
    p.add_argument("--base", required=True, metavar="DIR",
                   help="base checkpoint directory: ours, or a Hugging Face model directory")
    add_io_options(p, "adapter directory (PEFT layout); the resume state goes to <out>.state/")
    g = p.add_argument_group("adapter")
    g.add_argument(
        "--rank", type=positive_int, metavar="N", default=ADAPTER.rank, help="LoRA rank r (default %(default)s)"
    )
    g.add_argument(
        "--alpha",
        type=positive_float,
        metavar="X",
        default=ADAPTER.alpha,
        help="LoRA alpha; scaling = alpha / r (default %(default)s)",
    )
    g.add_argument(
        "--dropout",
        type=probability,
        metavar="X",
        default=ADAPTER.dropout,
        help="dropout on the adapter input (default %(default)s)",
    )
    default_targets = ",".join(ADAPTER.targets)
    g.add_argument(
        "--targets",
        type=target_list,
        default=ADAPTER.targets,
        help=f"comma list of Linear names to adapt, from {','.join(LORA_TARGETS)} (default {default_targets})",
    )
    add_loop_options(p, LORA_LOOP)
    p.set_defaults(func=command(LoRARun, _run))
