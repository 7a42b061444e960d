"""The panel GEMM under each CPU's rule, on this machine: `python -m benchmarks.cpu_rules`.

model/cpu.py picks the panel GEMM's blocking and prefetch rule from what the CPU reports (its vendor, its L2). This
times every vendor's rule here, alternating in rotating order within one process, so a run on a machine says
whether the rule chosen for it is the fastest one there (on an AVX-512 CPU, also its rule in AVX2's 256-bit tiles):
- streaming: 1- and 4-row GEMVs over a stack of GPT-2 small's 12 layers' weights (340 MB, past any L3; a decoding
  step at batch 1 and beam 4 of one source), in GB/s of weights read, beside ``torch.sum`` over the same bytes;
- wide tiles and blocking: 16, 64 and 4,096 rows through 768 -> 3072 (a BERT forward's FFN), in GFLOP/s;
- with ``--generate SHAPE ...`` (benchmarks/shapes.py: opus-mt, gpt2-small): ours' float32 greedy and beam 4
  generation of 64 tokens at batch 1 on that shape, in tokens/s.
Outputs of every rule are checked first: products against a float64 reference, generated tokens equal under every
rule. Medians of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks import shapes
from benchmarks.common import machine_line, markdown_table
from benchmarks.shape_engines import ours_tokens, random_ids
from model import native
from model.checkpoint import load_checkpoint
from model.cpu import AMD, INTEL, CpuInfo, PanelTuning, kernel_tuning, this_cpu
from model.quantize import prepare_for_inference

GPT2_LAYER = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]  # (in, out): q, k, v, out, fc1, fc2
WIDE_ROWS = [16, 64, 4096]  # rows through 768 -> 3072


def rules() -> dict[str, PanelTuning]:
    """This CPU's rule and each vendor's, as model/cpu.py would choose it with this machine's L2."""
    here = this_cpu()
    named = {"this CPU's": kernel_tuning(here)}
    for label, vendor in (("AMD's", AMD), ("Intel's", INTEL)):
        named[label] = kernel_tuning(CpuInfo(vendor=vendor, model_name="", l2_bytes=here.l2_bytes))
    kernel = native.kernels()
    if kernel is not None and kernel.has_avx512():  # AVX2's tiles, as a CPU without AVX-512 runs them
        named["this CPU's at 256 bits"] = replace(named["this CPU's"], vector_bits=256)
    return named


def _seconds_per_call(fn: Callable[[], object], repeats: int) -> float:
    """Mean seconds per call over ``repeats`` calls in a row."""
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per rule and cell")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads")
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 small layers the streaming cells walk")
    parser.add_argument("--rows", type=int, nargs="+", default=WIDE_ROWS, help="rows of the wide cells")
    parser.add_argument("--generate", nargs="*", default=[], choices=["opus-mt", "gpt2-small"],
                        help="shapes whose batch-1 generation is timed too")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each generation makes")
    parser.add_argument("--cache", type=Path, default=shapes.DEFAULT_CACHE, help="where the shapes' files are kept")
    parser.add_argument("--tiny", action="store_true", help="the shapes at toy sizes (the test's)")
    args = parser.parse_args(argv)
    kernel = native.kernels()
    if kernel is None:
        raise SystemExit("the C++ kernels do not run here: nothing to compare")
    torch.set_num_threads(args.threads)
    named = rules()
    with torch.no_grad():
        table = _compare(kernel, named, args)
    print()
    print("GB/s of weights read (streaming), GFLOP/s (wide) or tokens/s (generation), medians; each rule's rate "
          "against this CPU's")
    print(markdown_table(["cell", *(f"{label} rule" for label in named), "torch.sum GB/s"], table))


Cells = dict[str, tuple[Callable[[], object], float, str]]  # name -> (call, work per call, unit)


