"""Ours vs Hugging Face on a GPU, on the shapes people serve: `python -m benchmarks.compare --device cuda`.

The shapes of benchmarks/shapes.py (random weights, HF layout, the same files for both engines): ``gpt2-small``
(greedy at batch 1, 8, 32, 128 and beam 4 at batch 1; 16-token prompts, 128 new tokens), ``opus-mt`` (greedy at
batch 1, 16, 64 and beam 4 at batch 1, 16; 32-token sources, 64 new tokens) and ``bert-base`` (one forward at
lengths 16, 64, 256 and batch 1, 8, 64), in each dtype of ``--dtypes`` (float32 and bfloat16 by default). Ours:
``load_checkpoint(..., device, dtype)`` as the service loads it; HF: ``from_pretrained(..., dtype)`` on the
device, ``generate()`` with its default attention (SDPA). CTranslate2 and ONNX Runtime are CPU peers here.

Before timing, each dtype's outputs are compared with HF's on the GPU (greedy tokens on three inputs up to
ties, classifier logits relative to their scale); a float32 engine that disagrees is reported and not timed.
Timing: both engines alternate after a warm-up (benchmarks/cells.py), every run ends in a device
synchronisation (its outputs are read back), medians. The floor of a batch-1 decoding step is the model's
weights read once over the device's measured read bandwidth: the report gives each engine's milliseconds
per step against it, the share of a step that is kernel launches and Python on a GPU at batch 1.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from benchmarks import floor, shapes
from benchmarks.cells import Cell, alternate, load
from benchmarks.common import markdown_table
from benchmarks.shape_engines import (
    TIE,
    divergence,
    hf_decode,
    hf_greedy_reference,
    hf_logits,
    ours_decode,
    ours_tokens,
    random_ids,
)
from model.checkpoint import Checkpoint, load_checkpoint
from model.quantize import prepare_for_inference

logger = logging.getLogger("benchmarks.gpu_compare")

SHAPES = ("gpt2-small", "opus-mt", "bert-base")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (beams, batch) of decoding, (length, batch) of the classifier; prompt / source tokens, new tokens
GRIDS = {
    "gpt2-small": ([(1, 1), (1, 8), (1, 32), (1, 128), (4, 1)], 16, 128),
    "opus-mt": ([(1, 1), (1, 16), (1, 64), (4, 1), (4, 16)], 32, 64),
    "bert-base": ([(n, b) for n in (16, 64, 256) for b in (1, 8, 64)], 0, 0),
}
QUICK = {"gpt2-small": [(1, 1), (1, 32), (4, 1)], "opus-mt": [(1, 1), (1, 16), (4, 1)],
         "bert-base": [(16, 1), (64, 8), (256, 64)]}
TINY = {"gpt2-small": ([(1, 1), (4, 2)], 8, 4), "opus-mt": ([(1, 1), (4, 2)], 8, 4),
        "bert-base": ([(16, 1), (16, 4)], 0, 0)}
LOGITS_RTOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
MIN_TOKENS_PER_RUN = 4096  # a classifier run repeats its forward until it has seen this many tokens


def synchronized(run, device: torch.device):
    """``run`` followed by a wait for the device's queued work: a timed run ends when its kernels do."""
    def wrapped():
        out = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    return wrapped


def load_pair(files: shapes.ShapeFiles, device: torch.device, dtype: torch.dtype) -> tuple[Checkpoint, torch.nn.Module]:
    import transformers

    ours = load_checkpoint(files.hf, device=device, dtype=dtype)
    prepare_for_inference(ours.model, "none")  # as the service loads a model
    hf = getattr(transformers, files.shape.architecture).from_pretrained(files.hf, dtype=dtype).to(device).eval()
    return ours, hf


def check(files: shapes.ShapeFiles, ours: Checkpoint, hf: torch.nn.Module, dtype: torch.dtype,
          length: int, new_tokens: int, device: torch.device) -> tuple[str, bool]:
    """Ours against HF on the device: (what was seen, whether ours may be timed)."""
    spec = files.shape
    if spec.family == "classifier":
        ids = random_ids(spec, 4, 64 if spec.dims.d_model > 64 else 16, seed=1234).to(device)
        reference = hf_logits(hf, ids).float()
        with torch.inference_mode():
            got = ours.model(ids).float()
        error = (got - reference).abs().max().item() / reference.abs().max().item()
        same = int((got.argmax(-1) == reference.argmax(-1)).sum())
        text = f"logits: max difference {error:.1e} of HF's scale, argmax equal on {same}/{len(ids)}"
        return text, error <= LOGITS_RTOL[dtype]
    inputs = random_ids(spec, 3, length, seed=1234).to(device)
    reference, scores = hf_greedy_reference(hf, inputs, new_tokens)
    tie = TIE if dtype == torch.float32 else 1e-2  # half precision: a tie at its own resolution
    parts = []
    for i, (mine, theirs) in enumerate(zip(ours_tokens(ours, inputs, 1, new_tokens), reference, strict=True)):
        found = divergence(mine, theirs, scores[i], tie)
        if found is not None:
            parts.append((i, found[0], found[2]))
    if not parts:
        return f"greedy tokens: same ({len(reference)} inputs x {new_tokens} tokens)", True
    where = ", ".join(f"input {i} from step {t}{' (a tie)' if tie else ''}" for i, t, tie in parts)
    if all(tie for _, _, tie in parts):
        return f"greedy tokens: same up to ties ({where})", True
    return f"greedy tokens part: {where}", dtype != torch.float32  # half precision: reported, not required


