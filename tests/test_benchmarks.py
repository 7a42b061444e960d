"""The model benchmarks run end to end: smoke runs on a few tokens, not measurements.

Speed is measured by the benchmarks themselves on a quiet machine (docs/benchmarks.md); these only
check that each command still builds its models, runs every engine or layout to exactly the requested
lengths (the harnesses raise otherwise) and prints every table.
"""

import importlib.util
import re

import pytest

from benchmarks import (
    bf16_gemm,
    compare,
    cpu_rules,
    decode,
    floor,
    gemm,
    gpu_compare,
    grammar,
    layout,
    prefix_cache,
    speculative,
    vmap,
)
from benchmarks.cells import Cell, alternate
from benchmarks.shape_engines import quantized
from model import bf16_linear, native
from model.cpu import kernel_tuning, this_cpu


def _table(report: str, section: str) -> list[list[str]]:
    """The first table under ``### {section}``, header first."""
    text = report.split(f"### {section}", 1)[1].split("###", 1)[0]
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows]


def _results_rows(report: str) -> list[list[str]]:
    return _table(report, "Results")[1:]  # without the header


def test_compare_quick_run_reports_every_engine_and_target(tmp_path):
    out = tmp_path / "compare.md"
    compare.main(["--quick", "--skip-service", "--threads", "1", "--out", str(out)])
    report = out.read_text()

    rows = _results_rows(report)
    assert {(row[0], row[1]) for row in rows} == {
        ("causal_lm greedy", "1"), ("causal_lm greedy", "8"), ("causal_lm beam 4", "1"),
        ("seq2seq greedy", "1"), ("seq2seq beam 4", "4"), ("classifier forward", "1"), ("classifier forward", "8"),
    }
    rate = re.compile(r"^[\d,]+ \(1t\)$")  # items/s at the one thread count tried
    for row in rows:
        engines = row[2:5] + (row[5:7] if row[0].startswith("seq2seq") else [])  # CTranslate2: seq2seq only
        assert all(rate.match(value) and float(value.split()[0].replace(",", "")) > 0 for value in engines), row
        assert re.match(r"^\d+\.\d\dx$", row[7]), row  # ours / HF

    targets = report.split("### Targets", 1)[1].split("###", 1)[0]
    for goal in ("causal_lm greedy >= 2x HF", "seq2seq fp32 >= 1.5x HF", "seq2seq fp32 >= 1x CT2 fp32",
                 "seq2seq int8 >= 0.8x CT2 int8", "classifier >= 1x HF"):
        assert goal in targets
    assert re.search(r"Best read bandwidth by working set: 92 MB: [\d.]+ GB/s", report)
    assert "floor fp32 /s" in report


