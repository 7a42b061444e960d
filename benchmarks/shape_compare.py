"""Ours vs HF vs CTranslate2 / ONNX Runtime on the shapes people serve: `python -m benchmarks.compare --shape NAME`.

Shapes (benchmarks/shapes.py builds them, random weights, in the HF layout, cached): ``opus-mt`` (MarianMTModel,
d 512, 6+6 layers, vocabulary 58,101), ``bert-base`` (BertForSequenceClassification, 768, 12 layers, 30,522),
``gpt2-small`` (GPT2LMHeadModel, 768, 12 layers, 50,257). Every engine reads the same files and gets the same
token ids (random, no special ids): the benchmark measures model compute, not tokenization.

- opus-mt: greedy and beam 4 at batch 1 and 16, beam 4 at batch 32 (32-token sources, 64 new tokens); ours
  fp32 / int8 / bf16, HF ``generate()``, CTranslate2 fp32 / int8 (``translate_batch`` on the ids' token strings, each
  translator in a process of its own), beside CTranslate2's published OPUS-MT table (beam 4, batch 32);
- bert-base: one forward at lengths 16, 64, 256 and batch 1, 8, 64 (tokens/s: sequences x length; a run of
  fewer than 256 tokens repeats the forward up to that); ours fp32 / int8 / bf16, HF, ONNX Runtime fp32 and its
  dynamic int8
  (``torch.onnx.export``, fused by onnxruntime's transformer optimizer, graph optimizations on);
- gpt2-small: greedy at batch 1, 8, 32 and beam 4 at batch 1 (16-token prompts, 128 new tokens); ours
  fp32 / int8 / bf16, HF;
- nllb-200-distilled-600m (M2M100ForConditionalGeneration, d 1024, 12+12 layers, vocabulary 256,206) and flan-t5-base
  (T5ForConditionalGeneration, gated GELU, d 768, 12+12, 32,128), issue 39's (benchmarks/seq2seq_shapes.py): greedy
  and beam 4 at batch 1 and 16 (32-token sources, 64 new tokens), engines as opus-mt's; NLLB's target language is
  the forced first token on every engine (ours ``forced_first``, HF ``forced_bos_token_id``, CTranslate2
  ``target_prefix``), one of the 64 new tokens on each.

``--quick`` times fewer cells, once each (the lengths stay). Ours loads the directory with
``model.checkpoint.load_checkpoint`` and runs it as the service does (benchmarks/shape_engines.py).
min_new_tokens = max_new_tokens fixes every length. Before any timing the outputs are compared: greedy
tokens of ours and of CTranslate2 against HF's on three inputs, the classifier's logits of ours and of ONNX
Runtime against HF's; a fp32 engine that disagrees (beyond a tie) is reported as MISMATCH and not timed,
int8 and bf16 agreement is reported. Timing as for the toy shape (benchmarks/cells.py): variants alternate in
rotating order after a warm-up, medians, each engine at its best thread count. The floor per cell and each
engine's share of it come from benchmarks/floor.py with the shape's sizes, at the bandwidth read during the cell
(none for bf16 yet: the floor has no bf16 GEMM rate).
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from functools import partial

from benchmarks import floor, shapes
from benchmarks.cells import Cell, alternate, kernels, load, rate, ratio_text, versions
from benchmarks.common import machine_line, markdown_table
from benchmarks.shape_engines import (
    OURS_QUANTIZED,
    Engines,
    check_classifier,
    check_decoding,
    ct2_decode,
    ct2_pieces,
    floor_seconds,
    hf_decode,
    hf_logits,
    load_engines,
    ort_logits,
    ours_classify,
    ours_decode,
    random_ids,
    repeated,
    rows_of,
)

logger = logging.getLogger("benchmarks.shape_compare")

ENGINES = ("ours", *OURS_QUANTIZED, "HF", "CT2 fp32", "CT2 int8", "ORT fp32", "ORT int8")
PEERS = (("ours", "HF"), ("ours", "CT2 fp32"), ("ours int8", "CT2 int8"), ("ours", "ORT fp32"),
         ("ours int8", "ORT int8"))
# CTranslate2's OPUS-MT en-de table (README, Intel Xeon, beam 4, batch 32, 4 threads): target tokens/s
CT2_PUBLISHED = {"HF": 147, "CT2 fp32": 525, "CT2 int8": 696}
MIN_TOKENS_PER_RUN = 256  # a classifier run repeats its forward until it has seen this many tokens
ISSUE_39 = ("nllb-200-distilled-600m", "flan-t5-base")  # the translator / instruction seq2seq shapes of issue 39


@dataclass(frozen=True)
class Grid:
    """One shape's cells: (beams, batch) of decoding, or (length, batch) of the classifier."""

    full: list[tuple[int, int]]
    quick: list[tuple[int, int]]
    length: int = 0  # decoding: prompt / source tokens
    new_tokens: int = 0