def cells_of(files: shapes.ShapeFiles, ours: Checkpoint | None, hf: torch.nn.Module, grid: list[tuple[int, int]],
             length: int, new_tokens: int, repeats: int, device: torch.device, dtype_name: str) -> list[Cell]:
    spec, threads, cells = files.shape, torch.get_num_threads(), []
    for first, batch in grid:
        if spec.family == "classifier":
            ids = random_ids(spec, batch, first, seed=batch).to(device)
            times = max(1, MIN_TOKENS_PER_RUN // (batch * first))
            cell = Cell(f"{spec.name} {dtype_name}", f"length {first}", batch, 0, batch * first * times, length=first)
            runs = {"HF": lambda ids=ids, times=times: [hf_logits(hf, ids).shape[0] for _ in range(times)]}
            if ours is not None:
                runs["ours"] = lambda ids=ids, times=times: [_ours_rows(ours, ids) for _ in range(times)]
            expected = batch
        else:
            inputs = random_ids(spec, batch, length, seed=batch).to(device)
            cell = Cell(f"{spec.name} {dtype_name}", "greedy" if first == 1 else f"beam {first}", batch, first,
                        batch * new_tokens, length=length)
            runs = {"HF": hf_decode(hf, inputs, first, new_tokens)}
            if ours is not None:
                runs["ours"] = ours_decode(ours, inputs, first, new_tokens)
            expected = new_tokens
        variants = {f"{name}@{threads}": (threads, synchronized(run, device)) for name, run in runs.items()}
        logger.info("%s: %s batch %d (%s)", cell.family, cell.label, batch, load())
        cells.append(alternate(cell, variants, expected, repeats, prune=1e9))
    return cells


def _ours_rows(ours: Checkpoint, ids: torch.Tensor) -> int:
    with torch.inference_mode():
        return ours.model(ids).shape[0]


def read_bandwidth(device: torch.device, size: int = 1 << 30) -> float:
    """Bytes per second of a sum over ``size`` bytes on the device (the median of 5 after a warm-up)."""
    x = torch.ones(size // 4, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        x.sum()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    del x
    return size / statistics.median(times[1:])


def weight_bytes(spec: shapes.Shape, dtype: torch.dtype) -> int:
    """Weights one batch-1 decoding step reads: the decoder's layers and the output projection."""
    return floor.decoder_weights(spec.family, spec.dims) * torch.finfo(dtype).bits // 8


def run(args: argparse.Namespace) -> str:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    names = [args.shape] if args.shape in SHAPES else list(SHAPES)
    dtypes = [(name, DTYPES[name]) for name in args.dtypes]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    bandwidth = read_bandwidth(device) if device.type == "cuda" else None
    out = [f"Device: {gpu}; torch {torch.__version__}; {_hf_version()}; started {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    if bandwidth:
        out.append(f"Measured read bandwidth (a sum over 1 GiB): {bandwidth / 1e12:.2f} TB/s")
    checks, results, steps = [], [], []
    for name in names:
        spec = shapes.shape(name, args.tiny)
        grid, length, new_tokens = TINY[name] if args.tiny else GRIDS[name]
        if args.quick and not args.tiny:
            grid = QUICK[name]
        files = shapes.build(name, args.cache, args.tiny)
        for dtype_name, dtype in dtypes:
            logger.info("%s %s: loading and checking (%s)", name, dtype_name, load())
            ours, hf = load_pair(files, device, dtype)
            text, ok = check(files, ours, hf, dtype, length, new_tokens, device)
            checks.append([f"{name} {dtype_name}", text if ok else f"MISMATCH, not timed: {text}"])
            cells = cells_of(files, ours if ok else None, hf, grid, length, new_tokens, args.repeats, device,
                             dtype_name)
            for c in cells:
                ours_rate, hf_rate = c.best("ours"), c.best("HF")
                ratio = f"{ours_rate[0] / hf_rate[0]:.2f}x" if ours_rate and hf_rate else "-"
                results.append([c.family, c.label, c.batch, f"{ours_rate[0]:,.0f}" if ours_rate else "-",
                                f"{hf_rate[0]:,.0f}", ratio])
                if bandwidth and c.batch == 1 and c.beams == 1 and spec.family != "classifier":
                    floor_ms = weight_bytes(spec, dtype) / bandwidth * 1e3
                    per_step = {e: c.seconds[f"{e}@{torch.get_num_threads()}"] / new_tokens * 1e3
                                for e in ("ours", "HF") if f"{e}@{torch.get_num_threads()}" in c.seconds}
                    steps.append([c.family, f"{floor_ms:.3f}", *[f"{per_step[e]:.2f}" if e in per_step else "-"
                                                                 for e in ("ours", "HF")]])
            del ours, hf
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out += ["", "### Outputs on the device vs HF", "", markdown_table(["shape", "result"], checks), "",
            f"### Results (tokens/s; classifier: tokens/s of sequences x length; median of {args.repeats} "
            "alternating runs after a warm-up)", "",
            markdown_table(["shape", "cell", "batch", "ours /s", "HF /s", "ours / HF"], results)]
    if steps:
        out += ["", "### Batch-1 greedy step against the weight-read floor (milliseconds per token, prefill "
                "included)", "", markdown_table(["shape", "floor ms", "ours ms", "HF ms"], steps)]
    out += ["", f"End: {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    return "\n".join(out)


def _hf_version() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


__all__ = ["SHAPES", "run"]
