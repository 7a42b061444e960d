"""Ours vs HF vs ONNX Runtime on token classification (NER): `python -m benchmarks.compare --shape distilbert-base`.

The shape (benchmarks/shapes.py): DistilBertForTokenClassification, 6 layers, d 768, 12 heads, FFN 3,072, vocabulary
30,522, 9 BIO labels, random weights, a WordPiece tokenizer of the model's size. Inputs are texts of random filler
words ("w123"), one token each, encoded by our tokenizer with its template: ``[CLS] words [SEP]``.

Cells: batches of 1, 8 and 32 texts of 128 tokens each, in chunks of the service's ``max_batch_size`` (32). What
every engine computes in a timed run, like for like: each text's per-token label probabilities (softmax of the
token logits, trimmed to the text's tokens: what ``model.token_entities.probabilities`` hands the aggregation):

- ours fp32 / int8 / bf16: ``load_checkpoint`` + ``prepare_for_inference`` (benchmarks/shape_engines.py), then what the
  service's "tokens" PoolingJob computes: ``pad_batch``, ``TransformerClassifier.token_logits``;
- HF: DistilBertForTokenClassification's forward with the attention mask (the token-classification pipeline's
  model call; the pipeline itself tokenizes text one input at a time, so it is not the like-for-like peer);
- ONNX Runtime fp32 / int8: the model exported with per-token logits, fused as the bert-base shape's, and its
  ``quantize_dynamic`` copy (Optimum-style inputs: input_ids, attention_mask).

The entity aggregation (model.token_entities via service.engine.entities.found, strategy "simple", ignore "O") is
the same Python code after every engine, so it is left out of the timed runs and timed once on its own: the report
gives its milliseconds per cell and its share of ours' time (add it to every engine's time to see the service's).

Before timing, every engine's logits (the cells' texts and a padded batch of texts of different lengths) are
compared with HF's: a fp32 engine more than ``encoder_compare.FP32_ATOL`` away is reported as MISMATCH and not
timed; int8's and bf16's largest difference and how many tokens keep HF's label are reported. Timing, floor and
tables as the rerank cells (benchmarks/encoder_compare.py, benchmarks/cells.py). ``--quick``: one timed round.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks import encoder_compare, floor, shapes
from benchmarks.cells import Cell, hf_retired, kernels, load, versions
from benchmarks.common import machine_line, markdown_table
from benchmarks.shape_compare import measure_rates, weight_bytes
from benchmarks.shape_engines import Engines, load_engines, quantized
from model.checkpoint import Checkpoint
from model.tokenizer import TokenSpans, pad_batch
from service.engine.entities import found
from service.engine.pooling import batch_order

logger = logging.getLogger("benchmarks.ner_compare")

CHUNK = encoder_compare.CHUNK
STRATEGY = "simple"  # the aggregation timed on its own
Rows = list[list[int]]  # each text's token ids, the template's included
TokenScorer = Callable[[Rows], list[torch.Tensor]]  # rows -> each row's token logits (its tokens, labels)


@dataclass(frozen=True)
class NerGrid:
    """The NER cells: texts per batch, tokens per text."""

    batches: list[int]
    length: int


GRIDS = {"distilbert-base": NerGrid([1, 8, 32], 128)}
TINY_GRIDS = {"distilbert-base": NerGrid([1, 3, 40], 16)}  # 40: more than one chunk


@dataclass(frozen=True)
class Texts:
    """One cell's texts and their encodings (our tokenizer's: ids, pieces, offsets)."""

    texts: list[str]
    spans: list[TokenSpans]

    @property
    def rows(self) -> Rows:
        return [s.ids for s in self.spans]


def filler_words(engines: Engines) -> list[str]:
    """The tokenizer's filler words ("w0", "w1", ...): one token each."""
    vocab = engines.ours.tokenizer.backend.get_vocab()
    return sorted((w for w in vocab if w.startswith("w") and w[1:].isdigit()), key=vocab.get)


def make_texts(engines: Engines, lengths: list[int], seed: int) -> Texts:
    """Texts of random filler words whose encodings are ``lengths`` tokens long ([CLS] and [SEP] included)."""
    words, generator = filler_words(engines), torch.Generator().manual_seed(seed)
    texts = [" ".join(words[i] for i in torch.randint(0, len(words), (n - 2,), generator=generator).tolist())
             for n in lengths]
    spans = [engines.ours.tokenizer.encode_windows(t)[0] for t in texts]
    assert [len(s.ids) for s in spans] == lengths, "a filler word is not one token"
    return Texts(texts, spans)


