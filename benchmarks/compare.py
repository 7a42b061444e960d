"""Ours vs Hugging Face ``generate()`` vs CTranslate2 on identical weights: `python -m benchmarks.compare`.

``--shape toy`` (the default) is described here; ``--shape opus-mt``, ``bert-base`` and ``gpt2-small`` (the
shapes people serve, with ONNX Runtime for the classifier) in benchmarks/shape_compare.py; ``smollm2-135m`` and
``qwen2.5-0.5b`` (Llama-style decoders, with llama.cpp and CTranslate2) in benchmarks/decoder_compare.py;
``xlm-roberta-base`` (a cross-encoder's rerank, with ONNX Runtime) in benchmarks/encoder_compare.py and
``distilbert-base`` (NER: token classification, with ONNX Runtime) in benchmarks/ner_compare.py;
``--device cuda`` (ours vs HF on a GPU, on the first three of those shapes: every one, or the one ``--shape`` names)
in benchmarks/gpu_compare.py.

The toy models are random, of one shape (benchmarks/peers.py builds, exports and converts them);
min_new_tokens = max_new_tokens fixes every length. Cells:

- causal_lm: greedy at batch 1, 8, 32 and beam 4 at batch 1, 8 (16-token prompts, 128 new tokens);
- seq2seq: greedy and beam 4 at batch 1 and 16 (32-token sources, 64 new tokens), CTranslate2 fp32/int8
  (each translator in a process of its own: see peers.CT2Process);
- classifier: one forward at batch 1, 8, 64 of 64-token sequences;
- the floor (benchmarks/floor.py) of each cell, and what the service adds (benchmarks/overhead.py).

Every engine runs at each thread count of ``--threads`` as its own variant; within a cell all variants
alternate (the order rotating each round) after one warm-up each, and each engine is reported in
its best thread count (a thread count whose warm-up is over ``--prune`` times slower than the
engine's best is not timed further). tokens/s = inputs x new tokens / wall time (beam: the returned sequence per
input), prefill/encoding included. Ratios are ours over the peer, from medians of the same run. The
load average is printed before and after each section: other work on the machine slows everyone.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import decoder_compare, encoder_compare, floor, gpu_compare, ner_compare, peers, shape_compare, shapes
from benchmarks.cells import Cell, alternate, kernels, load, rate, ratio_text, versions
from benchmarks.common import machine_line, markdown_table
from model.checkpoint import save_checkpoint


def decode_cells(models: peers.Models, args: argparse.Namespace, translators: dict,
                 probe: floor.BandwidthProbe) -> list[Cell]:
    cells = []
    for family, grid in (("causal_lm", args.causal_cells), ("seq2seq", args.seq2seq_cells)):
        causal = family == "causal_lm"
        new = args.new_tokens if causal else args.seq2seq_new_tokens
        length = args.prompt_len if causal else args.source_len
        for beams, batch in grid:
            inputs = peers.random_ids(batch, length, seed=batch)
            cell = Cell(family, "greedy" if beams == 1 else f"beam {beams}", batch, beams, batch * new)
            variants = {}
            for n in args.threads:
                if causal:
                    variants[f"ours@{n}"] = (n, peers.ours_causal(models.causal, inputs, beams, new))
                    variants[f"ours int8@{n}"] = (n, peers.ours_causal(models.causal_int8, inputs, beams, new))
                    variants[f"HF@{n}"] = (n, peers.hf_generate(models.hf_causal, inputs, beams, new, True))
                    continue
                variants[f"ours@{n}"] = (n, peers.ours_seq2seq(models.seq2seq, inputs, beams, new))
                variants[f"ours int8@{n}"] = (n, peers.ours_seq2seq(models.seq2seq_int8, inputs, beams, new))
                variants[f"HF@{n}"] = (n, peers.hf_generate(models.hf_seq2seq, inputs, beams, new, False))
                for kind in ("fp32", "int8") if translators else ():
                    run = peers.ct2_translate(translators[kind, n], models.tokenizer, inputs, beams, new)
                    variants[f"CT2 {kind}@{n}"] = (1, run)
            cells.append(alternate(cell, variants, new, args.repeats, args.prune, probe))
    return cells


def classifier_cells(models: peers.Models, args: argparse.Namespace, probe: floor.BandwidthProbe) -> list[Cell]:
    cells = []
    for batch in args.classifier_batches:
        ids = peers.random_ids(batch, args.classifier_len, seed=batch)
        ids[:, 0] = models.tokenizer.cls_id
        variants = {}
        for n in args.threads:
            variants[f"ours@{n}"] = (n, peers.ours_classify(models.classifier, ids))
            variants[f"ours int8@{n}"] = (n, peers.ours_classify(models.classifier_int8, ids))
            variants[f"HF@{n}"] = (n, peers.hf_classify(models.hf_classifier, ids))
        cell = Cell("classifier", "forward", batch, 0, batch)
        cells.append(alternate(cell, variants, batch, args.classifier_repeats, args.prune, probe))
    return cells


ENGINES = ("ours", "ours int8", "HF", "CT2 fp32", "CT2 int8")


def results_table(cells: list[Cell]) -> str:
    engines = [e for e in ENGINES if any(c.best(e) for c in cells)]
    peers_ = [e for e in ("HF", "CT2 fp32") if e in engines]
    headers = ["cell", "batch", *[f"{e} /s" for e in engines], *[f"ours / {p}" for p in peers_]]
    if "CT2 int8" in engines:
        headers += ["ours int8 / CT2 int8"]
    rows = []
    for c in cells:
        row = [f"{c.family} {c.label}", c.batch, *[rate(c, e) for e in engines],
               *[ratio_text(c.ratio("ours", p)) for p in peers_]]
        if "CT2 int8" in engines:
            row.append(ratio_text(c.ratio("ours int8", "CT2 int8")))
        rows.append(row)
    return markdown_table(headers, rows)


def targets(cells: list[Cell], overhead: dict[str, float] | None) -> str:
    """Each target of the issue with its measured value, met or missed."""
    rows = []

    def check(target: str, cell: Cell, value: float | None, goal: float | None) -> None:
        if value is None:
            return
        status = "(reference)" if goal is None else "met" if value >= goal else "MISSED"
        rows.append([target, f"{cell.family} {cell.label} b{cell.batch}", f"{value:.2f}x", status])

    for c in cells:
        if c.family == "causal_lm" and c.label == "greedy" and c.batch in (1, 32):
            check("causal_lm greedy >= 2x HF (fp32)", c, c.ratio("ours", "HF"), 2.0)
            check("ours int8 vs HF fp32", c, c.ratio("ours int8", "HF"), None)
        if c.family == "seq2seq":
            check("seq2seq fp32 >= 1.5x HF", c, c.ratio("ours", "HF"), 1.5)
            check("seq2seq fp32 >= 1x CT2 fp32", c, c.ratio("ours", "CT2 fp32"), 1.0)
            check("seq2seq int8 >= 0.8x CT2 int8", c, c.ratio("ours int8", "CT2 int8"), 0.8)
        if c.family == "classifier":
            check("classifier >= 1x HF (fp32)", c, c.ratio("ours", "HF"), 1.0)
    if overhead:
        added = overhead["http"] / overhead["engine"] - 1
        rows.append(["service adds < 10% over the engine", "causal_lm greedy 128 b1", f"{added:+.1%}",
                     "met" if added < 0.10 else "MISSED"])
    return markdown_table(["target", "cell", "measured", ""], rows)


def floor_table(cells: list[Cell], peak: floor.Rates, args: argparse.Namespace) -> str:
    """Each cell's floor at the bandwidth read during it (the run's best GEMM rates) and each engine's share."""
    rows = []
    for c in cells:
        rates = peak.during(c.read_bandwidth())
        if c.family == "classifier":
            fp32, int8 = (floor.classifier_floor(c.batch, args.classifier_len, rates, b)
                          for b in (floor.FP32, floor.INT8))
        else:
            causal = c.family == "causal_lm"
            shape = (args.prompt_len, args.new_tokens) if causal else (args.source_len, args.seq2seq_new_tokens)
            fp32, int8 = (floor.decode_floor(c.family, c.batch, c.beams, *shape, rates, b)
                          for b in (floor.FP32, floor.INT8))
        row = [f"{c.family} {c.label}", c.batch, f"{c.items / fp32:,.0f}", f"{c.items / int8:,.0f}"]
        for engine in ENGINES:
            best = c.best(engine)
            limit = int8 if "int8" in engine else fp32
            row.append(f"{best[0] * limit / c.items:.0%}" if best else "-")
        rows.append(row)
    headers = ["cell", "batch", "floor fp32 /s", "floor int8 /s", *[f"{e} % of floor" for e in ENGINES]]
    return markdown_table(headers, rows)


