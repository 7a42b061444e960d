"""Ours vs HF vs CTranslate2 vs llama.cpp on the Llama-style decoders: `python -m benchmarks.compare --shape
smollm2-135m` (or ``qwen2.5-0.5b``).

Shapes (benchmarks/shapes.py): ``smollm2-135m`` (LlamaForCausalLM: 30 layers, d 576, 9 / 3 heads, FFN 1,536,
vocabulary 49,152, tied) and ``qwen2.5-0.5b`` (Qwen2ForCausalLM: 24 layers, d 896, 14 / 2 heads, FFN 4,864,
vocabulary 151,936, tied, q/k/v biases); random weights saved by ``save_pretrained``. Every engine reads those
files and gets the same token ids (random, not the EOS id):

- ours fp32, int8 and bf16: ``load_checkpoint`` of the directory (model.hf), ``prepare_for_inference`` as the service
  loads it (benchmarks/shape_engines.py); HF ``generate()``;
- CTranslate2 fp32 and int8: its ``TransformersConverter`` of the directory, a ``Generator`` per compute type and
  thread count in a process of its own (``peers.CT2Process``), the prompt forwarded at once;
- llama.cpp F32 and Q8_0: llama-cpp-python built from source in its own environment, the GGUF files written by
  llama.cpp's converter, its C API driven by benchmarks/llama_cpp_worker.py (benchmarks/llama_cpp_peer.py).

Cells: greedy at batch 1, 8, 32 and beam 4 at batch 1, each with 32-token and 512-token prompts, 128 new tokens
(min = max fixes every length), and the prefill of a 512-token prompt at batch 1 (the first token: prompt
tokens/s). ``--quick``: greedy b1, b8 and beam 4 b1 on 32-token prompts and greedy b1 on 512-token ones, 32 new
tokens, one timed round, and the prefill. Before any timing the greedy tokens of each engine are compared with
HF's on three 32-token prompts (a divergence where HF's two candidates tie is a tie); a fp32 engine that differs is
not timed; the quantized ones (ours int8 and bf16, CT2 int8, llama.cpp Q8_0) report where they part from fp32 HF. Timing
as for the other shapes (benchmarks/cells.py); the floor from benchmarks/floor.py with the shape's sizes (grouped
K/V, gated FFN). Peak RSS per engine: each engine loaded in a fresh process of its own and run on one greedy
batch-1 cell (512-token prompt), its VmHWM.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial

from benchmarks import floor, llama_cpp_peer, peers, shape_compare, shapes
from benchmarks.cells import Cell, alternate, hf_retired, kernels, load, rate, ratio_text, versions
from benchmarks.common import machine_line, markdown_table
from benchmarks.peak_rss import peak_rss_rows
from benchmarks.shape_engines import (
    OURS_QUANTIZED,
    Engines,
    divergence,
    floor_seconds,
    hf_decode,
    hf_greedy_reference,
    load_engines,
    ours_decode,
    ours_tokens,
    quantized,
    random_ids,
    verdict,
)
from model.native_support import unsupported

logger = logging.getLogger("benchmarks.decoder_compare")

ENGINES = ("ours", *OURS_QUANTIZED, "HF", "CT2 fp32", "CT2 int8", "llama.cpp F32", "llama.cpp Q8_0")
PEERS = (("ours", "HF"), ("ours", "CT2 fp32"), ("ours int8", "CT2 int8"), ("ours", "llama.cpp F32"),
         ("ours int8", "llama.cpp Q8_0"))
TIE = 1e-4  # as benchmarks/shape_engines.py: HF logits closer than this (relative) are a tie
CHECK_PROMPT = 32
RSS_PROMPT = 512


@dataclass(frozen=True)
class Workload:
    """One cell: prompt tokens, beams, batch, new tokens (1: the prefill cell)."""

    prompt: int
    beams: int
    batch: int
    new_tokens: int

    @property
    def label(self) -> str:
        if self.new_tokens == 1:
            return f"prefill {self.prompt}"
        return f"{'greedy' if self.beams == 1 else f'beam {self.beams}'} p{self.prompt}"

    @property
    def items(self) -> int:  # the prefill counts prompt tokens, the others new tokens
        return self.batch * (self.prompt if self.new_tokens == 1 else self.new_tokens)


FULL = [Workload(p, beams, batch, 128) for p in (32, 512) for beams, batch in ((1, 1), (1, 8), (1, 32), (4, 1))]
FULL.append(Workload(512, 1, 1, 1))
QUICK = [Workload(32, 1, 1, 32), Workload(32, 1, 8, 32), Workload(32, 4, 1, 32), Workload(512, 1, 1, 32),
         Workload(512, 1, 1, 1)]
TINY = [Workload(8, 1, 1, 4), Workload(8, 1, 2, 4), Workload(8, 4, 1, 4), Workload(16, 1, 1, 1)]


@dataclass
class Peers:
    """The out-of-process engines by (engine, threads), CTranslate2's vocabulary, and what was left out (why)."""

    ct2: dict[tuple[str, int], peers.CT2Process] = field(default_factory=dict)
    llama: dict[tuple[str, int], llama_cpp_peer.LlamaCppProcess] = field(default_factory=dict)
    vocabulary: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def close(self) -> None:
        for process in [*self.ct2.values(), *self.llama.values()]:
            process.close()


