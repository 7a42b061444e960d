"""Ours vs HF vs ONNX Runtime on the encoders' jobs: `python -m benchmarks.compare --shape xlm-roberta-base`.

Shapes (benchmarks/shapes.py, random weights saved by ``save_pretrained``, cached): ``xlm-roberta-base``
(XLMRobertaForSequenceClassification, 12 layers, d 768, 12 heads, FFN 3,072, vocabulary 250,002, 514 positions, one
label: a cross-encoder like bge-reranker-base) and ``distilbert-base`` (DistilBertForTokenClassification, 6 layers,
d 768, 9 labels: the NER cells, run by benchmarks/ner_compare.py with this module's tables).

Rerank cells: a query of 16 tokens and 16 or 64 documents, each pair ``<s> query </s> </s> document </s>`` of
112-128 tokens (random ids, no special ones; the longest 128), scored in chunks of the service's default
``max_batch_size`` (32 pairs: also CrossEncoder.predict's default batch size), longest first as both sort them
(service.engine.pooling.batch_order), each chunk padded to its longest pair:

- ours fp32 / int8 / bf16: ``load_checkpoint`` + ``prepare_for_inference`` as the service loads a model
  (benchmarks/shape_engines.py), then what ``ModelWorker.rerank``'s PoolingJob "logits" computes: ``pad_batch`` of
  the chunk's ids and segment ids, the classifier's forward, the one-label logit through sigmoid
  (service.engine.rerank's default activation);
- HF: the transformers model's forward of the same padded chunks with their attention mask, sigmoid of the logit:
  what sentence-transformers' ``CrossEncoder.predict`` computes (not installed here);
- ONNX Runtime fp32 and int8: the classifier exported and fused as the bert-base shape's (Optimum-style inputs:
  input_ids, attention_mask), one session per thread count.

Before any timing each engine's logits of every cell's pairs are compared with HF's: a fp32 engine more than
:data:`FP32_ATOL` away is reported as MISMATCH and not timed; int8's and bf16's difference, correlation and HF's
order kept are reported. Timing, tables and the floor as for the other shapes (benchmarks/cells.py,
benchmarks/shape_compare.py): pairs/s, variants alternating after a warm-up, medians, each engine at its best thread
count; the floor is benchmarks/floor.py's ``encoder_floor`` over each pair's own tokens (padding excluded), weights
read once per cell (none for bf16 yet).
``--quick``: one timed round of the same cells.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from benchmarks import floor, shapes
from benchmarks.cells import Cell, alternate, hf_retired, kernels, load, ratio_text, versions
from benchmarks.common import machine_line, markdown_table
from benchmarks.shape_compare import ENGINES, PEERS, measure_rates, weight_bytes
from benchmarks.shape_engines import Engines, floor_seconds, load_engines, quantized
from model.checkpoint import Checkpoint
from model.tokenizer import pad_batch
from service.engine.pooling import batch_order
from service.engine.rerank import ACTIVATIONS, DEFAULT_ACTIVATION
from service.engine.types import EngineSettings

logger = logging.getLogger("benchmarks.encoder_compare")

FP32_ATOL = 1e-4  # the largest abs difference from HF's logit a fp32 engine may show
CHUNK = EngineSettings().max_batch_size  # pairs per forward: the service's default (CrossEncoder.predict's too)
SPREAD = 16  # pairs are pair_len - SPREAD .. pair_len tokens long: a chunk is padded
Pairs = list[tuple[list[int], list[int]]]  # (ids, segment ids) per pair, as service.engine.rerank encodes them
Scorer = Callable[[Pairs], torch.Tensor]  # pairs -> their one-label logits (pairs,)
W = TypeVar("W")  # a cell's inputs


@dataclass(frozen=True)
class RerankGrid:
    """A reranker's cells: documents per query, the query's tokens, the longest pair's tokens."""

    documents: list[int]
    query_len: int
    pair_len: int

    @property
    def shortest(self) -> int:
        """The shortest pair's tokens (a document of at least one token)."""
        return max(self.query_len + 5, self.pair_len - SPREAD)