def chunked(rows: Rows, pad: int, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
            ) -> list[torch.Tensor]:
    """``forward(ids, attention mask)`` of ``rows`` in chunks of :data:`CHUNK` as the service forwards them (longest
    first over more than one chunk: service.engine.pooling.batch_order), each padded to its longest row by the
    service's pad_batch; each row's logits trimmed to its tokens, in the rows' order."""
    order = batch_order([len(row) for row in rows], CHUNK)
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for start in range(0, len(rows), CHUNK):
        chunk = order[start: start + CHUNK]
        ids, _ = pad_batch([rows[i] for i in chunk], pad)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(chunk):
            mask[r, : len(rows[i])] = 1
        logits = forward(ids, mask)
        for r, i in enumerate(chunk):
            out[i] = logits[r, : len(rows[i])]
    return out


def ours_scorer(checkpoint: Checkpoint) -> TokenScorer:
    model = checkpoint.model

    def logits(rows: Rows) -> list[torch.Tensor]:
        with torch.inference_mode():
            return chunked(rows, model.config.pad_id,
                           lambda ids, _: model.token_logits(ids, torch.zeros_like(ids)).float())

    return logits


def hf_scorer(engines: Engines) -> TokenScorer:
    def logits(rows: Rows) -> list[torch.Tensor]:
        with torch.inference_mode():
            return chunked(rows, engines.hf.config.pad_token_id,
                           lambda ids, mask: engines.hf(input_ids=ids, attention_mask=mask).logits)

    return logits


def ort_scorer(engines: Engines, session) -> TokenScorer:
    pad = engines.files.shape.config["pad_token_id"]

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
        return torch.from_numpy(session.run(["logits"], feed)[0])

    return lambda rows: chunked(rows, pad, forward)


def scorers(engines: Engines, threads: int) -> dict[str, TokenScorer]:
    """Every engine's token logits at ``threads`` (ONNX Runtime: its session of that thread count)."""
    return encoder_compare.scorers(engines, threads, ours_scorer, hf_scorer, ort_scorer)


def probabilities(scorer: TokenScorer, rows: Rows) -> Callable[[], list[int]]:
    """A timed run: each row's per-token label probabilities; returns the rows done."""
    def run() -> list[int]:
        return [len([torch.softmax(logits, -1) for logits in scorer(rows)])]

    return run


def check_outputs(engines: Engines, inputs: dict[str, Rows], threads: int) -> list[list[str]]:
    """Each engine's token logits against HF's on every set of ``inputs``: rows of the outputs table; a fp32 engine
    over ``encoder_compare.FP32_ATOL`` goes into ``engines.excluded``."""
    candidates = scorers(engines, threads)
    hf = candidates.pop("HF")
    reference = {name: torch.cat(hf(rows)) for name, rows in inputs.items()}
    tokens = sum(len(r) for r in reference.values())
    out = []
    for engine, scorer in candidates.items():
        error, same = 0.0, 0
        for name, rows in inputs.items():
            got = torch.cat(scorer(rows))
            error = max(error, (got - reference[name]).abs().max().item())
            same += int((got.argmax(-1) == reference[name].argmax(-1)).sum())
        text = f"max abs difference from HF's logits {error:.1e} over {tokens} tokens, HF's label on {same}/{tokens}"
        if quantized(engine):
            text += " (quantized: reported, not required)"
        elif error > encoder_compare.FP32_ATOL:
            engines.excluded[engine] = text
            logger.error("%s %s: %s", engines.files.shape.name, engine, text)
            text = f"MISMATCH: {text} (over {encoder_compare.FP32_ATOL:g}): not timed"
        out.append([engine, "token logits vs HF", text])
    return out


def aggregation_seconds(engines: Engines, texts: Texts, repeats: int) -> float:
    """The best time of the service's entity aggregation (strategy :data:`STRATEGY`) over ours' logits of
    ``texts``: the same code after every engine."""
    checkpoint = engines.ours
    logits = ours_scorer(engines.ours)(texts.rows)
    id2label = {int(k): v for k, v in engines.files.shape.config["id2label"].items()}
    best = float("inf")
    for _ in range(max(repeats, 3)):
        start = time.perf_counter()
        found(checkpoint.tokenizer, texts.texts, [[s] for s in texts.spans], iter(logits), id2label, STRATEGY, ["O"])
        best = min(best, time.perf_counter() - start)
    return best


def targets_table(cells: list[Cell], shares: dict) -> str:
    """The issue's goals for the NER cells, measured (met or MISSED), and each engine's share of the floor."""
    rows = []

    def check(target: str, cell: Cell, value: float | None, goal: float | None, text: str = "{:.2f}x",
              retired: str | None = None) -> None:
        if value is not None:
            verdict = retired or ("(reported)" if goal is None else "met" if value >= goal else "MISSED")
            rows.append([target, cell.label, text.format(value), verdict])

    for c in cells:
        check("ours fp32 >= ORT fp32", c, c.ratio("ours", "ORT fp32"), 1.0)
        check("ours int8 >= ORT int8", c, c.ratio("ours int8", "ORT int8"), 1.0)
        check("ours fp32 >= 1.5x HF", c, c.ratio("ours", "HF"), 1.5,
              retired=hf_retired(shares.get((c.family, c.batch, c.label, "HF"))))
        for engine in ("ours", "ours int8"):
            check(f"{engine} % of the floor", c, shares.get((c.family, c.batch, c.label, engine)), None, "{:.0%}")
    return markdown_table(["target", "cell", "measured", ""], rows)


