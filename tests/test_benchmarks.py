"""The peer comparison (`python -m benchmarks.compare`) runs end to end: a smoke run, not a measurement.

Speed is measured by the benchmark itself on a quiet machine (docs/benchmarks.md); this only checks
that the one command still builds, exports and converts the models, runs every engine to exactly the
requested lengths (the harness raises otherwise) and writes every table.
"""

import re

from benchmarks import compare


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