def _checked_cells(kernel, named: dict[str, PanelTuning], args: argparse.Namespace) -> tuple[Cells, int]:
    """The cells to time, each rule's product checked against float64 first; and the streaming cells' bytes."""
    generator = torch.Generator().manual_seed(0)

    def check(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> None:
        for rule in named.values():
            native.apply_tuning(kernel, rule)
            torch.testing.assert_close(kernel.packed_linear(x, packed, weight.size(0), None).double(),
                                       x.double() @ weight.double().t(), atol=1e-4, rtol=1e-5)

    weights = [torch.randn(n_out, n_in, generator=generator) / n_in**0.5
               for _ in range(args.layers) for n_in, n_out in GPT2_LAYER]
    stack = [(kernel.pack_weight(w), w.size(0)) for w in weights]
    stack_bytes = sum(packed.numel() * 4 for packed, _ in stack)
    cells: Cells = {}
    for rows in (1, 4):
        inputs = {n_in: torch.randn(rows, n_in, generator=generator) for n_in in (768, 3072)}

        def walk(inputs=inputs) -> None:
            for packed, n in stack:
                kernel.packed_linear(inputs[packed.size(1)], packed, n, None)

        check(inputs[768], stack[4][0], weights[4])  # fc1
        cells[f"streaming, {rows} row{'s' * (rows > 1)}"] = (walk, stack_bytes / 1e9, "GB/s")
    for rows in args.rows:
        weight = torch.randn(3072, 768, generator=generator) / 768**0.5
        packed, x = kernel.pack_weight(weight), torch.randn(rows, 768, generator=generator)
        check(x, packed, weight)
        cells[f"{rows} rows, 768 -> 3072"] = (lambda x=x, packed=packed: kernel.packed_linear(x, packed, 3072, None),
                                             2 * rows * 768 * 3072 / 1e9, "GFLOP/s")
    for name in args.generate:
        cells |= _generation_cells(kernel, named, name, args)
    return cells, stack_bytes


def _generation_cells(kernel, named: dict[str, PanelTuning], name: str, args: argparse.Namespace) -> Cells:
    """Ours' float32 greedy and beam 4 generation at batch 1 on a shape, the same tokens under every rule."""
    files = shapes.build(name, args.cache, args.tiny)
    checkpoint = load_checkpoint(files.hf, device="cpu")
    prepare_for_inference(checkpoint.model, "none")  # as the service loads a model
    ids = random_ids(files.shape, 1, 32 if files.shape.family == "seq2seq" else 16, seed=0)
    cells: Cells = {}
    for beams in (1, 4):
        def generate(beams=beams) -> list[list[int]]:
            return ours_tokens(checkpoint, ids, beams, args.new_tokens)

        tokens = []
        for rule in named.values():
            native.apply_tuning(kernel, rule)
            tokens.append(generate())
        if any(t != tokens[0] for t in tokens):
            raise AssertionError(f"{name}: the rules generated different tokens")
        cells[f"{name} {'greedy' if beams == 1 else 'beam 4'} b1"] = (generate, args.new_tokens, "tok/s")
    return cells


def _compare(kernel, named: dict[str, PanelTuning], args: argparse.Namespace) -> list[list[str]]:
    """Check, then time every cell under every rule, the rules in rotating order; the table's rows."""
    print(machine_line())
    print(f"CPU report: {this_cpu()}")
    for label, rule in named.items():
        print(f"{label} rule: {asdict(rule)}")
    labels, table = list(named), []
    try:
        cells, stack_bytes = _checked_cells(kernel, named, args)
        flat = torch.ones(stack_bytes // 4)
        for cell, (call, work, unit) in cells.items():
            repeats = max(1, int(0.2 / max(_seconds_per_call(call, 1), 1e-6)))
            times: dict[str, list[float]] = {label: [] for label in named}
            sums = []
            for i in range(args.rounds):
                for label in labels[i % len(labels):] + labels[:i % len(labels)]:
                    native.apply_tuning(kernel, named[label])
                    times[label].append(_seconds_per_call(call, repeats))
                if unit == "GB/s":
                    sums.append(_seconds_per_call(flat.sum, repeats))
            rate = {label: work / statistics.median(ts) for label, ts in times.items()}
            row = [cell] + [f"{rate[label]:.1f} ({rate[label] / rate[labels[0]]:.2f}x)" for label in labels]
            table.append(row + [f"{stack_bytes / 1e9 / statistics.median(sums):.1f}" if sums else "-"])
            print(" | ".join(table[-1]), flush=True)
    finally:
        native.apply_tuning(kernel, named[labels[0]])
    return table


if __name__ == "__main__":
    main()