GRIDS = {"xlm-roberta-base": RerankGrid([16, 64], 16, 128)}
TINY_GRIDS = {"xlm-roberta-base": RerankGrid([4, 40], 6, 24)}  # 40: more than one chunk


def rerank_pairs(spec: shapes.Shape, documents: int, grid: RerankGrid, seed: int) -> Pairs:
    """One query and ``documents`` documents as XLM-R's pair template lays them out (segment ids 0), random ids
    without the special ones; pair lengths spread over ``grid.shortest .. grid.pair_len``, the first the longest."""
    bos, eos = (shapes.XLMR_SPECIALS.index(t) for t in ("<s>", "</s>"))
    generator = torch.Generator().manual_seed(seed)
    special = len(shapes.XLMR_SPECIALS)
    query = torch.randint(special, spec.vocab - 1, (grid.query_len,), generator=generator).tolist()
    lengths = torch.randint(grid.shortest, grid.pair_len + 1, (documents,), generator=generator)
    lengths[0] = grid.pair_len
    pairs = []
    for total in lengths.tolist():
        document = torch.randint(special, spec.vocab - 1, (total - grid.query_len - 4,), generator=generator).tolist()
        ids = [bos, *query, eos, eos, *document, eos]
        pairs.append((ids, [0] * len(ids)))
    return pairs


def batched(pairs: Pairs, score: Callable[[Pairs], torch.Tensor]) -> torch.Tensor:
    """``score`` of ``pairs`` chunk by chunk as the service forwards them (longest first over more than one chunk:
    service.engine.pooling.batch_order, the order CrossEncoder.predict sorts by too), in the pairs' order."""
    order = batch_order([len(ids) for ids, _ in pairs], CHUNK)
    ranked = [pairs[i] for i in order]
    out = torch.cat([score(ranked[i: i + CHUNK]) for i in range(0, len(ranked), CHUNK)])
    return out[torch.tensor(order).argsort()]


def padded(chunk: Pairs, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, segment ids, attention mask) of a chunk padded to its longest pair, with the service's pad_batch."""
    ids, _ = pad_batch([p[0] for p in chunk], pad)
    segments, _ = pad_batch([p[1] for p in chunk], 0)
    mask = torch.zeros_like(ids)
    for row, (pair_ids, _) in enumerate(chunk):
        mask[row, : len(pair_ids)] = 1
    return ids, segments, mask


def ours_scorer(checkpoint: Checkpoint) -> Scorer:
    model = checkpoint.model
    pad = model.config.pad_id

    def chunk_logits(chunk: Pairs) -> torch.Tensor:
        ids, segments, _ = padded(chunk, pad)
        return model(ids, segments).float()[:, 0]

    def logits(pairs: Pairs) -> torch.Tensor:
        with torch.inference_mode():
            return batched(pairs, chunk_logits)

    return logits


def hf_scorer(engines: Engines) -> Scorer:
    pad = engines.hf.config.pad_token_id

    def chunk_logits(chunk: Pairs) -> torch.Tensor:
        ids, _, mask = padded(chunk, pad)
        return engines.hf(input_ids=ids, attention_mask=mask).logits[:, 0]

    def logits(pairs: Pairs) -> torch.Tensor:
        with torch.inference_mode():
            return batched(pairs, chunk_logits)

    return logits


def ort_scorer(engines: Engines, session) -> Scorer:
    pad, names = engines.files.shape.config["pad_token_id"], shapes.onnx_inputs(engines.files.shape)

    def chunk_logits(chunk: Pairs) -> torch.Tensor:
        ids, segments, mask = padded(chunk, pad)
        feed = dict(zip(("input_ids", "attention_mask", "token_type_ids"), (ids, mask, segments), strict=True))
        return torch.from_numpy(session.run(["logits"], {n: feed[n].numpy() for n in names})[0])[:, 0]

    return lambda pairs: batched(pairs, chunk_logits)