def start_peers(files: shapes.ShapeFiles, threads: list[int], grid: list[Workload]) -> Peers:
    """CTranslate2 and llama.cpp on the shape's converted files, each engine and thread count a process."""
    started = Peers()
    ct2 = shapes.ct2_directory(files)
    if ct2 is None:
        started.missing.append("CTranslate2: ctranslate2 is not installed")
    else:
        started.vocabulary = json.loads((ct2 / "vocabulary.json").read_text())
        started.ct2 = {(f"CT2 {kind}", n): peers.CT2Process(ct2, kind.replace("fp32", "float32"), n, generator=True)
                       for kind in ("fp32", "int8") for n in threads}
    env = llama_cpp_peer.environment()
    if env is None:
        started.missing.append(f"llama.cpp: no benchmark environment at ${llama_cpp_peer.VENV_VARIABLE} or "
                               f"{llama_cpp_peer.DEFAULT_VENV} (benchmarks/llama_cpp_setup.sh makes it)")
        return started
    cells = max(w.batch * (w.prompt + w.new_tokens) for w in grid + [Workload(CHECK_PROMPT, 1, 3, 128)])
    sequences = max(max(w.batch for w in grid), 2 * max(w.beams for w in grid), 3)
    log = files.root / "llama-cpp.log"
    for kind, path in llama_cpp_peer.gguf_files(files, env).items():
        for n in threads:
            started.llama[f"llama.cpp {kind}", n] = llama_cpp_peer.LlamaCppProcess(env, path, n, cells, sequences, log)
    return started


# ---- outputs ------------------------------------------------------------------------------------------------


