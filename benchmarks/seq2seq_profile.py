"""Where ours' time goes in one seq2seq cell: `python -m benchmarks.seq2seq_profile --shape NAME [--beams 1]
[--batch 1] [--int8] [--repeats 3] [--pytorch-path]`.

A cell of benchmarks/shape_compare.py (32-token sources, 64 new tokens, the shape's forced first token), split into:
the encoder (``encode`` and the cross-attention K/V), the decoder steps (``start_from`` per source, then
``decode_step`` on batch x beams rows that read their source's K/V once, as the search's ``cache.select`` leaves
them), the output head alone (``logits`` of that many rows, once a step) and the rest
of ``generate_seq2seq`` (the search: top-k, beam bookkeeping, cache reordering, Python), each the median of
``--repeats`` runs on one thread count (``--threads``). Whether the decoder ran the C++ step (model.native_support)
or LayerStack.forward (``--pytorch-path`` forces it) is printed beside it, with each part's floor (bytes over the
bandwidth read now).
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
from model.checkpoint import load_checkpoint
from model.native_support import unsupported
from model.quantize import prepare_for_inference

SOURCE_TOKENS, NEW_TOKENS = 32, 64


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    """(part, seconds per cell, note) of ours on one cell."""
    files = shapes.build(args.shape, args.cache, tiny=args.tiny)
    checkpoint = load_checkpoint(files.hf, device="cpu")
    prepare_for_inference(checkpoint.model, "int8" if args.int8 else "none")
    model, forced, dims = checkpoint.model, forced_first_id(files), files.shape.dims
    if args.pytorch_path:  # the decoder through LayerStack.forward, as a model the C++ step lacks blocks of runs
        model.decoder.native = False
    inputs = random_ids(files.shape, args.batch, SOURCE_TOKENS, seed=args.batch)
    rows = args.batch * args.beams
    hidden = torch.randn(rows, dims.d_model)

    def steps() -> None:  # as the search runs them: the first step per source, then its beams on the source's K/V
        memory, mask, _ = model.encode(inputs)
        cache = model.new_cache(memory, mask, NEW_TOKENS + 1)
        tokens = torch.full((rows,), 5, dtype=torch.long)
        model.start_from(cache)
        cache.select(torch.arange(args.batch).repeat_interleave(args.beams))
        for _ in range(NEW_TOKENS - 1):
            model.decode_step(tokens, cache)

    def encoder(source: torch.Tensor) -> None:
        memory, mask, _ = model.encode(source)
        model.new_cache(memory, mask, NEW_TOKENS + 1)

    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        ours_tokens(checkpoint, inputs, args.beams, 4, forced)  # warm-up
        total = median_seconds(lambda: ours_tokens(checkpoint, inputs, args.beams, NEW_TOKENS, forced), args.repeats)
        encode = median_seconds(lambda: encoder(inputs), args.repeats)
        decode = median_seconds(steps, args.repeats) - encode
        head = NEW_TOKENS * median_seconds(lambda: model.logits(hidden), max(args.repeats, 10))
    width = 1 if args.int8 else 4
    step_bytes, head_bytes = floor.decoder_weights("seq2seq", dims) * width, dims.lm_head * width
    read = floor.BandwidthProbe([step_bytes - head_bytes, head_bytes], [args.threads])()  # bytes/s now
    layers_floor = NEW_TOKENS * (step_bytes - head_bytes) / read[step_bytes - head_bytes]
    head_floor = NEW_TOKENS * head_bytes / read[head_bytes]
    path = "the C++ decode step" if model.decoder.native else \
        f"LayerStack.forward (PyTorch; {', '.join(unsupported(model.config)) or '--pytorch-path'})"
    return [("whole cell (generate_seq2seq)", total, f"{args.batch * NEW_TOKENS / total:,.0f} tokens/s"),
            ("encoder + cross K/V", encode, ""),
            ("decoder layers, 64 steps", decode - head, f"{path}; weights' floor {layers_floor:.3f} s"),
            ("output head, 64 steps", head, f"{rows} rows x {dims.vocab:,}; floor {head_floor:.3f} s"),
            ("search, bookkeeping, Python", total - encode - decode, "the rest")]


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