def run(args: argparse.Namespace) -> str:
    if args.device != "cpu":
        return gpu_compare.run(args)
    if args.shape in shapes.DECODERS:
        return decoder_compare.run(args)
    if args.shape in shapes.ENCODERS:
        return (ner_compare if shapes.SHAPES[args.shape].job == "entities" else encoder_compare).run(args)
    if args.shape != "toy":
        return shape_compare.run(args)
    out = [f"Machine: {machine_line()}", f"Peers: {versions()}", f"Ours: {kernels()}",
           f"Threads tried per engine: {args.threads}",
           f"Shape: d_model 512, 6 layers, 8 heads, ffn 2048, vocab 8000, random weights; median of "
           f"{args.repeats} alternating runs after 1 warm-up (classifier: {args.classifier_repeats})", ""]
    out.append(f"Start: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}")
    with tempfile.TemporaryDirectory(prefix="compare-") as tmp:
        return "\n".join(out + measure(Path(tmp), args))


def measure(root: Path, args: argparse.Namespace) -> list[str]:
    out = []
    models = peers.build(root)
    translators = {}
    if models.ct2_dir is not None and not args.skip_decode:
        translators = {(kind, n): peers.CT2Process(models.ct2_dir, kind.replace("fp32", "float32"), n)
                       for kind in ("fp32", "int8") for n in args.threads}
    working_sets = [floor.decoder_weights(f) * b for f in ("causal_lm", "seq2seq") for b in (floor.FP32, floor.INT8)]
    probe = floor.BandwidthProbe(working_sets, args.threads)
    cells = []
    try:
        if not args.skip_decode:
            cells += decode_cells(models, args, translators, probe)
            out += ["", f"Decoding done: {load()}"]
    finally:
        for translator in translators.values():
            translator.close()
    if not args.skip_classifier:
        cells += classifier_cells(models, args, probe)
        out += [f"Classifier done: {load()}"]
    overhead = None
    if not args.skip_service:
        from benchmarks import overhead as service_overhead

        torch.set_num_threads(1)
        save_checkpoint(root / "serve" / "causal_lm", models.causal, models.tokenizer)
        overhead = service_overhead.measure(root / "serve", "causal_lm", args.new_tokens, max(args.repeats, 5))
        out += [f"Service done: {load()}"]
    rates = floor.measure_rates(working_sets, args.threads)
    pruned = "; ".join(f"{c.family} {c.label} b{c.batch}: {', '.join(c.pruned)}" for c in cells if c.pruned)
    out += ["", "### Results (items/s, best thread count in brackets)", "", results_table(cells), "",
            f"Timed by their warm-up only (over {args.prune}x slower than the same engine's best): {pruned or 'none'}",
            "",
            "### Targets", "", targets(cells, overhead), ""]
    if overhead:
        rows = [[k, f"{v:.3f}", f"{args.new_tokens / v:,.0f}", f"{v / overhead['offline'] - 1:+.1%}"]
                for k, v in overhead.items()]
        out += ["### Service overhead (causal_lm greedy, batch 1, one client, 1 thread)", "",
                markdown_table(["path", "seconds", "tokens/s", "vs offline"], rows), ""]
    bw = ", ".join(f"{size / 1e6:.0f} MB: {rate / 1e9:.1f} GB/s" for size, rate in rates.bandwidth.items())
    out += ["### Floor", "", f"Best read bandwidth by working set: {bw}; fp32 GEMM {rates.fp32_flops / 1e9:.0f} "
            f"GFLOP/s, int8 GEMM {rates.int8_ops / 1e9:.0f} GOP/s; threads of each best: {rates.threads}. Each "
            "cell's floor takes the bandwidth read during it instead (the best of 3 reads before each timed run, "
            "the median of the runs): the machine's memory is shared with other work.", "",
            floor_table(cells, rates, args), "", f"End: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["toy", *shapes.SHAPES], default="toy",
                        help="toy: this module's d_model 512 models (default); the others: benchmarks/shape_compare.py "
                        "(decoder_compare.py, encoder_compare.py, ner_compare.py)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 round and fewer cells (toy: also 16/8 new tokens, smaller batches)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts tried per engine")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per decoding cell")
    parser.add_argument("--prune", type=float, default=3.0,
                        help="stop timing a thread count whose warm-up is this many times slower than the "
                        "same engine's fastest (default %(default)s)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-classifier", action="store_true")
    parser.add_argument("--skip-service", action="store_true")
    parser.add_argument("--skip-rss", dest="rss", action="store_false",
                        help="Llama-style decoders: leave out the peak RSS of each engine (a fresh process each)")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    parser.add_argument("--cache", type=Path, default=shapes.DEFAULT_CACHE,
                        help="where the shapes' model files are kept between runs (default %(default)s)")
    parser.add_argument("--tiny", action="store_true",
                        help="the shape's architecture at toy sizes, a few tokens: the test's smoke run")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), or a GPU such as cuda: ours vs HF there (benchmarks/gpu_compare.py)")
    parser.add_argument("--dtypes", nargs="+", choices=list(gpu_compare.DTYPES), default=["float32", "bfloat16"],
                        help="--device cuda: the dtypes compared (default %(default)s)")
    args = parser.parse_args(argv)
    args.prompt_len, args.source_len, args.classifier_len = 16, 32, 64
    args.new_tokens, args.seq2seq_new_tokens = 128, 64
    args.causal_cells = [(1, 1), (1, 8), (1, 32), (4, 1), (4, 8)]  # (beams, batch)
    args.seq2seq_cells = [(1, 1), (1, 16), (4, 1), (4, 16)]
    args.classifier_batches = [1, 8, 64]
    args.classifier_repeats = max(args.repeats, 10)
    if args.quick:
        args.new_tokens, args.seq2seq_new_tokens, args.repeats, args.classifier_repeats = 16, 8, 1, 3
        args.causal_cells = [(1, 1), (1, 8), (4, 1)]
        args.seq2seq_cells = [(1, 1), (4, 4)]
        args.classifier_batches = [1, 8]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "transformers", "service"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    report = run(args)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