def check_outputs(engines: Engines, started: Peers, new_tokens: int) -> list[list[str]]:
    """Greedy tokens of every engine against HF's on three prompts: rows of the outputs table. A fp32 engine that
    differs beyond a tie goes into ``engines.excluded``; a quantized one reports where it parts from fp32 HF."""
    inputs = random_ids(engines.files.shape, 3, CHECK_PROMPT, seed=1234)
    reference, scores = hf_greedy_reference(engines.hf, inputs, new_tokens)
    candidates = {engine: ours_tokens(checkpoint, inputs, 1, new_tokens)
                  for engine, checkpoint in engines.ours_engines.items() if engine not in engines.excluded}
    index = {piece: i for i, piece in enumerate(started.vocabulary)}
    pieces = [[started.vocabulary[i] for i in row] for row in inputs.tolist()]
    for (engine, n), process in sorted(started.ct2.items()):
        if n == min(t for _, t in started.ct2):
            candidates[engine] = [[index[s] for s in row] for row in process.tokens(pieces, 1, new_tokens)]
    for (engine, n), process in sorted(started.llama.items()):
        if n == min(t for _, t in started.llama):
            candidates[engine] = process.tokens(inputs.tolist(), 1, new_tokens)
    rows = []
    for engine, tokens in candidates.items():
        found = [(i, *d) for i, (mine, theirs) in enumerate(zip(tokens, reference, strict=True))
                 if (d := divergence(mine, theirs, scores[i], TIE)) is not None]
        if quantized(engine):
            parts = [next((d[1] for d in found if d[0] == i), new_tokens) for i in range(len(reference))]
            text = (f"equal to fp32 HF for the first {parts} of {new_tokens} tokens of {len(reference)} prompts "
                    f"({sum(parts) / (new_tokens * len(reference)):.0%}; quantized: reported, not required)")
        else:
            text, ok = verdict(found, len(reference), new_tokens, False)
            if not ok:
                engines.excluded[engine] = text
                logger.error("%s %s: %s", engines.files.shape.name, engine, text)
        rows.append([engine, "greedy tokens vs HF", text])
    return rows


# ---- cells --------------------------------------------------------------------------------------------------


def decode_cells(engines: Engines, started: Peers, grid: list[Workload], args: argparse.Namespace,
                 probe: floor.BandwidthProbe) -> list[Cell]:
    name, cells = engines.files.shape.name, []
    for k, w in enumerate(grid, 1):
        logger.info("%s: cell %d/%d, %s batch %d (%s)", name, k, len(grid), w.label, w.batch, load())
        inputs = random_ids(engines.files.shape, w.batch, w.prompt, seed=w.batch + w.prompt)
        ids, pieces = inputs.tolist(), [[started.vocabulary[i] for i in row] for row in inputs.tolist()]
        cell = Cell(name, w.label, w.batch, w.beams, w.items, length=w.prompt)
        variants = {}
        for n in args.threads:
            for engine, checkpoint in engines.ours_engines.items():
                variants[f"{engine}@{n}"] = (n, ours_decode(checkpoint, inputs, w.beams, w.new_tokens))
            variants[f"HF@{n}"] = (n, hf_decode(engines.hf, inputs, w.beams, w.new_tokens))
        for (engine, n), process in started.ct2.items():
            variants[f"{engine}@{n}"] = (1, _bind(process.translate, pieces, w.beams, w.new_tokens))
        for (engine, n), process in started.llama.items():
            variants[f"{engine}@{n}"] = (1, _bind(process.generate, ids, w.beams, w.new_tokens))
        variants = {v: run for v, run in variants.items() if v.rsplit("@", 1)[0] not in engines.excluded}
        cells.append(alternate(cell, variants, w.new_tokens, args.repeats, args.prune, probe))
    return cells


def _bind(method, prompts: list, beams: int, new_tokens: int):
    return lambda: method(prompts, beams, new_tokens)


def floors(cells: list[Cell], grid: list[Workload], spec: shapes.Shape, peak: floor.Rates) -> dict:
    """(family, batch, label) -> floor seconds by weight bytes (floor.by_precision) of each cell, at the bandwidth
    read during it."""
    out = {}
    for c, w in zip(cells, grid, strict=True):
        rates = peak.during(c.read_bandwidth())
        out[c.family, c.batch, c.label] = floor.by_precision(rates, partial(
            floor.decode_floor, "causal_lm", w.batch, w.beams, w.prompt, w.new_tokens, rates, dims=spec.dims))
    return out


# ---- tables -------------------------------------------------------------------------------------------------