GRIDS = {
    "opus-mt": Grid([(1, 1), (1, 16), (4, 1), (4, 16), (4, 32)], [(1, 1), (1, 16), (4, 1)], 32, 64),
    "bert-base": Grid([(n, b) for n in (16, 64, 256) for b in (1, 8, 64)], [(16, 1), (64, 8), (256, 1)]),
    "gpt2-small": Grid([(1, 1), (1, 8), (1, 32), (4, 1)], [(1, 1), (1, 32), (4, 1)], 16, 128),
    **{name: Grid([(1, 1), (1, 16), (4, 1), (4, 16)], [(1, 1), (4, 1)], 32, 64) for name in ISSUE_39},
}
TINY_GRIDS = {
    "opus-mt": Grid([(1, 1), (4, 2)], [(1, 1), (4, 2)], 8, 4),
    "bert-base": Grid([(16, 1), (16, 4)], [(16, 1), (16, 4)]),
    "gpt2-small": Grid([(1, 1), (4, 1)], [(1, 1), (4, 1)], 8, 4),
    **{name: Grid([(1, 1), (4, 2)], [(1, 1), (4, 2)], 8, 4) for name in ISSUE_39},
}


# ---- cells --------------------------------------------------------------------------------------------------


def decode_cells(engines: Engines, grid: list[tuple[int, int]], spec: Grid, args: argparse.Namespace,
                 probe: floor.BandwidthProbe) -> list[Cell]:
    name, cells = engines.files.shape.name, []
    pieces = ct2_pieces(engines.files) if engines.translators else []
    for k, (beams, batch) in enumerate(grid, 1):
        logger.info("%s: cell %d/%d, %s batch %d (%s)", name, k, len(grid), "greedy" if beams == 1 else
                    f"beam {beams}", batch, load())
        inputs = random_ids(engines.files.shape, batch, spec.length, seed=batch)
        cell = Cell(name, "greedy" if beams == 1 else f"beam {beams}", batch, beams, batch * spec.new_tokens,
                    length=spec.length)
        variants = {}
        for n in args.threads:
            for engine, checkpoint in engines.ours_engines.items():
                variants[f"{engine}@{n}"] = (n, ours_decode(checkpoint, inputs, beams, spec.new_tokens, engines.forced))
            variants[f"HF@{n}"] = (n, hf_decode(engines.hf, inputs, beams, spec.new_tokens, engines.forced))
            for kind in ("fp32", "int8"):
                if (kind, n) in engines.translators:
                    run = ct2_decode(engines.translators[kind, n], pieces, inputs, beams, spec.new_tokens,
                                     engines.prefix)
                    variants[f"CT2 {kind}@{n}"] = (1, run)
        variants = {v: run for v, run in variants.items() if v.rsplit("@", 1)[0] not in engines.excluded}
        cells.append(alternate(cell, variants, spec.new_tokens, args.repeats, args.prune, probe))
    return cells