def scorers(engines: Engines, threads: int, ours: Callable | None = None, hf: Callable | None = None,
            ort: Callable | None = None) -> dict[str, Callable]:
    """Every engine's scorer at ``threads`` (ONNX Runtime: its session of that thread count), built by
    ``ours(checkpoint)`` (each of ``engines.ours_engines``), ``hf(engines)``, ``ort(engines, session)``: this module's
    pair scorers unless given (NER's token ones)."""
    ours, hf, ort = ours or ours_scorer, hf or hf_scorer, ort or ort_scorer
    out = {engine: ours(checkpoint) for engine, checkpoint in engines.ours_engines.items()} | {"HF": hf(engines)}
    out |= {f"ORT {kind}": ort(engines, engines.ort[kind, threads]) for kind in ("fp32", "int8")
            if (kind, threads) in engines.ort}
    return out


def scored(scorer: Scorer, pairs: Pairs) -> Callable[[], list[int]]:
    """A timed run: every pair scored (logit through the cross-encoder's activation); returns the pairs scored."""
    activation = ACTIVATIONS[DEFAULT_ACTIVATION]
    return lambda: [activation(scorer(pairs)).numel()]


def check_outputs(engines: Engines, cells_pairs: dict[int, Pairs], threads: int) -> list[list[str]]:
    """Each engine's logits of every cell's pairs against HF's: rows of the outputs table; a fp32 engine over
    :data:`FP32_ATOL` goes into ``engines.excluded``."""
    candidates = scorers(engines, threads)
    hf = candidates.pop("HF")
    reference = {n: hf(pairs) for n, pairs in cells_pairs.items()}
    rows = []
    for engine, scorer in candidates.items():
        error, same_order, correlation = 0.0, True, 1.0
        for n, pairs in cells_pairs.items():
            got = scorer(pairs)
            error = max(error, (got - reference[n]).abs().max().item())
            same_order &= bool(torch.equal(got.argsort(descending=True), reference[n].argsort(descending=True)))
            correlation = min(correlation, correlation_with(got, reference[n]))
        pairs = sum(map(len, cells_pairs.values()))
        text = f"max abs difference from HF's logits {error:.1e} over {pairs} pairs, correlation {correlation:.4f}, " \
            f"HF's order {'kept' if same_order else 'not kept'}"
        if quantized(engine):
            text += " (quantized: reported, not required)"
        elif error > FP32_ATOL:
            engines.excluded[engine] = text
            logger.error("%s %s: %s", engines.files.shape.name, engine, text)
            text = f"MISMATCH: {text} (over {FP32_ATOL:g}): not timed"
        rows.append([engine, "rerank logits vs HF", text])
    return rows


def correlation_with(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Pearson's correlation of two engines' logits over the same pairs."""
    return torch.corrcoef(torch.stack([logits.double(), reference.double()]))[0, 1].item()


def timed_cells(engines: Engines, workloads: dict[int, W], run: Callable[[Callable, W], Callable[[], list[int]]],
                label: str, length: int, args: argparse.Namespace, probe: floor.BandwidthProbe,
                scorers_at: Callable[[Engines, int], dict[str, Callable]] | None = None) -> list[Cell]:
    """One cell per workload (batch -> its inputs), every engine at every thread count alternating: ``run(scorer,
    work)`` is an engine's timed call, ``label`` the cell's name with ``{}`` for the batch, ``scorers_at`` the
    engines' scorers at a thread count (this module's pair scorers unless given)."""
    name, cells, scorers_at = engines.files.shape.name, [], scorers_at or scorers
    for k, (batch, work) in enumerate(workloads.items(), 1):
        logger.info("%s: cell %d/%d, %s (%s)", name, k, len(workloads), label.format(batch), load())
        variants = {f"{engine}@{n}": (1 if engine.startswith("ORT") else n, run(scorer, work))
                    for n in args.threads for engine, scorer in scorers_at(engines, n).items()
                    if engine not in engines.excluded}
        cell = Cell(name, label.format(batch), batch, 0, batch, length=length)
        cells.append(alternate(cell, variants, batch, args.repeats, args.prune, probe))
    return cells


def floors(cells: list[Cell], lengths: dict[int, list[int]], spec: shapes.Shape, peak: floor.Rates) -> dict:
    """(family, batch, label) -> floor seconds by weight bytes (floor.by_precision) of each cell, whose rows are
    ``lengths[batch]`` tokens long, at the bandwidth read during it."""
    out = {}
    for c in cells:
        rates = peak.during(c.read_bandwidth())
        out[c.family, c.batch, c.label] = floor.by_precision(
            rates, partial(floor.encoder_floor, lengths[c.batch], rates, dims=spec.dims))
    return out


def rate(cell: Cell, engine: str) -> str:
    """``engine``'s best rate in ``cell`` (one decimal: a base model scores a few pairs a second per core)."""
    best = cell.best(engine)
    return f"{best[0]:,.1f} ({best[1]}t)" if best else "-"


