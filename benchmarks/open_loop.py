"""Serving under open-loop load: `python -m benchmarks.open_loop [--models DIR | --shape SHAPE | --url URL]
--rates 1 2 4 ... --duration S --seed N [--system-words N] [--quantize int8] [--quick] [--plot PATH]`.

For each offered rate, requests arrive as a Poisson process (exponential gaps drawn from a seeded
``random.Random``) for ``--duration`` seconds, and each is sent at its arrival time whatever is in flight
(open loop: a slow server does not slow the arrivals, unlike benchmarks/serve.py's closed-loop clients).
Request i asks for a prompt of a drawn number of words (consecutive alphabetic words of Python's standard
library source) and a drawn number of output tokens, both uniform over ``--prompt-words`` / ``--output-tokens``
from the same seed at every rate (its words drawn afresh per rate, so that no rate meets an earlier one's
prompts in the server's prefix cache; ``--system-words N``: every prompt opens with the same N-word passage, as
chat traffic shares a system prompt: the prefix cache's case), decoded greedily with min_new_tokens =
max_new_tokens, so every completed request makes exactly the tokens drawn. Requests are streamed
(``/v1/models/{model}/generate`` with ``"stream": true``, one server-sent event per token), so the client times
the first token (TTFT) and every gap between tokens (ITL) itself, from the moment it sent the request.

Bounds: arrivals stop at ``--duration``; requests still running ``--drain`` seconds after that are cancelled
and counted as unfinished; an arrival that finds ``--max-in-flight`` requests running is not sent and is
counted as shed. Either one marks the rate as past saturation.

Reported per rate, as vLLM's ``benchmark_serving`` does: completed / failed requests, request and
output-token throughput (from the start of the arrivals to the last answer), TTFT and ITL
p50/p90/p99 (ITL pooled over every gap of every completed request), end-to-end latency p50/p99; and
the saturation rate: the lowest offered rate at which p99 TTFT exceeds ``--ttft-slo`` (1 s). Also the
mean prompt tokens (the server's ``tserve_prompt_tokens`` counter over the rate), the share of them found in
its prefix cache (``tserve_prefix_cache_hits`` / ``_queries``), the peak number of requests in flight, the
server's mean rows per model call (``tserve_batch_size``), the CPU use of the server process (read from /proc
when it runs here) and of the client's, since they share the machine, and the client's send lag (actual minus
scheduled send time: whether the load generator kept up).

Models: by default the random-weight checkpoints of benchmarks/serve_setup.py (the causal_lm is
served); ``--models DIR`` serves a models directory (its first causal_lm, else seq2seq, or
``--model NAME``); ``--shape opus-mt`` serves benchmarks/shapes.py's random-weight OPUS-MT directory
(translation requests), ``--shape smollm2-135m`` / ``qwen2.5-0.5b`` its random-weight Llama-style decoder
directories (prompts of a causal LM; their tokenizer, trained on a tiny corpus, cuts a prompt word into ~4
tokens, so 75-225 words are ~300-900 tokens, the length of chat prompts); ``--url URL`` measures a running
server. ``--quantize`` and ``--prefix-cache-mb`` set the server's TSERVE_QUANTIZE / TSERVE_PREFIX_CACHE_MB.
Servers start with service/local_server.py's ``running_server`` on 127.0.0.1. ``--plot PATH`` writes an SVG
of p50/p99 TTFT and throughput against the offered rate.

This module runs the rates and reports them; the load generator (arrivals, streamed requests, one rate's run and
its result) is benchmarks/open_loop_load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common import machine_line, markdown_table
from benchmarks.open_loop_load import (
    LoadConfig,
    PlannedRequest,
    RateResult,
    percentile,
    plan_requests,
    run_rate,
    source_words,
)
from benchmarks.open_loop_plot import plot_svg
from benchmarks.serve_setup import build_models
from benchmarks.shapes import DEFAULT_CACHE, build
from model.quantize import QUANTIZE_MODES
from service.local_server import running_server

logger = logging.getLogger("benchmarks.open_loop")

TTFT_SLO_S = 1.0
PERCENTILES = (50, 90, 99)


# ---- the verdict ------------------------------------------------------------------------------------


def saturation_rate(results: Sequence[RateResult], slo_s: float) -> float | None:
    """The lowest offered rate that is saturated (p99 TTFT above ``slo_s``, ...); None if none is."""
    saturated = [r.rate for r in results if r.saturated(slo_s)]
    return min(saturated) if saturated else None


def saturation_line(results: Sequence[RateResult], slo_s: float) -> str:
    rate = saturation_rate(results, slo_s)
    if rate is None:
        return f"Saturation (p99 TTFT > {slo_s:g} s): not reached up to {max(r.rate for r in results):g} req/s"
    below = [r.rate for r in results if r.rate < rate]
    last = f" (last rate below it: {max(below):g} req/s)" if below else " (the lowest rate measured)"
    return f"Saturation (p99 TTFT > {slo_s:g} s): {rate:g} req/s{last}"


# ---- the report -------------------------------------------------------------------------------------


def _ms(values: Sequence[float]) -> str:
    return " / ".join("-" if math.isnan(v) else f"{v * 1000:,.0f}" for v in values)


def table_row(r: RateResult) -> list[object]:
    sent = r.planned - r.shed
    prompt = f"{r.prompt_tokens / sent:.0f}" if r.prompt_tokens and sent else "-"
    return [f"{r.rate:g}", r.planned, len(r.completed), len(r.failed), r.shed, r.unfinished,
            f"{r.request_throughput:.2f}", f"{r.token_throughput:,.0f}", prompt,
            "-" if r.prefix_hit_rate is None else f"{r.prefix_hit_rate:.0%}",
            _ms([r.ttft(q) for q in PERCENTILES]), _ms([r.itl(q) for q in PERCENTILES]),
            _ms([r.e2e(50), r.e2e(99)]), r.peak_in_flight, f"{r.rows_per_call:.1f}" if r.rows_per_call else "-",
            _share(r.server_cpu_s, r.seconds), _share(r.client_cpu_s, r.seconds), _ms([percentile(r.send_lags_s, 99)])]


def _share(cpu_s: float | None, seconds: float) -> str:
    """CPU seconds per wall second, as a percentage of one core."""
    return f"{cpu_s / seconds:.0%}" if cpu_s is not None and seconds > 0 else "-"


def results_table(results: Sequence[RateResult]) -> str:
    headers = ["rate (req/s)", "planned", "completed", "failed", "shed", "unfinished", "req/s", "output tok/s",
               "prompt tok (mean)", "prefix hit", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "E2E p50/p99 ms",
               "peak in flight", "rows/call", "server CPU", "client CPU", "send lag p99 ms"]
    return markdown_table(headers, [table_row(r) for r in results])


def failure_lines(results: Sequence[RateResult]) -> list[str]:
    """One line per rate with failed requests: how many, and the first one's error."""
    return [f"- {r.rate:g} req/s: {len(r.failed)} failed, the first: {r.first_error}" for r in results if r.failed]


