"""benchmarks/vmap.py on a multilingual shape (--shape nllb-200-distilled-600m --tiny): the map per target language
is written as vmaps/<code>.txt and loaded as the service loads it, ours with it keeps every output to its candidates
(the harness raises otherwise), and each cell reports both rates, their ratio and the outputs' overlap."""

from __future__ import annotations

import re

from benchmarks import vmap


def test_vmap_benchmark_on_a_multilingual_shape_times_ours_with_and_without_its_languages_map():
    report = vmap.main(["--shape", "nllb-200-distilled-600m", "--tiny", "--threads", "1", "--repeats", "1",
                        "--precision", "fp32"])
    assert "map vmaps/fra_Latn.txt" in report
    rows = re.findall(r"^\| (greedy b1|beam 4 b1) \| [\d,]+ / [\d,]+ \| [\d,]+ \(1t\) \| [\d,]+ \(1t\) \| - \| - \| "
                      r"(\d+\.\d\d)x \|.* (\d+)% / (\d+)% \| - \|$", report, flags=re.MULTILINE)
    assert [r[0] for r in rows] == ["greedy b1", "beam 4 b1"], report