def results_table(cells: list[Cell], excluded: dict[str, str], unit: str = "pairs", count: str = "documents") -> str:
    """Each engine's best ``unit``/s per cell and ours over each peer (NER: texts per batch)."""
    engines = [e for e in ENGINES if any(c.best(e) for c in cells) or e in excluded]
    pairs = [(a, b) for a, b in PEERS if a in engines and b in engines]
    headers = ["cell", count, *[f"{e} {unit}/s" for e in engines], *[f"{a} / {b}" for a, b in pairs]]
    rows = [[c.label, c.batch, *["MISMATCH" if e in excluded else rate(c, e) for e in engines],
             *[ratio_text(c.ratio(a, b)) for a, b in pairs]] for c in cells]
    return markdown_table(headers, rows)


def floor_table(cells: list[Cell], limits: dict, fp32_weights: int, unit: str = "pairs") -> tuple[str, dict]:
    """Each cell's floor (pairs/s) and each engine's share of it (floor time / its time); the shares by
    (family, batch, label, engine)."""
    rows, shares = [], {}
    engines = [e for e in ENGINES if any(c.best(e) for c in cells)]
    for c in cells:
        limit = limits[c.family, c.batch, c.label]
        fp32, int8 = limit[floor.FP32], limit[floor.INT8]
        read = c.read_bandwidth().get(fp32_weights)
        row = [c.label, f"{read / 1e9:.1f}" if read else "-", f"{c.items / fp32:,.1f}", f"{c.items / int8:,.1f}"]
        for engine in engines:
            best, seconds = c.best(engine), floor_seconds(engine, limit)
            if best and seconds is not None:
                shares[c.family, c.batch, c.label, engine] = best[0] * seconds / c.items
            row.append(f"{shares[c.family, c.batch, c.label, engine]:.0%}" if best and seconds is not None else "-")
        rows.append(row)
    headers = ["cell", "read GB/s", f"floor fp32 {unit}/s", f"floor int8 {unit}/s",
               *[f"{e} % of floor" for e in engines]]
    return markdown_table(headers, rows), shares


def targets_table(cells: list[Cell], shares: dict[tuple[str, int, str, str], float]) -> str:
    """The issue's goals for the rerank cells, measured (met or MISSED); the floor's on the most documents (64)."""
    rows, most = [], max(c.batch for c in cells)

    def check(target: str, cell: Cell, value: float | None, goal: float, text: str, retired: str | None = None) -> None:
        if value is not None:
            rows.append([target, cell.label, text.format(value), retired or ("met" if value >= goal else "MISSED")])

    for c in cells:
        check("ours fp32 >= ORT fp32", c, c.ratio("ours", "ORT fp32"), 1.0, "{:.2f}x")
        check("ours int8 >= ORT int8", c, c.ratio("ours int8", "ORT int8"), 1.0, "{:.2f}x")
        check("ours fp32 >= 1.5x HF", c, c.ratio("ours", "HF"), 1.5, "{:.2f}x",
              hf_retired(shares.get((c.family, c.batch, c.label, "HF"))))
        if c.batch == most:
            for engine in ("ours", "ours int8"):
                share = shares.get((c.family, c.batch, c.label, engine))
                if share:  # time / floor time = 1 / share
                    check(f"{engine}: time under 1.3x the floor's", c, 1.3 * share, 1.0, f"{1 / share:.2f}x the floor")
    return markdown_table(["target", "cell", "measured", ""], rows)


