"""The static decode step with and without CUDA graphs vs HF ``generate()`` eager and with a static cache + compile:
``python -m benchmarks.gpu_graphs --device cuda`` (scripts/gpu-check's graphs stage; issue 41).

Per shape (``gpt2-small``, ``opus-mt``, ``smollm2-135m``: random weights, HF layout, benchmarks/shapes.py) and batch
(1, 8, 64), greedy, ``--new-tokens`` new tokens after a ``--prompt``-token prompt (source), in ``--dtype``:

- ``ours``: model.generation as served today (eager decode steps);
- ``ours+graphs``: model.static_generation over one StaticDecoder per cell (captured on its first run);
- ``HF``: ``generate()`` eager (SDPA, dynamic cache);
- ``HF static``: ``generate(cache_implementation="static")``, which transformers compiles (torch.compile) on CUDA.

Each variant's first run (graph capture, compilation) is timed apart and reported; then the variants alternate
(benchmarks/cells.py), every run ending in a device synchronisation, medians. Before timing, the graphed tokens are
compared with the eager ones (bfloat16: reported, a tie may part them). ``--tiny --device cpu`` runs it all on toy
shapes (no capture, no compile): a dry run of the script.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from benchmarks import shapes
from benchmarks.cells import Cell, alternate, load
from benchmarks.common import markdown_table
from benchmarks.gpu_compare import DTYPES, load_pair, synchronized
from benchmarks.shape_engines import generation_config, hf_decode, hf_generate, ours_tokens, random_ids
from model.checkpoint import Checkpoint
from model.static_generation import generate_causal_static, generate_seq2seq_static
from model.static_step import StaticDecoder

logger = logging.getLogger("benchmarks.gpu_graphs")

SHAPES = ("gpt2-small", "opus-mt", "smollm2-135m")
BATCHES = (1, 8, 64)
ENGINES = ("ours", "ours+graphs", "HF", "HF static")


def _static_run(ours: Checkpoint, inputs: torch.Tensor, new_tokens: int, graphs: bool):
    """A runner of ours through one StaticDecoder (built here, captured on the first run) and its tokens' reader."""
    config = generation_config(ours, 1, new_tokens)
    rows, length = inputs.shape
    seq2seq = ours.family == "seq2seq"
    decoder = StaticDecoder(ours.model, rows=rows, capacity=new_tokens + (1 if seq2seq else length), graphs=graphs,
                            source_capacity=length if seq2seq else None)
    generate = generate_seq2seq_static if seq2seq else generate_causal_static

    def tokens() -> list[list[int]]:
        return [h[0].tokens for h in generate(ours.model, decoder, inputs.tolist(), config)]

    return (lambda: [len(t) for t in tokens()]), tokens, decoder


def _cell(spec: shapes.Shape, ours: Checkpoint, hf: torch.nn.Module, batch: int, length: int, new_tokens: int,
          repeats: int, device: torch.device, dtype_name: str) -> tuple[Cell, dict[str, float], str]:
    """One cell: (its medians, each engine's first run in seconds, the graphs-vs-eager check)."""
    inputs = random_ids(spec, batch, length, seed=batch).to(device)
    graphs = device.type == "cuda"
    static, static_tokens, decoder = _static_run(ours, inputs, new_tokens, graphs)
    runs = {"ours": lambda: [len(t) for t in ours_tokens(ours, inputs, 1, new_tokens)],
            "ours+graphs": static,
            "HF": hf_decode(hf, inputs, 1, new_tokens),
            "HF static": lambda: [new_tokens] * hf_generate(hf, inputs, 1, new_tokens,
                                                            cache_implementation="static").shape[0]}
    first, failed = {}, []
    for engine, run in list(runs.items()):  # first runs: capture, compilation; a variant that fails is left out
        start = time.perf_counter()
        try:
            synchronized(run, device)()
        except Exception as exc:  # noqa: BLE001 (reported in the table: one failure must not end the GPU run)
            logger.exception("%s failed at batch %d", engine, batch)
            failed.append(f"{engine} failed: {type(exc).__name__}: {str(exc)[:120]}")
            del runs[engine]
            continue
        first[engine] = time.perf_counter() - start
    if "ours+graphs" in runs:
        same = sum(a == b for a, b in zip(static_tokens(), ours_tokens(ours, inputs, 1, new_tokens), strict=True))
        failed.insert(0, f"{same}/{batch} rows equal to eager")
    cell = Cell(f"{spec.name} {dtype_name}", "greedy", batch, 1, batch * new_tokens, length=length)
    variants = {f"{engine}@{torch.get_num_threads()}": (torch.get_num_threads(), synchronized(run, device))
                for engine, run in runs.items()}
    logger.info("%s: batch %d (%s)", cell.family, batch, load())
    alternate(cell, variants, new_tokens, repeats, prune=1e9)
    failed.append(f"runners {decoder.built}, {decoder.captured} captured" if graphs else "eager (no CUDA)")
    return cell, first, "; ".join(failed)


def run(args: argparse.Namespace) -> str:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = [f"Device: {gpu}; torch {torch.__version__}; {args.dtype}; started {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    rows, checks = [], []
    for name in args.shapes:
        files = shapes.build(name, args.cache, args.tiny)
        ours, hf = load_pair(files, device, dtype)
        for batch in args.batches:
            cell, first, check = _cell(files.shape, ours, hf, batch, args.prompt, args.new_tokens, args.repeats, device,
                                       args.dtype)
            checks.append([name, batch, check, *[f"{first[e]:.1f}" if e in first else "-" for e in ENGINES]])
            step_ms = {v.rsplit("@", 1)[0]: s / args.new_tokens * 1e3 for v, s in cell.seconds.items()}
            ratios = [f"{step_ms[peer] / step_ms['ours+graphs']:.2f}x" if {peer, "ours+graphs"} <= step_ms.keys()
                      else "-" for peer in ("HF", "HF static")]
            rows.append([name, batch, *[f"{step_ms[e]:.3f}" if e in step_ms else "-" for e in ENGINES], *ratios])
            if args.out is not None:  # what is measured so far survives a timeout
                args.out.write_text(_report(out, checks, rows, args) + "\n")
        del ours, hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return _report(out, checks, rows, args) + f"\n\nEnd: {time.strftime('%Y-%m-%d %H:%M:%S')}"


def _report(head: list[str], checks: list[list], rows: list[list], args: argparse.Namespace) -> str:
    return "\n".join([
        *head, "", "### Graphed tokens vs eager, and each variant's first run in seconds (capture, compile)", "",
        markdown_table(["shape", "batch", "graphs vs eager", *[f"{e} first s" for e in ENGINES]], checks), "",
        f"### Milliseconds per decoding step (a run's time / {args.new_tokens} new tokens, greedy, "
        f"{args.prompt}-token prompts, prefill included; median of {args.repeats} alternating runs)", "",
        markdown_table(["shape", "batch", *[f"{e} ms" for e in ENGINES], "graphs vs HF", "graphs vs HF static"],
                       rows)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(shapes.SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="toy shapes (a dry run)")
    parser.add_argument("--cache", type=Path, default=shapes.DEFAULT_CACHE)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = run(args)
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