def run(args: argparse.Namespace) -> str:
    spec = shapes.shape(args.shape, args.tiny)
    grid = (TINY_GRIDS if args.tiny else GRIDS)[args.shape]
    files = shapes.build(args.shape, args.cache, args.tiny)
    out = [f"Machine: {machine_line()}", f"Peers: {versions()}", f"Ours: {kernels()}",
           f"Threads tried per engine: {args.threads}",
           f"Shape: {spec.name}{' (tiny)' if args.tiny else ''}: {spec.architecture}, d_model {spec.dims.d_model}, "
           f"{spec.dims.layers} layers, ffn {spec.dims.d_ff}, vocabulary {spec.vocab:,}, "
           f"{len(spec.config['id2label'])} labels, random weights, files under {files.root}; batches {grid.batches} "
           f"of {grid.length}-token texts in chunks of {CHUNK}; per-token probabilities timed, the aggregation apart; "
           f"median of {args.repeats} alternating runs after 1 warm-up", "",
           f"Start: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    logger.info("%s: measuring the floor's rates, loading the engines (%s)", spec.name, load())
    rates = measure_rates(spec, args.threads)
    probe = floor.BandwidthProbe(weight_bytes(spec), args.threads)
    engines = load_engines(files, args.threads)
    if engines.ort:
        out.append(f"ONNX Runtime graph: {shapes.onnx_fusions(files)} (onnxruntime.transformers.optimizer), "
                   "int8: quantize_dynamic of it")
    cells_texts = {n: make_texts(engines, [grid.length] * n, seed=n) for n in grid.batches}
    shortest = max(4, grid.length // 4)
    padded = make_texts(engines, torch.linspace(grid.length, shortest, 5).long().tolist(), seed=99)
    logger.info("%s: comparing outputs", spec.name)
    checks = check_outputs(engines, {"padded": padded.rows} | {str(n): t.rows for n, t in cells_texts.items()},
                           args.threads[0])
    torch.set_num_threads(args.threads[0])
    largest = max(grid.batches)
    aggregation = aggregation_seconds(engines, cells_texts[largest], args.repeats)
    cells = encoder_compare.timed_cells(engines, cells_texts, lambda scorer, texts: probabilities(scorer, texts.rows),
                                        "NER batch {}", grid.length, args, probe, scorers)
    out += [f"Cells done: {load()}"]
    rates = rates.best_with(measure_rates(spec, args.threads))
    table, shares = encoder_compare.floor_table(cells, encoder_compare.floors(
        cells, {n: [len(r) for r in t.rows] for n, t in cells_texts.items()}, spec, rates),
                                                weight_bytes(spec)[0], unit="texts")
    pruned = "; ".join(f"{c.label}: {', '.join(c.pruned)}" for c in cells if c.pruned)
    bw = ", ".join(f"{size / 1e6:.0f} MB: {r / 1e9:.1f} GB/s" for size, r in rates.bandwidth.items())
    ours = next(c for c in cells if c.batch == largest).best("ours")
    share = f" ({aggregation * ours[0] / largest:.1%} of ours fp32's time for it)" if ours else ""
    out += ["", "### Outputs", "", markdown_table(["engine", "check", "result"], checks), "",
            "### Results (texts/s, best thread count in brackets; ratios of texts/s)", "",
            encoder_compare.results_table(cells, engines.excluded, unit="texts", count="batch"), "",
            f"Timed by their warm-up only (over {args.prune}x slower than the same engine's best): {pruned or 'none'}",
            "", f"Entity aggregation (strategy {STRATEGY}, ignore O; the same code after every engine, not in the "
            f"times above): {aggregation * 1e3:.1f} ms for the batch of {largest}{share}", "",
            "### Targets", "", targets_table(cells, shares), "",
            "### Floor", "", f"Best read bandwidth by working set: {bw}; fp32 GEMM {rates.fp32_flops / 1e9:.0f} "
            f"GFLOP/s, int8 GEMM {rates.int8_ops / 1e9:.0f} GOP/s; threads of each best: {rates.threads}. A cell's "
            "floor: every text's tokens through every layer, the weights read once, at the bandwidth read during the "
            "cell.", "", table, "", f"End: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    return "\n".join(out)


__all__ = ["GRIDS", "TINY_GRIDS", "check_outputs", "make_texts", "run", "scorers"]
