"""Ours vs Hugging Face ``generate()`` vs CTranslate2 on identical weights: `python -m benchmarks.compare`.

The models are random, of the issue's shape (benchmarks/peers.py builds, exports and converts them);
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
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import floor, peers
from benchmarks.common import machine_line, markdown_table
from model.checkpoint import save_checkpoint

logger = logging.getLogger("benchmarks.compare")


@dataclass
class Cell:
    """One workload and the median seconds of each variant ("engine@threads")."""

    family: str
    label: str  # "greedy", "beam 4", "forward"
    batch: int
    beams: int
    items: int  # tokens (or sequences) per run, for the rate
    seconds: dict[str, float] = field(default_factory=dict)
    pruned: list[str] = field(default_factory=list)  # variants timed by their warm-up only

    def best(self, engine: str) -> tuple[float, int] | None:
        """(rate, threads) of ``engine`` in its fastest thread count."""
        found = [(self.items / s, int(v.rsplit("@", 1)[1])) for v, s in self.seconds.items()
                 if v.rsplit("@", 1)[0] == engine]
        return max(found) if found else None

    def ratio(self, engine: str, peer: str) -> float | None:
        a, b = self.best(engine), self.best(peer)
        return a[0] / b[0] if a and b else None


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


_CALLED: set[tuple[str, str]] = set()  # (family, engine) pairs that have run once in this process


def _slow(times: dict[str, list[float]], prune: float) -> list[str]:
    """Variants whose (warm-up) time is over ``prune`` x the fastest of the same engine."""
    fastest: dict[str, float] = {}
    for name, (warm,) in times.items():
        engine = name.rsplit("@", 1)[0]
        fastest[engine] = min(fastest.get(engine, warm), warm)
    return [n for n, (warm,) in times.items() if warm > prune * fastest[n.rsplit("@", 1)[0]]]


def alternate(cell: Cell, variants: dict[str, tuple[int, Callable[[], list[int]]]], expected: int,
              repeats: int, prune: float) -> Cell:
    """Warm up, then time every variant ``repeats`` times in rotating order; store the medians.

    A thread count whose warm-up took over ``prune`` x the same engine's fastest warm-up, twice, is
    not timed further (on a shared machine, spinning OpenMP threads can make it 5-30x slower): its
    faster warm-up stands as its result, which is never an engine's best.
    """
    times: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    for name, (threads, run) in variants.items():  # an engine's first call ever may set things up: not timed
        key = (cell.family, name.rsplit("@", 1)[0])
        if key not in _CALLED:
            _CALLED.add(key)
            torch.set_num_threads(threads)
            run()
    for round_ in range(repeats + 1):
        for name in order[round_ % len(order):] + order[: round_ % len(order)]:
            threads, run = variants[name]
            torch.set_num_threads(threads)
            start = time.perf_counter()
            produced = run()
            elapsed = time.perf_counter() - start
            if any(n != expected for n in produced):
                raise RuntimeError(f"{name} in {cell.family} {cell.label} b{cell.batch}: produced {produced}, "
                                   f"expected {expected} each")
            times[name].append(elapsed)
        if round_ == 0:
            slow = _slow(times, prune)
            for name in slow:  # a second chance: one slow warm-up may be a burst of other work
                threads, run = variants[name]
                torch.set_num_threads(threads)
                start = time.perf_counter()
                run()
                times[name] = [min(times[name][0], time.perf_counter() - start)]
            slow = _slow(times, prune)
            if slow:
                logger.info("%s %s b%d: not timing %s further (warm-up over %.1fx its engine's fastest)",
                            cell.family, cell.label, cell.batch, ", ".join(slow), prune)
                cell.pruned += slow
            order = [n for n in order if n not in slow]
            for name in order:
                times[name].clear()
    cell.seconds = {v: statistics.median(t) for v, t in times.items()}
    logger.info("%s %s b%d: %s", cell.family, cell.label, cell.batch,
                ", ".join(f"{v} {cell.items / s:,.0f}/s" for v, s in cell.seconds.items()))
    return cell


def decode_cells(models: peers.Models, args: argparse.Namespace, translators: dict) -> list[Cell]:
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
            cells.append(alternate(cell, variants, new, args.repeats, args.prune))
    return cells


def classifier_cells(models: peers.Models, args: argparse.Namespace) -> list[Cell]:
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
        cells.append(alternate(cell, variants, batch, args.classifier_repeats, args.prune))
    return cells


ENGINES = ("ours", "ours int8", "HF", "CT2 fp32", "CT2 int8")


def _rate(cell: Cell, engine: str) -> str:
    best = cell.best(engine)
    return f"{best[0]:,.0f} ({best[1]}t)" if best else "-"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def results_table(cells: list[Cell]) -> str:
    engines = [e for e in ENGINES if any(c.best(e) for c in cells)]
    peers_ = [e for e in ("HF", "CT2 fp32") if e in engines]
    headers = ["cell", "batch", *[f"{e} /s" for e in engines], *[f"ours / {p}" for p in peers_]]
    if "CT2 int8" in engines:
        headers += ["ours int8 / CT2 int8"]
    rows = []
    for c in cells:
        row = [f"{c.family} {c.label}", c.batch, *[_rate(c, e) for e in engines],
               *[_x(c.ratio("ours", p)) for p in peers_]]
        if "CT2 int8" in engines:
            row.append(_x(c.ratio("ours int8", "CT2 int8")))
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


def floor_table(cells: list[Cell], rates: floor.Rates, args: argparse.Namespace) -> str:
    rows = []
    for c in cells:
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


def versions() -> str:
    import transformers

    parts = [f"transformers {transformers.__version__}"]
    try:
        import ctranslate2

        parts.append(f"ctranslate2 {ctranslate2.__version__}")
    except ImportError:
        parts.append("ctranslate2 not installed")
    return " · ".join(parts)


def kernels() -> str:
    """Which of our C++ kernels run here (model/native.py), or why none does."""
    from model import int8_kernel, native, packed_weights

    module, why = int8_kernel.available()
    int8 = "AVX512-VNNI kernel" if module is not None and int8_kernel.kernel_choice() != "fbgemm" else \
        f"fbgemm ({why or 'TSERVE_INT8_KERNEL=fbgemm'})"
    if native.kernels() is None:
        return f"int8 GEMM {int8}; decoding step: Python replay, MKL, SDPA"
    packed = "panel GEMM over packed weights" if packed_weights.enabled() else "MKL (TSERVE_PACKED_WEIGHTS=off)"
    return (f"int8 GEMM {int8}; decoding step (AVX-512): native layers, few-rows GEMV, beyond 4 rows {packed}, "
            "attention, LayerNorm/activations/cache writes, greedy choice")


def run(args: argparse.Namespace) -> str:
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
    cells = []
    try:
        if not args.skip_decode:
            cells += decode_cells(models, args, translators)
            out += ["", f"Decoding done: {load()}"]
    finally:
        for translator in translators.values():
            translator.close()
    if not args.skip_classifier:
        cells += classifier_cells(models, args)
        out += [f"Classifier done: {load()}"]
    overhead = None
    if not args.skip_service:
        from benchmarks import overhead as service_overhead

        torch.set_num_threads(1)
        save_checkpoint(root / "serve" / "causal_lm", models.causal, models.tokenizer)
        overhead = service_overhead.measure(root / "serve", "causal_lm", args.new_tokens, max(args.repeats, 5))
        out += [f"Service done: {load()}"]
    working_sets = [floor.decoder_weights(f) * b for f in ("causal_lm", "seq2seq") for b in (floor.FP32, floor.INT8)]
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
    out += ["### Floor", "", f"Read bandwidth by working set: {bw}; fp32 GEMM {rates.fp32_flops / 1e9:.0f} GFLOP/s, "
            f"int8 GEMM {rates.int8_ops / 1e9:.0f} GOP/s; threads of each best: {rates.threads}", "",
            floor_table(cells, rates, args), "", f"End: {time.strftime('%Y-%m-%d %H:%M:%S')}, {load()}"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16/8 new tokens, 1 round, smaller batches: a smoke run")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts tried per engine")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per decoding cell")
    parser.add_argument("--prune", type=float, default=3.0,
                        help="stop timing a thread count whose warm-up is this many times slower than the "
                        "same engine's fastest (default %(default)s)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-classifier", action="store_true")
    parser.add_argument("--skip-service", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
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
