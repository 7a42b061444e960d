"""benchmarks/open_loop.py and open_loop_load.py: their pure parts (arrivals, percentiles, saturation, the plot)
and a tiny real run.

The real run serves a random-weight causal_lm of toy size with ``python -m service`` (benchmarks.open_loop's
own ``--models`` path, which starts it with service/local_server.py's ``running_server``) and checks the
report's bookkeeping, never a latency or throughput value.
"""

import math
import random
import statistics
import xml.etree.ElementTree as ET

import numpy
import pytest
import torch

from benchmarks import open_loop, open_loop_load, open_loop_plot
from benchmarks.open_loop_load import LoadConfig, PlannedRequest, RateResult, RequestRecord
from model.causal_lm import CausalLM
from model.checkpoint import save_checkpoint
from model.config import CausalLMConfig
from model.tokenizer import Tokenizer

SVG = "{http://www.w3.org/2000/svg}"


# ---- pure parts -------------------------------------------------------------------------------------


def test_arrivals_from_a_seed_are_reproducible_and_have_the_poisson_mean_gap():
    first = open_loop_load.arrival_times(4.0, 5000.0, random.Random(7))
    assert first == open_loop_load.arrival_times(4.0, 5000.0, random.Random(7))
    assert first != open_loop_load.arrival_times(4.0, 5000.0, random.Random(8))
    gaps = [b - a for a, b in zip([0.0, *first], first, strict=False)]
    assert all(g > 0 for g in gaps) and first[-1] < 5000.0
    # ~20,000 exponential gaps of mean 1/4 and standard deviation 1/4: the mean's standard error is ~0.0018.
    assert abs(statistics.fmean(gaps) - 0.25) < 5 * 0.25 / math.sqrt(len(gaps))
    assert abs(statistics.pstdev(gaps) - 0.25) < 0.02  # exponential: standard deviation = mean


def test_the_plan_keeps_each_requests_lengths_across_rates_and_scales_the_arrivals():
    config = LoadConfig(duration_s=20.0, seed=3, prompt_words=(2, 9), output_tokens=(4, 12), max_in_flight=8,
                        drain_s=1.0)
    words = [f"w{i}" for i in range(500)]
    slow, fast = open_loop_load.plan_requests(1.0, config, words), open_loop_load.plan_requests(4.0, config, words)
    assert len(fast) > len(slow) > 0
    for a, b in zip(slow, fast, strict=False):
        assert (a.prompt_words, a.output_tokens) == (b.prompt_words, b.output_tokens)
        assert a.arrival_s == pytest.approx(4 * b.arrival_s)
    assert [a.prompt for a in slow] != [b.prompt for b in fast[:len(slow)]]  # words drawn per rate: no cache hits
    assert all(2 <= r.prompt_words <= 9 and len(r.prompt.split()) == r.prompt_words and 4 <= r.output_tokens <= 12
               for r in fast)
    assert len({r.output_tokens for r in fast}) > 1 and len({r.prompt_words for r in fast}) > 1  # mixed lengths


@pytest.mark.parametrize("size", [1, 2, 5, 37, 100])
def test_percentile_matches_numpys_linear_interpolation(size):
    values = [random.Random(size).expovariate(1.0) for _ in range(size)]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert open_loop_load.percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))
    assert math.isnan(open_loop_load.percentile([], 50))


def _rate(rate: float, ttfts: list[float], shed: int = 0, unfinished: int = 0) -> RateResult:
    """A RateResult whose completed requests had these first-token times (one token each)."""
    request = PlannedRequest(0.0, "p", 1, 1)
    completed = [RequestRecord(request, 0.0, [t], e2e_s=t) for t in ttfts]
    return RateResult(rate, len(ttfts) + shed + unfinished, completed, [], shed, unfinished, 10.0, 1,
                      [0.0] * len(ttfts), 0.1)


def test_saturation_is_the_lowest_rate_whose_p99_ttft_passes_the_slo():
    fast, slow = [0.1] * 50, [0.1] * 40 + [3.0] * 10
    results = [_rate(8, slow), _rate(2, fast), _rate(16, slow), _rate(4, fast)]
    assert open_loop.saturation_rate(results, 1.0) == 8
    assert open_loop.saturation_rate(results, 5.0) is None
    assert "8 req/s (last rate below it: 4 req/s)" in open_loop.saturation_line(results, 1.0)
    assert "not reached up to 16 req/s" in open_loop.saturation_line(results, 5.0)