def results_table(cells: list[Cell], excluded: dict[str, str]) -> str:
    engines = [e for e in ENGINES if any(c.best(e) for c in cells) or e in excluded]
    pairs = [(a, b) for a, b in PEERS if a in engines and b in engines]
    headers = ["cell", "batch", *[f"{e} /s" for e in engines], *[f"{a} / {b}" for a, b in pairs]]
    rows = [[c.label, c.batch, *["MISMATCH" if e in excluded else rate(c, e) for e in engines],
             *[ratio_text(c.ratio(a, b)) for a, b in pairs]] for c in cells]
    return markdown_table(headers, rows)


def shares(cells: list[Cell], limits: dict) -> dict[tuple[str, int, str], float]:
    """(label, batch, engine) -> the engine's best rate over the cell's floor rate (shape_engines.floor_seconds)."""
    out = {}
    for c in cells:
        for engine in ENGINES:
            if (best := c.best(engine)) and (limit := floor_seconds(engine, limits[c.family, c.batch, c.label])):
                out[c.label, c.batch, engine] = best[0] * limit / c.items
    return out


def floor_table(cells: list[Cell], limits: dict, share: dict, fp32_weights: int) -> str:
    engines = [e for e in ENGINES if any(c.best(e) for c in cells)]
    rows = []
    for c in cells:
        fp32, int8 = (limits[c.family, c.batch, c.label][b] for b in (floor.FP32, floor.INT8))
        read = c.read_bandwidth().get(fp32_weights)
        rows.append([c.label, c.batch, f"{read / 1e9:.1f}" if read else "-", f"{c.items / fp32:,.0f}",
                     f"{c.items / int8:,.0f}",
                     *[f"{share[c.label, c.batch, e]:.0%}" if (c.label, c.batch, e) in share else "-"
                       for e in engines]])
    headers = ["cell", "batch", "read GB/s", "floor fp32 /s", "floor int8 /s", *[f"{e} % of floor" for e in engines]]
    return markdown_table(headers, rows)


def targets_table(cells: list[Cell], share: dict) -> str:
    """The issue's speed goals, measured in these cells: met or MISSED."""
    rows = []

    def check(goal: str, cell: Cell, value: float | None, target: float, percent: bool = False,
              retired: str | None = None) -> None:
        if value is not None:
            rows.append([goal, f"{cell.label} b{cell.batch}", f"{value:.0%}" if percent else f"{value:.2f}x",
                         retired or ("met" if value >= target else "MISSED")])

    for c in cells:
        if c.batch == 1 and c.label.startswith(("greedy", "prefill")):
            what = "prefill" if c.label.startswith("prefill") else "at batch 1"
            check(f"ours fp32 >= llama.cpp F32 {what}", c, c.ratio("ours", "llama.cpp F32"), 1.0)
            check(f"ours int8 >= llama.cpp Q8_0 {what}", c, c.ratio("ours int8", "llama.cpp Q8_0"), 1.0)
        check("ours fp32 >= CT2 fp32", c, c.ratio("ours", "CT2 fp32"), 1.0)
        check("ours int8 >= CT2 int8", c, c.ratio("ours int8", "CT2 int8"), 1.0)
        check("ours fp32 >= 2x HF", c, c.ratio("ours", "HF"), 2.0,
              retired=hf_retired(share.get((c.label, c.batch, "HF"))))
        if c.batch == 1 and c.label.startswith("greedy"):
            check("ours fp32 >= 80% of the weight-read floor at batch 1", c, share.get((c.label, 1, "ours")), 0.8,
                  True)
            check("ours int8 >= 80% of the weight-read floor at batch 1", c, share.get((c.label, 1, "ours int8")),
                  0.8, True)
    return markdown_table(["goal", "cell", "measured", ""], rows)