# ---- the run ----------------------------------------------------------------------------------------


@dataclass
class Report:
    model: str
    results: list[RateResult]
    description: list[str]
    slo_s: float
    title: str  # the plot's caption (two lines)

    def text(self) -> str:
        failures = failure_lines(self.results)
        saturation = saturation_line(self.results, self.slo_s)
        return "\n".join([*self.description, "", results_table(self.results), "", saturation,
                          *(["", "Failures:", *failures] if failures else [])])


def measure(url: str, model: str, config: LoadConfig, rates: Sequence[float], words: Sequence[str],
            pid: int | None) -> list[RateResult]:
    """Each rate in turn (ascending), after one warm-up request: of the system prompt when there is one (it is
    in the prefix cache from then on, as in a server that has answered it before)."""
    count = max(8, config.system_words)
    warm = PlannedRequest(0.0, " ".join(words[:count]), count, 2)
    asyncio.run(run_rate(url, model, 1.0, [warm], config))
    results = []
    for rate in sorted(rates):
        result = asyncio.run(run_rate(url, model, rate, plan_requests(rate, config, words), config, pid))
        logger.info("%g req/s: %d/%d completed, %d failed, %d shed, %d unfinished, p99 TTFT %.3f s", rate,
                    len(result.completed), result.planned, len(result.failed), result.shed, result.unfinished,
                    result.ttft(99))
        results.append(result)
    return results