def test_a_served_shape_at_tiny_size_runs_every_installed_engine(tmp_path):
    """--shape opus-mt --tiny: the HF-layout directory built and cached, ours/HF/CTranslate2 agreeing on greedy
    tokens, every installed engine timed, and the tables produced."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    out, cache = tmp_path / "opus-mt.md", tmp_path / "cache"
    compare.main(["--shape", "opus-mt", "--tiny", "--threads", "1", "--cache", str(cache), "--out", str(out)])
    report = out.read_text()

    engines = ["ours", "ours int8", "ours bf16", "HF"]
    if importlib.util.find_spec("ctranslate2"):
        engines += ["CT2 fp32", "CT2 int8"]
    outputs = _table(report, "Outputs")[1:]
    assert [row[0] for row in outputs] == [e for e in engines if e != "HF"]
    assert all(row[2].startswith("same") for row in outputs), outputs
    results = _table(report, "Results")
    assert results[0][2:2 + len(engines)] == [f"{e} /s" for e in engines]
    assert {(row[0], row[1]) for row in results[1:]} == {("opus-mt greedy", "1"), ("opus-mt beam 4", "2")}
    rate = re.compile(r"^[\d,]+ \(1t\)$")
    for row in results[1:]:
        assert all(rate.match(value) and float(value.split()[0].replace(",", "")) > 0
                   for value in row[2:2 + len(engines)]), row
        assert re.match(r"^\d+\.\d\dx$", row[2 + len(engines)]), row  # ours / HF
    assert "ours fp32 >= 1.5x HF" in report.split("### Targets", 1)[1]
    assert "floor fp32 /s" in report
    assert (cache / "opus-mt-tiny" / "hf" / "config.json").is_file()  # kept for the next run


@pytest.mark.parametrize(("shape", "peers", "cells"), [
    ("bert-base", ["ORT fp32", "ORT int8"], {("bert-base length 16", "1"), ("bert-base length 16", "4")}),
    ("gpt2-small", [], {("gpt2-small greedy", "1"), ("gpt2-small beam 4", "1")}),
])
def test_the_other_shapes_at_tiny_size_check_outputs_then_time_every_engine(tmp_path, shape, peers, cells):
    """--shape bert-base / gpt2-small --tiny: ours (and ONNX Runtime, exported and fused, when installed) agree
    with HF before any timing (logits' argmax / greedy tokens), then every engine is timed."""
    pytest.importorskip("transformers")
    if peers and not (importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx")):
        peers = []
    out = tmp_path / f"{shape}.md"
    compare.main(["--shape", shape, "--tiny", "--threads", "1", "--cache", str(tmp_path / "cache"), "--out", str(out)])
    report = out.read_text()

    outputs = _table(report, "Outputs")[1:]
    assert [row[0] for row in outputs] == ["ours", "ours int8", "ours bf16", *peers]
    agreed = "argmax equal on 4/4" if shape == "bert-base" else "same"
    assert all(agreed in row[2] for row in outputs if not quantized(row[0])), outputs
    engines = ["ours", "ours int8", "ours bf16", "HF", *peers]
    results = _table(report, "Results")
    assert results[0][2:2 + len(engines)] == [f"{e} /s" for e in engines]
    assert {(row[0], row[1]) for row in results[1:]} == cells
    for row in results[1:]:
        assert all(float(value.split()[0].replace(",", "")) > 0 for value in row[2:2 + len(engines)]), row
    floors = _table(report, "Floor")
    assert floors[0][:4] == ["cell", "batch", "read GB/s", "floor fp32 /s"]
    assert all(float(row[2]) > 0 for row in floors[1:]), floors  # the bandwidth read during each cell


def test_a_cells_floor_takes_the_bandwidth_read_during_its_runs():
    """A probe runs before each timed run of every variant (not the warm-ups); the cell's floor uses the median
    reading, so a slower reading gives a longer floor for a bandwidth-bound cell."""
    size = 8_000_000
    probe = floor.BandwidthProbe([size], [1])
    variants = {"ours@1": (1, lambda: [4]), "HF@1": (1, lambda: [4])}
    cell = alternate(Cell("causal_lm", "greedy", 1, 1, 4), variants, 4, 3, 3.0, probe)
    assert len(cell.bandwidth) == 2 * 3 and all(reading[size] > 0 for reading in cell.bandwidth)
    readings = sorted(r[size] for r in cell.bandwidth)
    assert cell.read_bandwidth()[size] == pytest.approx((readings[2] + readings[3]) / 2)

    best = floor.Rates({size: 40e9}, fp32_flops=1e12, int8_ops=4e12, threads={})
    during = best.during({size: 20e9})
    assert during.bandwidth == {size: 20e9} and during.fp32_flops == best.fp32_flops
    assert best.during({}).bandwidth == best.bandwidth  # no probe: the best reading stands

    def seconds(rates: floor.Rates) -> float:
        return floor.decode_floor("causal_lm", 1, 1, 16, 32, rates, floor.FP32)

    assert seconds(during) > 1.5 * seconds(best)  # batch 1 is bound by reading the weights


def test_a_prompts_floor_counts_its_attention_as_the_encoder_floor_does():
    """A source's encoding costs what encoder_floor counts for it (its attention over every pair of tokens) plus the
    cross K/V projections; a causal prompt attends to the keys up to its own position only: T (T + 1) / 2 pairs."""
    rates = floor.Rates({1 << 20: 1e30}, fp32_flops=1e12, int8_ops=4e12, threads={})  # compute-bound: no read time
    dims, tokens = floor.TOY, 96
    encode = floor.decode_floor("seq2seq", 1, 1, tokens, 0, rates, floor.FP32, dims)
    cross_kv = 2 * tokens * dims.layers * 2 * dims.d_model**2 / rates.fp32_flops
    assert encode == pytest.approx(floor.encoder_floor([tokens], rates, floor.FP32, dims) + cross_kv, rel=1e-12)

    def prefill(n: int) -> float:
        return floor.decode_floor("causal_lm", 1, 1, n, 1, rates, floor.FP32, dims)

    pairs = dims.layers * 4 * dims.d_model / rates.fp32_flops  # seconds a (query, key) pair takes
    assert prefill(2 * tokens) - 2 * prefill(tokens) == pytest.approx(
        pairs * (tokens * (2 * tokens + 1) - tokens * (tokens + 1)) - 2 * dims.lm_head / rates.fp32_flops, rel=1e-9)


def test_the_gpu_comparison_checks_then_times_ours_and_hf_on_every_shape_and_dtype(tmp_path):
    """--device cuda's report (benchmarks/gpu_compare.py), run here on the CPU at tiny sizes: each shape in each
    dtype is checked against HF before ours is timed beside it."""
    pytest.importorskip("transformers")
    args = compare.parse_args(["--tiny", "--repeats", "1", "--cache", str(tmp_path / "cache"),
                               "--dtypes", "float32", "bfloat16"])
    report = gpu_compare.run(args)
    checks = _table(report, "Outputs on the device vs HF")[1:]
    assert [row[0] for row in checks] == [f"{s} {d}" for s in gpu_compare.SHAPES for d in ("float32", "bfloat16")]
    assert all("MISMATCH" not in row[1] and ("same" in row[1] or "argmax equal on 4/4" in row[1])
               for row in checks), checks
    results = _results_rows(report)
    assert len(results) == 2 * sum(len(gpu_compare.TINY[s][0]) for s in gpu_compare.SHAPES)
    for row in results:
        assert float(row[3].replace(",", "")) > 0 and float(row[4].replace(",", "")) > 0, row
        assert row[5].endswith("x"), row


def test_gemm_benchmark_checks_then_times_every_kernel(capsys):
    """benchmarks.gemm on a small weight: every engine's product checked against float64 first (it raises
    otherwise), then one row per row count with each engine's rate against MKL."""
    gemm.main(["--rounds", "1", "--rows", "1", "8", "--weights", "64:96", "--threads", "1"])
    table = capsys.readouterr().out.split("| in -> out |", 1)[1]
    rows = re.findall(r"^\| 64 -> 96 \| (\d+) \| \d+ \| (.+) \|$", table, flags=re.MULTILINE)
    assert [int(r) for r, _ in rows] == [1, 8]
    peers = 2 if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx") else 0
    for _, cells in rows:
        assert len(re.findall(r"\d+ \(\d+\.\d\dx\)", cells)) == 2 + peers, cells


def test_bf16_gemm_benchmark_checks_then_times_every_engine(capsys):
    """benchmarks.bf16_gemm on a small, odd weight: the bf16 layers checked against the rounded operands' float64
    product first (it raises otherwise), then one row per row count, ours bf16 where this CPU has AVX512-BF16."""
    bf16_gemm.main(["--rounds", "1", "--rows", "1", "17", "--weights", "33:70", "--threads", "1"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| 33 -> 70 \| (\d+) \| \d+ \| (.+) \|$", out.split("| in -> out |", 1)[1], flags=re.MULTILINE)
    assert [int(r) for r, _ in rows] == [1, 17]
    timed = 3 + (bf16_linear.kernel() is not None)  # fallback, int8, oneDNN bf16; ours bf16 where it runs
    for _, cells in rows:
        assert len(re.findall(r"\d+ \(\d+\.\d\dx\)", cells)) == timed, cells


@pytest.mark.skipif(native.kernels() is None, reason="the C++ kernels do not run here")
def test_cpu_rules_benchmark_checks_then_times_every_rule_and_restores_this_cpus(capsys, tmp_path):
    """benchmarks.cpu_rules at one layer and a tiny GPT-2: each rule's products checked against float64 and its
    tokens against the others' first (it raises otherwise), every cell timed under every rule, and the kernels
    left with this CPU's rule."""
    pytest.importorskip("transformers")
    cpu_rules.main(["--rounds", "1", "--layers", "1", "--rows", "16", "--threads", "1", "--generate", "gpt2-small",
                    "--tiny", "--new-tokens", "4", "--cache", str(tmp_path)])
    out = capsys.readouterr().out
    table = out[out.index("| cell |"):].splitlines()
    assert "this CPU's rule | AMD's rule | Intel's rule | torch.sum GB/s" in table[0]
    assert [line.split(" | ")[0] for line in table[2:]] == [
        "| streaming, 1 row", "| streaming, 4 rows", "| 16 rows, 768 -> 3072", "| gpt2-small greedy b1",
        "| gpt2-small beam 4 b1"]
    assert all(re.search(r"\| [\d.]+ \(1\.00x\) \|( [\d.]+ \([\d.]+x\) \|){2}", line) for line in table[2:])
    in_force, chosen = native.kernels().panel_tuning(), kernel_tuning(this_cpu())
    assert all(getattr(in_force, name) == value for name, value in chosen.__dict__.items())


def test_decode_benchmark_reports_cached_and_uncached_rows():
    report = decode.run(decode.parse_args(["--new-tokens", "3", "--seq2seq-new-tokens", "3", "--batches", "1", "2",
                                           "--seq2seq-batches", "1", "--repeats", "1"]))
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:4]) for line in report.splitlines()
            if line.startswith("| ") and not line.startswith("| decode")}
    assert rows == {("causal_lm greedy", "1", "3", "yes"), ("causal_lm greedy", "1", "3", "no"),
                    ("causal_lm greedy", "2", "3", "yes"), ("causal_lm greedy", "2", "3", "no"),
                    ("causal_lm beam 4", "1", "3", "yes"), ("causal_lm beam 4", "1", "3", "no"),
                    ("seq2seq beam 4", "1", "3", "yes")}
    assert re.search(r"KV cache speed-up, greedy batch 2: \d+\.\dx", report)


def test_layout_benchmark_compares_every_cell(capsys):
    layout.main(["--rounds", "1", "--new-tokens", "2", "--threads", "1"])  # raises if the layouts disagree
    table = capsys.readouterr().out.split("| cell |", 1)[1]
    cells = re.findall(r"^\| (.+?) \| [\d,]+ \| [\d,]+ \| \d+\.\d\dx \|$", table, flags=re.MULTILINE)
    assert len(cells) == 11 and "classifier b64 (seq/s)" in cells


def test_prefix_cache_benchmark_times_both_bursts_with_the_cache_off_and_on():
    """--tiny: two servers (cache off, on), a cold and a warm burst on each; every request streams its tokens (the
    harness raises otherwise); the cache-on server reports hits, most of the prompt tokens in the warm burst. The
    in-process running batch decodes the same tokens off and on (the harness raises otherwise) and holds less
    with the cache: the prefix once rather than per row."""
    report = prefix_cache.main(["--tiny", "--threads", "1"])
    rows = re.findall(r"^\| (cold|warm) \| ([\d,]+) \| [\d,]+ \| ([\d,]+) \| [\d,]+ \| \d+\.\dx \| (\d+)% \|$",
                      report, flags=re.MULTILINE)
    assert [r[0] for r in rows] == ["cold", "warm"]
    hits = {kind: int(share) for kind, _, _, share in rows}
    assert hits["cold"] > 0  # the burst's shared prefix was computed once and reused by every row
    assert hits["warm"] > 50  # prefix 64 tokens of about 74
    memory = re.search(r"^\| off / on \| (\d+\.\d)x \| \d+\.\d\dx \|$", report, flags=re.MULTILINE)
    assert memory is not None and float(memory.group(1)) > 1.5


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_benchmark_checks_equal_outputs_and_reports_the_acceptance(method):
    """--tiny: a random toy causal LM completes stdlib code plain and speculative, drafting by prompt lookup or by a
    smaller random model (the harness raises if their tokens differ); the report has its row with a speed-up and,
    since drafts were proposed, an acceptance rate."""
    report = speculative.main(["--tiny", "--threads", "1"] + (["--draft-model", "code-draft"] if method != "ngram"
                                                               else []))
    row = re.search(rf"^\| code \| code \| {method} \| 3 \| (\d+) \| [\d,]+ \| [\d,]+ \| (\d+\.\d\d)x \| (\d+)% \| "
                    r"(\d+\.\d\d) \|$", report, flags=re.MULTILINE)
    assert row is not None, report
    assert int(row.group(1)) == 3 * 16 and float(row.group(4)) >= 1.0


def test_grammar_benchmark_walks_every_installed_library_over_both_grammars():
    """Each installed library compiles both grammars and masks every step of the valid outputs (a token outside
    a library's mask would stop its walk with an error); a library that is not installed gets its row saying so."""
    report = grammar.main(["--vocab", "600", "--repeats", "1", "--corpus-chars", "100000"])
    rows = re.findall(r"^\| \d+ \| (json_schema|regex) \| ([\w-]+) \| (.+?) \|", report, flags=re.MULTILINE)
    assert {(kind, library) for kind, library, _ in rows} == {(k, lib) for k in ("json_schema", "regex")
                                                               for lib in ("llguidance", "outlines-core", "xgrammar")}
    measured = {library for _, library, compile_ms in rows if compile_ms != "not installed"}
    assert {"llguidance", "outlines-core"} <= measured


def test_vmap_benchmark_times_ours_and_ctranslate2_with_and_without_the_map():
    """--tiny: the toy opus-mt shape, a synthetic map; ours with the map keeps every output to its source's
    candidates (the harness raises otherwise); each cell has ours' rates both ways and its ratio."""
    report = vmap.main(["--tiny", "--threads", "1", "--repeats", "1"])
    rows = re.findall(r"^\| (greedy b1|beam 4 b1) \| \d+ / \d+ \| [\d,]+ \(1t\) \| [\d,]+ \(1t\) \|.* (\d+\.\d\d)x \|",
                      report, flags=re.MULTILINE)
    assert [r[0] for r in rows] == ["greedy b1", "beam 4 b1"]