# ---- the run ------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> str:
    spec = shapes.shape(args.shape, args.tiny)
    grid = TINY if args.tiny else QUICK if args.quick else FULL
    check_tokens = grid[0].new_tokens
    files = shapes.build(args.shape, args.cache, args.tiny)
    env = llama_cpp_peer.environment()
    out = [f"Machine: {machine_line()}",
           f"Peers: {versions()} · llama-cpp-python {env.version if env else 'not set up'} (built from source)",
           f"Ours: {kernels()}", f"Threads tried per engine: {args.threads}",
           f"Shape: {spec.name}{' (tiny)' if args.tiny else ''}: {spec.architecture} {_sizes(spec)}, random weights, "
           f"files under {files.root}; cells (prompt, beams, batch, new tokens): "
           f"{[(w.prompt, w.beams, w.batch, w.new_tokens) for w in grid]}; median of {args.repeats} alternating "
           "runs after 1 warm-up", "", f"Start: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    logger.info("%s: measuring the floor's rates, loading the engines (%s)", spec.name, load())
    rates = shape_compare.measure_rates(spec, args.threads)
    probe = floor.BandwidthProbe(shape_compare.weight_bytes(spec), args.threads)
    engines = load_engines(files, args.threads)
    declined = unsupported(engines.ours.config)
    path = f"LayerStack.forward (the decode plan declines {declined})" if declined else \
        "the decode plan and C++ step (model/fast_step.py)"
    out.insert(3, f"Ours on this shape: {path}")
    started = start_peers(files, args.threads, grid)
    try:
        logger.info("%s: comparing outputs", spec.name)
        checks = check_outputs(engines, started, check_tokens)
        cells = decode_cells(engines, started, grid, args, probe)
    finally:
        started.close()
    out += [f"Cells done: {load()}"]
    excluded = engines.excluded
    del engines  # the peak RSS processes below load their own
    gc.collect()
    rss = peak_rss_rows(files, args.threads[-1], RSS_PROMPT, grid[0].new_tokens) if args.rss else []
    rates = rates.best_with(shape_compare.measure_rates(spec, args.threads))
    limits = floors(cells, grid, spec, rates)
    share = shares(cells, limits)
    pruned = "; ".join(f"{c.label} b{c.batch}: {', '.join(c.pruned)}" for c in cells if c.pruned)
    bw = ", ".join(f"{size / 1e6:.0f} MB: {r / 1e9:.1f} GB/s" for size, r in rates.bandwidth.items())
    out += ["", "### Outputs", "", markdown_table(["engine", "check", "result"], checks), "",
            *([f"Not run: {'; '.join(started.missing)}", ""] if started.missing else []),
            "### Results (tokens/s; prefill: prompt tokens/s; best thread count in brackets)", "",
            results_table(cells, excluded), "",
            f"Timed by their warm-up only (over {args.prune}x slower than the same engine's best): {pruned or 'none'}",
            "", "### Targets", "", targets_table(cells, share), ""]
    if rss:
        out += ["### Peak RSS (each engine alone in a fresh process: load, then one greedy batch-1 cell with a "
                f"{RSS_PROMPT}-token prompt, {grid[0].new_tokens} new tokens; {args.threads[-1]} threads)", "",
                markdown_table(["engine", "peak RSS"], rss), ""]
    out += ["### Floor", "", f"Best read bandwidth by working set: {bw}; fp32 GEMM {rates.fp32_flops / 1e9:.0f} "
            f"GFLOP/s, int8 GEMM {rates.int8_ops / 1e9:.0f} GOP/s; threads of each best: {rates.threads} (each the "
            "better of a measurement before and one after the cells). Each cell's floor takes the bandwidth read "
            "during it (\"read GB/s\", the fp32 weights' working set).", "",
            floor_table(cells, limits, share, shape_compare.weight_bytes(spec)[0]), "",
            f"End: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    return "\n".join(out)


def _sizes(spec: shapes.Shape) -> str:
    c = spec.config
    return (f"d_model {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} / "
            f"{c['num_key_value_heads']} heads, ffn {c['intermediate_size']}, vocabulary {spec.vocab:,}")


__all__ = ["FULL", "QUICK", "TINY", "Workload", "run"]