def classifier_cells(engines: Engines, grid: list[tuple[int, int]], args: argparse.Namespace,
                     probe: floor.BandwidthProbe) -> list[Cell]:
    name, cells = engines.files.shape.name, []
    for k, (length, batch) in enumerate(grid, 1):
        logger.info("%s: cell %d/%d, length %d batch %d (%s)", name, k, len(grid), length, batch, load())
        ids = random_ids(engines.files.shape, batch, length, seed=batch)
        times = max(1, MIN_TOKENS_PER_RUN // (batch * length))
        variants = {}
        for n in args.threads:
            for engine, checkpoint in engines.ours_engines.items():
                variants[f"{engine}@{n}"] = (n, repeated(ours_classify(checkpoint, ids), times))
            variants[f"HF@{n}"] = (n, repeated(rows_of(hf_logits, engines.hf, ids), times))
            for kind in ("fp32", "int8"):
                if (kind, n) in engines.ort:
                    variants[f"ORT {kind}@{n}"] = (1, repeated(rows_of(ort_logits, engines.ort[kind, n], ids), times))
        variants = {v: run for v, run in variants.items() if v.rsplit("@", 1)[0] not in engines.excluded}
        cell = Cell(name, f"length {length}", batch, 0, batch * length * times, length=length)
        cells.append(alternate(cell, variants, batch, args.repeats, args.prune, probe))
    return cells


# ---- tables -------------------------------------------------------------------------------------------------


def results_table(cells: list[Cell], excluded: dict[str, str], reference: bool) -> str:
    engines = [e for e in ENGINES if any(c.best(e) for c in cells) or e in excluded]
    pairs = [(a, b) for a, b in PEERS if a in engines and b in engines]
    headers = ["cell", "batch", *[f"{e} /s" for e in engines], *[f"{a} / {b}" for a, b in pairs]]
    rows = [[f"{c.family} {c.label}", c.batch, *["MISMATCH" if e in excluded else rate(c, e) for e in engines],
             *[ratio_text(c.ratio(a, b)) for a, b in pairs]] for c in cells]
    if reference:
        rows.append(["opus-mt beam 4, CTranslate2's published en-de table (4 threads, its Xeon)", 32,
                     *[f"{CT2_PUBLISHED[e]:,}" if e in CT2_PUBLISHED else "-" for e in engines],
                     *["-" for _ in pairs]])
    return markdown_table(headers, rows)


def targets_table(cells: list[Cell], shares: dict[tuple[str, int, str], float]) -> str:
    """The issue's targets for these cells, measured (reported: met or MISSED)."""
    rows = []

    def check(target: str, cell: Cell, value: float | None, goal: float, percent: bool = False) -> None:
        if value is not None:
            rows.append([target, f"{cell.family} {cell.label} b{cell.batch}",
                         f"{value:.0%}" if percent else f"{value:.2f}x", "met" if value >= goal else "MISSED"])

    for c in cells:
        if c.family == "opus-mt":
            check("ours fp32 >= 1.5x HF", c, c.ratio("ours", "HF"), 1.5)
            check("ours fp32 >= CT2 fp32", c, c.ratio("ours", "CT2 fp32"), 1.0)
            check("ours int8 >= CT2 int8", c, c.ratio("ours int8", "CT2 int8"), 1.0)
        if c.family == "bert-base":
            check("ours fp32 >= ORT fp32", c, c.ratio("ours", "ORT fp32"), 1.0)
            check("ours int8 >= ORT int8", c, c.ratio("ours int8", "ORT int8"), 1.0)
            if c.batch == 1:
                check("ours fp32 >= 2x HF at batch 1", c, c.ratio("ours", "HF"), 2.0)
        if c.family in ISSUE_39:
            check("ours fp32 >= 2x HF", c, c.ratio("ours", "HF"), 2.0)
            check("ours fp32 >= CT2 fp32", c, c.ratio("ours", "CT2 fp32"), 1.0)
            check("ours int8 >= CT2 int8", c, c.ratio("ours int8", "CT2 int8"), 1.0)
        if c.family == "gpt2-small" and c.label == "greedy" and c.batch in (1, 32):
            check("ours fp32 >= 2x HF", c, c.ratio("ours", "HF"), 2.0)
        if c.batch == 1 and (c.family, c.batch, c.label) + ("ours",) in shares:
            check("ours >= 80% of the floor at batch 1", c, shares[c.family, c.batch, c.label, "ours"], 0.8, True)
    return markdown_table(["target", "cell", "measured", ""], rows)


def floors(cells: list[Cell], spec: shapes.Shape, peak: floor.Rates, new_tokens: int) -> dict:
    """(family, batch, label) -> (fp32 floor seconds, int8 floor seconds) of each cell, at the bandwidth read
    during the cell (the run's best GEMM rates)."""
    out = {}
    for c in cells:
        rates = peak.during(c.read_bandwidth())
        if spec.family == "classifier":
            times = c.items // (c.batch * c.length)  # forwards per run
            one = floor.by_precision(rates, partial(floor.classifier_floor, c.batch, c.length, rates, dims=spec.dims))
            out[c.family, c.batch, c.label] = {b: times * seconds for b, seconds in one.items()}
        else:
            out[c.family, c.batch, c.label] = floor.by_precision(rates, partial(
                floor.decode_floor, spec.family, c.batch, c.beams, c.length, new_tokens, rates, dims=spec.dims))
    return out


def floor_table(cells: list[Cell], limits: dict, fp32_weights: int) -> tuple[str, dict]:
    rows, shares = [], {}
    engines = [e for e in ENGINES if any(c.best(e) for c in cells)]
    for c in cells:
        limit = limits[c.family, c.batch, c.label]
        fp32, int8 = limit[floor.FP32], limit[floor.INT8]
        read = c.read_bandwidth().get(fp32_weights)
        row = [f"{c.family} {c.label}", c.batch, f"{read / 1e9:.1f}" if read else "-", f"{c.items / fp32:,.0f}",
               f"{c.items / int8:,.0f}"]
        for engine in engines:
            best, seconds = c.best(engine), floor_seconds(engine, limit)
            if best and seconds is not None:
                shares[c.family, c.batch, c.label, engine] = best[0] * seconds / c.items
            row.append(f"{shares[c.family, c.batch, c.label, engine]:.0%}" if best and seconds is not None else "-")
        rows.append(row)
    headers = ["cell", "batch", "read GB/s", "floor fp32 /s", "floor int8 /s", *[f"{e} % of floor" for e in engines]]
    return markdown_table(headers, rows), shares


# ---- the run ------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> str:
    spec = shapes.shape(args.shape, args.tiny)
    grid = (TINY_GRIDS if args.tiny else GRIDS)[args.shape]
    cells_grid = grid.quick if args.quick else grid.full
    files = shapes.build(args.shape, args.cache, args.tiny)
    what = (f"lengths x batches {cells_grid}" if spec.family == "classifier" else
            f"{grid.length}-token inputs, {grid.new_tokens} new tokens, (beams, batch) {cells_grid}")
    out = [f"Machine: {machine_line()}", f"Peers: {versions()}", f"Ours: {kernels()}",
           f"Threads tried per engine: {args.threads}",
           f"Shape: {spec.name}{' (tiny)' if args.tiny else ''}: {spec.architecture} {_sizes(spec)}, random weights, "
           f"files under {files.root}; {what}; median of {args.repeats} alternating runs after 1 warm-up", ""]
    out.append(f"Start: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}")
    logger.info("%s: measuring the floor's rates, loading the engines (%s)", spec.name, load())
    rates = measure_rates(spec, args.threads)  # again after the cells: the better of the two counts
    probe = floor.BandwidthProbe(weight_bytes(spec), args.threads)
    engines = load_engines(files, args.threads)
    if engines.ort:
        out.append(f"ONNX Runtime graph: {shapes.onnx_fusions(files)} (onnxruntime.transformers.optimizer), "
                   "int8: quantize_dynamic of it")
    try:
        logger.info("%s: comparing outputs", spec.name)
        checks = check_classifier(engines, args.threads[0]) if spec.family == "classifier" else \
            check_decoding(engines, grid.length, grid.new_tokens)
        if spec.family == "classifier":
            cells = classifier_cells(engines, cells_grid, args, probe)
        else:
            cells = decode_cells(engines, cells_grid, grid, args, probe)
    finally:
        engines.close()
    out += [f"Cells done: {load()}"]
    rates = rates.best_with(measure_rates(spec, args.threads))
    table, shares = floor_table(cells, floors(cells, spec, rates, grid.new_tokens), weight_bytes(spec)[0])
    pruned = "; ".join(f"{c.family} {c.label} b{c.batch}: {', '.join(c.pruned)}" for c in cells if c.pruned)
    bw = ", ".join(f"{size / 1e6:.0f} MB: {r / 1e9:.1f} GB/s" for size, r in rates.bandwidth.items())
    out += ["", "### Outputs", "", markdown_table(["engine", "check", "result"], checks), "",
            "### Results (tokens/s, best thread count in brackets)", "",
            results_table(cells, engines.excluded, spec.name == "opus-mt" and not args.tiny), "",
            f"Timed by their warm-up only (over {args.prune}x slower than the same engine's best): {pruned or 'none'}",
            "", "### Targets", "", targets_table(cells, shares), "",
            "### Floor", "", f"Best read bandwidth by working set: {bw}; fp32 GEMM {rates.fp32_flops / 1e9:.0f} "
            f"GFLOP/s, int8 GEMM {rates.int8_ops / 1e9:.0f} GOP/s; threads of each best: {rates.threads} (each the "
            "better of a measurement before and one after the cells). Each cell's floor takes the bandwidth read "
            "during it instead (\"read GB/s\", fp32 weights' working set: the best of 3 reads before each timed "
            "run, the median of the runs): the machine's memory is shared with other work.", "", table, "",
            f"End: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    return "\n".join(out)


def weight_bytes(spec: shapes.Shape) -> list[int]:
    """The shape's weights read per step (a classifier: per forward) in fp32 and in int8: the floor's working sets."""
    weights = spec.dims.layers * (spec.dims.self_attn + spec.dims.ffn) if spec.family == "classifier" else \
        floor.decoder_weights(spec.family, spec.dims)
    return [weights * floor.FP32, weights * floor.INT8]


def measure_rates(spec: shapes.Shape, threads: list[int]) -> floor.Rates:
    """The floor's bandwidth (at the shape's fp32 and int8 weight sizes) and GEMM rates (with its FFN linear)."""
    return floor.measure_rates(weight_bytes(spec), threads, [(512, spec.dims.d_model, spec.dims.d_ff)])


def _sizes(spec: shapes.Shape) -> str:
    d = spec.dims
    layers = f"{d.layers}+{d.layers}" if spec.family == "seq2seq" else str(d.layers)
    return f"d_model {d.d_model}, {layers} layers, ffn {d.d_ff}, vocabulary {d.vocab:,}"


__all__ = ["GRIDS", "run"]
