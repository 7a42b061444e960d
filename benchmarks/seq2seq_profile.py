"""Where ours' time goes in one seq2seq cell: `python -m benchmarks.seq2seq_profile --shape NAME [--beams 1]
[--batch 1] [--int8] [--repeats 3] [--pytorch-path]`.

A cell of benchmarks/shape_compare.py (32-token sources, 64 new tokens, the shape's forced first token), split into:
the encoder (``encode`` and the cross-attention K/V), the decoder steps (``decode_step`` less its head: the decoder's
layers and the step's Python), the output head (``logits``), the search's top-k and beam bookkeeping (``advance``) and
within it its pass over the logits (the C++ top-k or greedy pick: ``fused_beam_top_k``, ``greedy_choice``), the cache
reorder of the beams that moved (``KVCache.select``) and the rest (the search loop's Python), each timed within the
cell where the search runs it, the median of ``--repeats`` runs on one thread count (``--threads``).
Whether the decoder ran the C++ step (model.native_support) or LayerStack.forward (``--pytorch-path`` forces it) is
printed beside it, with each part's floor (bytes over the bandwidth read now).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import floor, shapes
from benchmarks.shape_engines import forced_first_id, ours_tokens, random_ids
from model import beam_search, decoding
from model.beam_search import BeamSearch
from model.checkpoint import load_checkpoint
from model.decoding import GreedySearch
from model.kv_cache import KVCache
from model.native_support import unsupported
from model.quantize import prepare_for_inference
from model.seq2seq import Seq2SeqTransformer

SOURCE_TOKENS, NEW_TOKENS = 32, 64


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Stopwatch:
    """Seconds spent in some methods while active, per name: each wrapped on its owner (a class, or an instance that
    then shadows its class's method) on entry and restored on exit; nested calls count in each of theirs."""

    def __init__(self, targets: dict[str, tuple[object, str]]) -> None:
        self.targets = targets
        self.seconds = dict.fromkeys(targets, 0.0)
        self._saved: list[tuple[object, str, object]] = []

    def _timed(self, key: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
        return timed

    def __enter__(self) -> Stopwatch:
        for key, (owner, name) in self.targets.items():
            self._saved.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, self._timed(key, getattr(owner, name)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, own in reversed(self._saved):
            if own is None:  # an instance's shadow of its class's method
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._saved.clear()


def cell_parts(model: Seq2SeqTransformer, run: Callable[[], object], repeats: int) -> dict[str, float]:
    """Each part's median seconds over ``repeats`` cells, timed where the search runs them (the output head after
    the step's decoder weights, as the head alone timed hot is not: 0.33 against 0.78 ms a 4-row int8 step of
    Flan-T5-base, its 24.7 MB read from the last-level cache; helper T, session 29)."""
    targets = {"encode": (model, "encode"), "cross": (model, "new_cache"), "step": (model, "decode_step"),
               "head": (model, "logits"), "advance": (BeamSearch, "advance"), "greedy": (GreedySearch, "advance"),
               "select": (KVCache, "select"), "topk": (beam_search, "fused_beam_top_k"),
               "pick": (decoding, "greedy_choice")}
    runs = []
    for _ in range(repeats):
        with Stopwatch(targets) as watch:
            start = time.perf_counter()
            run()
            cell = time.perf_counter() - start
        parts = watch.seconds
        within = ("head", "topk", "pick")  # inside the step and the search's advance
        parts["rest"] = cell - sum(parts[k] for k in targets if k not in within)
        runs.append(parts)
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def profile(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    """(part, seconds per cell, note) of ours on one cell."""
    torch.set_num_threads(args.threads)  # before loading too: a profile of the whole process then shows no other thread
    files = shapes.build(args.shape, args.cache, tiny=args.tiny)
    checkpoint = load_checkpoint(files.hf, device="cpu")
    prepare_for_inference(checkpoint.model, "int8" if args.int8 else "none")
    model, forced, dims = checkpoint.model, forced_first_id(files), files.shape.dims
    if args.pytorch_path:  # the decoder through LayerStack.forward, as a model the C++ step lacks blocks of runs
        model.decoder.native = False
    inputs = random_ids(files.shape, args.batch, SOURCE_TOKENS, seed=args.batch)
    rows = args.batch * args.beams

    def cell() -> None:
        ours_tokens(checkpoint, inputs, args.beams, NEW_TOKENS, forced)

    with torch.inference_mode():
        ours_tokens(checkpoint, inputs, args.beams, 4, forced)  # warm-up
        total = median_seconds(cell, args.repeats)
        parts = cell_parts(model, cell, args.repeats)
    width = 1 if args.int8 else 4
    step_bytes, head_bytes = floor.decoder_weights("seq2seq", dims) * width, dims.lm_head * width
    read = floor.BandwidthProbe([step_bytes - head_bytes, head_bytes], [args.threads])()  # bytes/s now
    layers_floor = NEW_TOKENS * (step_bytes - head_bytes) / read[step_bytes - head_bytes]
    head_floor = NEW_TOKENS * head_bytes / read[head_bytes]
    path = "the C++ decode step" if model.decoder.native else \
        f"LayerStack.forward (PyTorch; {', '.join(unsupported(model.config)) or '--pytorch-path'})"
    return [("whole cell (generate_seq2seq)", total, f"{args.batch * NEW_TOKENS / total:,.0f} tokens/s"),
            ("encoder + cross K/V", parts["encode"] + parts["cross"], ""),
            ("decoder layers, 64 steps", parts["step"] - parts["head"],
             f"{path} and the step's Python (embedding, masks); weights' floor {layers_floor:.3f} s"),
            ("output head, 64 steps", parts["head"], f"{rows} rows x {dims.vocab:,}; floor {head_floor:.3f} s"),
            ("search: top-k, beams", parts["advance"] + parts["greedy"], "Search.advance"),
            ("of which the logits' pass", parts["topk"] + parts["pick"], "the C++ top-k or greedy pick"),
            ("cache reorder", parts["select"], "KVCache.select of the beams that moved"),
            ("the rest", parts["rest"], "the search loop's Python")]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[n for n, s in shapes.SHAPES.items() if s.family == "seq2seq"],
                        required=True)
    parser.add_argument("--beams", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--pytorch-path", action="store_true", help="the decoder through LayerStack.forward")
    parser.add_argument("--tiny", action="store_true", help="the shape at toy sizes (a smoke run)")
    parser.add_argument("--cache", type=Path, default=shapes.DEFAULT_CACHE, help="where the shapes' files are kept")
    args = parser.parse_args(argv)
    parts = profile(args)
    label = f"{args.shape} {'int8' if args.int8 else 'fp32'} {'greedy' if args.beams == 1 else f'beam {args.beams}'}"
    lines = [f"{label} b{args.batch}, {args.threads} threads", "", "| part | seconds | share | note |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {s:.3f} | {s / parts[0][1]:.0%} | {note} |" for name, s, note in parts]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