def run(args: argparse.Namespace) -> str:
    spec = shapes.shape(args.shape, args.tiny)
    if spec.job != "rerank":
        raise ValueError(f"{spec.name} is a {spec.job!r} shape: benchmarks/ner_compare.py runs its cells")
    grid = (TINY_GRIDS if args.tiny else GRIDS)[args.shape]
    files = shapes.build(args.shape, args.cache, args.tiny)
    out = [f"Machine: {machine_line()}", f"Peers: {versions()}", f"Ours: {kernels()}",
           f"Threads tried per engine: {args.threads}",
           f"Shape: {spec.name}{' (tiny)' if args.tiny else ''}: {spec.architecture}, d_model {spec.dims.d_model}, "
           f"{spec.dims.layers} layers, ffn {spec.dims.d_ff}, vocabulary {spec.vocab:,}, one label, random weights, "
           f"files under {files.root}; a {grid.query_len}-token query and {grid.documents} documents, pairs of "
           f"{grid.shortest}-{grid.pair_len} tokens in chunks of {CHUNK}; median of {args.repeats} "
           "alternating runs after 1 warm-up", "", f"Start: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    logger.info("%s: measuring the floor's rates, loading the engines (%s)", spec.name, load())
    rates = measure_rates(spec, args.threads)
    probe = floor.BandwidthProbe(weight_bytes(spec), args.threads)
    engines = load_engines(files, args.threads)
    if engines.ort:
        out.append(f"ONNX Runtime graph: {shapes.onnx_fusions(files)} (onnxruntime.transformers.optimizer), "
                   "int8: quantize_dynamic of it")
    cells_pairs = {n: rerank_pairs(spec, n, grid, seed=n) for n in grid.documents}
    logger.info("%s: comparing outputs", spec.name)
    checks = check_outputs(engines, cells_pairs, args.threads[0])
    cells = timed_cells(engines, cells_pairs, scored, "rerank {} docs", grid.pair_len, args, probe)
    out += [f"Cells done: {load()}"]
    rates = rates.best_with(measure_rates(spec, args.threads))
    lengths = {n: [len(ids) for ids, _ in pairs] for n, pairs in cells_pairs.items()}
    table, shares = floor_table(cells, floors(cells, lengths, spec, rates), weight_bytes(spec)[0])
    pruned = "; ".join(f"{c.label}: {', '.join(c.pruned)}" for c in cells if c.pruned)
    bw = ", ".join(f"{size / 1e6:.0f} MB: {r / 1e9:.1f} GB/s" for size, r in rates.bandwidth.items())
    out += ["", "### Outputs", "", markdown_table(["engine", "check", "result"], checks), "",
            "### Results (pairs/s, best thread count in brackets; ratios of pairs/s)", "",
            results_table(cells, engines.excluded), "",
            f"Timed by their warm-up only (over {args.prune}x slower than the same engine's best): {pruned or 'none'}",
            "", "### Targets", "", targets_table(cells, shares), "",
            "### Floor", "", f"Best read bandwidth by working set: {bw}; fp32 GEMM {rates.fp32_flops / 1e9:.0f} "
            f"GFLOP/s, int8 GEMM {rates.int8_ops / 1e9:.0f} GOP/s; threads of each best: {rates.threads}. A cell's "
            "floor: every pair's own tokens through every layer (padding excluded), the weights read once, at the "
            "bandwidth read during the cell.", "", table, "", f"End: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    return "\n".join(out)


__all__ = ["GRIDS", "check_outputs", "rerank_pairs", "run", "scorers"]