def test_shed_unfinished_or_nothing_completed_count_as_saturated():
    assert open_loop.saturation_rate([_rate(1, [0.1]), _rate(2, [0.1], shed=1)], 1.0) == 2
    assert open_loop.saturation_rate([_rate(1, [0.1]), _rate(2, [0.1], unfinished=1)], 1.0) == 2
    assert open_loop.saturation_rate([_rate(1, [0.1]), _rate(2, [])], 1.0) == 2


def _polylines(svg: str) -> dict[str, list[tuple[float, float]]]:
    root = ET.fromstring(svg)
    assert root.tag == SVG + "svg"
    return {p.get("class"): [tuple(map(float, xy.split(","))) for xy in p.get("points").split()]
            for p in root.iter(SVG + "polyline")}


def test_the_plot_has_a_line_per_series_with_a_point_per_measured_rate():
    results = [_rate(1, [0.05, 0.2]), _rate(2, [0.1, 0.4]), _rate(4, [2.0, 5.0]), _rate(8, [])]
    lines = _polylines(open_loop_plot.plot_svg(results, "a <title> & more", 1.0))
    assert set(lines) == {"ttft-p50", "ttft-p99", "slo", "throughput", "offered"}
    assert len(lines["ttft-p50"]) == len(lines["ttft-p99"]) == len(lines["throughput"]) == 3  # 8 req/s: none
    assert len(lines["offered"]) == 4
    assert all(p99[1] <= p50[1] for p50, p99 in zip(lines["ttft-p50"], lines["ttft-p99"], strict=True))  # higher up
    xs = [x for x, _ in lines["ttft-p50"]]
    assert xs == sorted(xs)


# ---- a tiny real run --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """A random-weight causal_lm of toy size with a BPE tokenizer trained on a few stdlib files."""
    directory = tmp_path_factory.mktemp("open-loop") / "models"
    tokenizer = Tokenizer.train(open_loop_load.stdlib_texts(200_000), vocab_size=300)
    torch.manual_seed(0)
    config = CausalLMConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                            max_len=128, dropout=0.0)
    save_checkpoint(directory / "toy-lm", CausalLM(config).eval(), tokenizer)
    return directory


def test_a_tiny_open_loop_run_accounts_for_every_request_and_writes_the_plot(tiny_models, tmp_path, capsys):
    plot = tmp_path / "open-loop.svg"
    report = open_loop.main(["--models", str(tiny_models), "--rates", "4", "2", "--duration", "2", "--drain", "60",
                             "--prompt-words", "2", "12", "--output-tokens", "2", "8", "--seed", "1",
                             "--plot", str(plot)])
    assert report.model == "toy-lm"
    assert [r.rate for r in report.results] == [2, 4]
    for r in report.results:
        assert r.planned == len(r.completed) + len(r.failed) + r.shed + r.unfinished > 0
        assert len(r.completed) == r.planned, r.first_error  # no cap hit, nothing failed at these rates
        assert all(len(q.token_times) == q.planned.output_tokens for q in r.completed)
        assert all(q.token_times == sorted(q.token_times) and q.token_times[-1] <= q.e2e_s for q in r.completed)
        for series in (r.ttft, r.itl, r.e2e):
            assert series(50) <= series(90) <= series(99)
        assert r.prompt_tokens >= sum(q.planned.prompt_words for q in r.completed) > 0  # a word is >= 1 token
        assert 0 < r.peak_in_flight <= r.planned
        assert r.rows_per_call >= 1 and r.server_cpu_s > 0  # the server's counters and process were read
    text = capsys.readouterr().out
    assert "Machine: " in text and "Saturation (p99 TTFT > 1 s): " in text
    rows = [line for line in text.splitlines() if line.startswith("| 2 |") or line.startswith("| 4 |")]
    assert len(rows) == 2
    lines = _polylines(plot.read_text())
    assert len(lines["ttft-p50"]) == len(lines["ttft-p99"]) == len(lines["throughput"]) == 2
