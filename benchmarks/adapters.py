"""Decoding with LoRA adapters in the model library: `python -m benchmarks.adapters` (or `make bench-adapters`).

The issue's causal_lm shape (d_model 512, 6 layers, 8 heads, ffn 2048, vocab 8000), random weights in the
service's input-major layout, 8 random adapters (rank 8, alpha 16, q/k/v/out_proj, B ~ N(0, 0.02^2)).
Greedy generation of exactly ``--new-tokens`` tokens after a 16-token prompt, rows selecting no adapter,
one adapter, or the 8 adapters mixed (row i takes adapter i mod 8); each with our C++ decoding kernels on
(the native step adding the adapters' deltas) and off (``TSERVE_DECODE_KERNELS=off``, here
``model.native.using_options(decode_kernels=False)``: PyTorch ops, the Python replay). Arms alternate in
rotating order within each cell; medians and ratios are printed.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import machine_line, markdown_table
from benchmarks.peers import decoding_config, random_ids, random_models
from model import native
from model.generation import generate_causal
from model.layout import use_input_major_weights
from model.lora import AdapterSelection, LoRAConfig, LoRALinear, add_adapter

ADAPTERS = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def adapted_model() -> torch.nn.Module:
    """The causal model with ADAPTERS random adapters whose B is nonzero (so each changes the outputs)."""
    model = random_models()[0]
    for i in range(ADAPTERS):
        add_adapter(model, f"a{i}", LoRAConfig(r=8, lora_alpha=16, target_modules=TARGETS), seed=i)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if type(module) is LoRALinear:
                for b in module.lora_B.values():
                    b.weight.copy_(torch.randn(b.weight.shape, generator=generator) * 0.02)
    use_input_major_weights(model)  # as the service loads models (adapters included)
    return model


def _with_kernels(on: bool, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with native.using_options(decode_kernels=on):
            return fn()

    return run


def measure(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per arm over ``repeats`` rounds after one warm-up round, arms in rotating order."""
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(repeats + 1):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            start = time.perf_counter()
            arms[name]()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def run(args: argparse.Namespace) -> str:
    model = adapted_model()
    config = decoding_config(1, args.new_tokens)
    rows = []
    for batch in args.batches:
        prompts = random_ids(batch, 16).tolist()
        selections: dict[str, AdapterSelection] = {"one adapter": "a0"}
        if batch > 1:
            selections[f"{ADAPTERS} adapters mixed"] = [f"a{i % ADAPTERS}" for i in range(batch)]
        for label, selection in selections.items():
            arms = {}
            for on in (True, False):
                kernels = "on" if on else "off"
                arms[f"base {kernels}"] = _with_kernels(on, lambda p=prompts: generate_causal(model, p, config))
                arms[f"adapters {kernels}"] = _with_kernels(
                    on, lambda p=prompts, s=selection: generate_causal(model, p, config, adapters=s))
            seconds = measure(arms, args.repeats)
            rate = {name: batch * args.new_tokens / s for name, s in seconds.items()}
            rows.append([batch, label, f"{rate['base on']:,.0f}", f"{rate['adapters on']:,.0f}",
                         f"{rate['base off']:,.0f}", f"{rate['adapters off']:,.0f}",
                         f"{rate['adapters on'] / rate['base on']:.0%}",
                         f"{rate['adapters on'] / rate['adapters off']:.2f}x"])
            logging.info("batch %d, %s: %s", batch, label, rows[-1][2:])
    kernels = "yes" if native.kernels() is not None else "no (both sides use PyTorch ops)"
    lines = [
        f"Machine: {machine_line()}",
        f"Config: causal_lm d_model 512, 6 layers, 8 heads, ffn 2048, vocab 8000, fp32 input-major; {ADAPTERS} "
        f"random adapters, rank 8, alpha 16, on {'/'.join(TARGETS)}; greedy, prompt 16, {args.new_tokens} new "
        f"tokens; median of {args.repeats} alternating rounds after 1 warm-up; C++ kernels here: {kernels}",
        "",
        markdown_table(["batch", "rows select", "no adapter, kernels on: tok/s", "adapters, kernels on: tok/s",
                        "no adapter, kernels off: tok/s", "adapters, kernels off: tok/s",
                        "adapters / no adapter (on)", "adapters on / off"], rows),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("model.attention").setLevel(logging.WARNING)  # "kernels off" each time they are
    torch.set_num_threads(args.threads)
    print(run(args))


if __name__ == "__main__":
    main()
