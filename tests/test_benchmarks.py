"""The model benchmarks run end to end: smoke runs on a few tokens, not measurements.

Speed is measured by the benchmarks themselves on a quiet machine (docs/benchmarks.md); these only
check that each command still builds its models, runs every engine or layout to exactly the requested
lengths (the harnesses raise otherwise) and prints every table.
"""

import re

from benchmarks import compare, decode, layout


def _results_rows(report: str) -> list[list[str]]:
    section = report.split("### Results", 1)[1].split("###", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # without the header


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
    assert re.search(r"Read bandwidth by working set: 92 MB: [\d.]+ GB/s", report)
    assert "floor fp32 /s" in report


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