def pick_model(url: str, wanted: str | None) -> tuple[str, str]:
    """(name, family) of the model to load: ``wanted``, else the server's first causal_lm, else seq2seq."""
    models = {m["name"]: m["family"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
    if wanted is not None:
        if wanted not in models:
            raise SystemExit(f"model {wanted!r} is not served at {url} (it serves {sorted(models)})")
        return wanted, models[wanted]
    for family in ("causal_lm", "seq2seq"):
        names = sorted(name for name, f in models.items() if f == family)
        if names:
            return names[0], family
    raise SystemExit(f"no causal_lm or seq2seq model at {url}")


def prepare_models(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    """(models directory, what the models are) for the server started here."""
    if args.models:
        return Path(args.models), f"checkpoints in {args.models}"
    models = work / "models"
    models.mkdir()
    if args.shape:
        files = build(args.shape, args.cache, args.tiny)
        (models / args.shape).symlink_to(files.hf.resolve(), target_is_directory=True)
        tiny = " at toy sizes" if args.tiny else ""
        return models, f"benchmarks/shapes.py's {args.shape} shape{tiny} (random weights, HF layout, fp32 weights)"
    build_models(models)
    return models, ("random-weight checkpoints of benchmarks/serve_setup.py: causal_lm d_model 256, 4 layers, "
                    "4 heads, ffn 1024, max_len 256, BPE vocab 8000 trained on Python stdlib source, fp32")


@contextmanager
def server_url(args: argparse.Namespace) -> Iterator[tuple[str, str, int | None]]:
    """(url, what it serves, its pid if known): ``--url``, or a server started here on the chosen models."""
    if args.url:
        yield args.url, f"the server at {args.url}", None
        return
    work = Path(tempfile.mkdtemp(prefix="bench-open-loop-"))
    try:
        models, source = prepare_models(args, work)
        env = dict(TSERVE_THREADS=str(args.threads), TSERVE_WARMUP="true", TSERVE_MAX_QUEUE="1024",
                   TSERVE_REQUEST_TIMEOUT_S="600", **server_settings(args))
        with running_server(models, ready_timeout_s=300, **env) as server:
            yield server.url, source, server.process.pid
    finally:
        shutil.rmtree(work, ignore_errors=True)


def server_settings(args: argparse.Namespace) -> dict[str, str]:
    """The TSERVE_* settings the options give the server started here (the rest at their defaults)."""
    settings = {"TSERVE_QUANTIZE": args.quantize, "TSERVE_PREFIX_CACHE_MB": args.prefix_cache_mb}
    return {name: str(value) for name, value in settings.items() if value is not None}


def prompt_line(config: LoadConfig) -> str:
    """What the prompts are made of."""
    words = f"{config.prompt_words[0]}-{config.prompt_words[1]} alphabetic words of stdlib source"
    if not config.system_words:
        return words
    return f"the same {config.system_words}-word system prompt (a stdlib passage), then {words}"


def describe(args: argparse.Namespace, config: LoadConfig, model: str, family: str, source: str,
             loads: tuple[tuple[float, ...], tuple[float, ...]]) -> list[str]:
    settings = "".join(f"{name}={value}, " for name, value in server_settings(args).items())
    server = (f"python -m service on 127.0.0.1 (service/local_server.py), TSERVE_THREADS={args.threads}, {settings}"
              "max_batch_size 32 (default; generation starts a lone request at once), max_queue 1024, "
              "request timeout 600 s"
              if not args.url else args.url)
    return [
        f"Machine: {machine_line()} (the load generator's process)",
        f"Load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in loads[0])} before, "
        f"{'/'.join(f'{x:.2f}' for x in loads[1])} after",
        f"Model: {model!r} ({family}), {source}",
        f"Server: {server}; load generator (httpx, asyncio, streamed generate) in this process on the same machine",
        f"Load: Poisson arrivals for {config.duration_s:g} s per rate (seed {config.seed}); prompts of "
        f"{prompt_line(config)}, "
        f"{config.output_tokens[0]}-{config.output_tokens[1]} output tokens (uniform; greedy, min_new_tokens = "
        f"max_new_tokens); cancelled {config.drain_s:g} s after the arrivals end; at most {config.max_in_flight} "
        f"in flight (more are shed); a rate with shed or unfinished requests counts as saturated",
        "Columns: req/s and output tok/s from the start of the arrivals to the last answer; TTFT from sending to "
        "the first token event, ITL between token events (all gaps of all completed requests), E2E to the end of "
        "the stream; prompt tok = the server's tserve_prompt_tokens per request sent; rows/call = mean "
        "tserve_batch_size, over decode steps and prefills alike (a newcomer's prefill is a call of its own rows); "
        "prefix hit = prompt tokens the server found in its prefix cache / prompt tokens it looked up; "
        "server / client CPU = CPU time of the server process (all threads) / of this process per wall second "
        "(100% = one core); send lag = how late the client sent a request after its arrival time",
    ]


def run(args: argparse.Namespace) -> Report:
    config = LoadConfig(args.duration, args.seed, tuple(args.prompt_words), tuple(args.output_tokens),
                        args.max_in_flight, args.drain, args.system_words)
    words = source_words()
    load_before = os.getloadavg()
    with server_url(args) as (url, source, pid):
        model, family = pick_model(url, args.model)
        results = measure(url, model, config, args.rates, words, pid)
    description = describe(args, config, model, family, source, (load_before, os.getloadavg()))
    threads = "" if args.url else "".join(f", {k}={v}" for k, v in
                                          {"TSERVE_THREADS": args.threads, **server_settings(args)}.items())
    system = f"{config.system_words}-word system prompt + " if config.system_words else ""
    title = (f"{model} ({family}), open loop: Poisson arrivals for {config.duration_s:g} s per rate, seed "
             f"{config.seed}, {system}{config.prompt_words[0]}-{config.prompt_words[1]} prompt words, "
             f"{config.output_tokens[0]}-{config.output_tokens[1]} output tokens{threads}\n{machine_line()} (client)")
    return Report(model, results, description, args.ttft_slo, title)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--models", help="serve this models directory (default: build random checkpoints)")
    where.add_argument("--shape", choices=["opus-mt", "smollm2-135m", "qwen2.5-0.5b"],
                       help="serve benchmarks/shapes.py's random-weight shape")
    where.add_argument("--url", help="measure a running server instead of starting one")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help="--shape: where the shapes' model files are kept between runs (default %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="--shape: its architecture at toy sizes (the test's)")
    parser.add_argument("--model", help="the model to load (default: the first causal_lm, else seq2seq)")
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8, 16, 32], help="offered req/s")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument("--drain", type=float, default=30.0, help="seconds after the last arrival before cancelling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=[8, 48], metavar=("LOW", "HIGH"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[16, 128], metavar=("LOW", "HIGH"))
    parser.add_argument("--system-words", type=int, default=0,
                        help="open every prompt with the same passage of this many words (a shared system prompt)")
    parser.add_argument("--quantize", choices=QUANTIZE_MODES, help="the server's TSERVE_QUANTIZE (default: its own)")
    parser.add_argument("--prefix-cache-mb", type=float,
                        help="the server's TSERVE_PREFIX_CACHE_MB, 0 = off (default: its own)")
    parser.add_argument("--max-in-flight", type=int, default=256, help="arrivals beyond it are shed (reported)")
    parser.add_argument("--ttft-slo", type=float, default=TTFT_SLO_S, help="p99 TTFT (s) that marks saturation")
    parser.add_argument("--threads", type=int, default=1, help="server torch intra-op threads (TSERVE_THREADS)")
    parser.add_argument("--plot", help="write an SVG of TTFT and throughput against the rate to this path")
    parser.add_argument("--quick", action="store_true", help="a smoke run: two low rates, short, few tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.duration, args.drain = args.rates[:2], min(args.duration, 5.0), min(args.drain, 10.0)
        args.output_tokens = [min(args.output_tokens[0], 4), min(args.output_tokens[1], 16)]
    if min(args.rates) <= 0:
        parser.error("--rates must be positive")
    if args.system_words < 0:
        parser.error("--system-words must be >= 0")
    if args.tiny and not args.shape:
        parser.error("--tiny needs --shape")
    for name in ("prompt_words", "output_tokens"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            parser.error(f"--{name.replace('_', '-')} needs 1 <= LOW <= HIGH")
    return args


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request
    report = run(args)
    print(report.text())
    if args.plot:
        Path(args.plot).write_text(plot_svg(report.results, report.title, args.ttft_slo))
    return report


if __name__ == "__main__":
    main()
