"""Serving throughput and latency over HTTP: `python -m benchmarks.serve [--quick] [--models DIR | --url URL]`.

A bounded async load generator (httpx): each cell sends a fixed number of requests from N concurrent
clients (1, 8, 32), each client sending its next request as soon as the previous one answers, under a
per-cell and an overall time cap. Cells: generate greedy and beam 4 (min_new_tokens = max_new_tokens,
so every request produces the same number of tokens) and classify, with batching on (the default
max_batch_size 32) and off (a second server with max_batch_size 1), and with 1 vs 8 distinct LoRA
adapters in the mix (request i uses adapter i mod k).

By default the benchmark builds its own checkpoints of a realistic small size with random weights
(a random model decodes exactly as fast as a trained one): a causal_lm and a classifier of
d_model 256, 4 layers, 4 heads, ffn 1024, with a byte-level BPE of 8000 tokens trained on Python's
standard library source, saved by model.checkpoint.save_checkpoint; and 8 random LoRA adapters per
model (model.lora.add_adapter + save_adapter with random nonzero B; not trained: throughput only);
see benchmarks/serve_setup.py. It starts ``python -m service`` on 127.0.0.1 with
service/local_server.py's ``running_server`` (the HTTP tests' mechanism), one server with
batching and one without, one after the other. ``--models DIR``
benchmarks existing checkpoints instead (the first causal_lm, else seq2seq, and the first
classifier), with the adapters of ``--adapters DIR`` if it holds 8 per model, else random ones.
``--url URL`` measures a running server (``--url-unbatched URL`` a second one started with
max_batch_size 1); cells that need what the server lacks are skipped.

``--tracing`` adds a third server (batching on) that exports a span per request over OTLP/HTTP to a receiver in
this process (service/engine/tracing.py), and runs every base-model cell on it right after the untraced one: the
overhead of tracing, as a throughput ratio and server CPU per request.

Prints the machine line, the configuration, one markdown table with every cell, and the ratios
against the serving targets (reported, never asserted): batching on / off at 32 clients for greedy
generation (target >= 4x) and 8 adapters / 1 adapter throughput (target >= 70%).
Open-loop load (Poisson arrivals, TTFT / ITL percentiles per rate): benchmarks/open_loop.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import machine_line, markdown_table
from benchmarks.serve_setup import NUM_ADAPTERS, build_models, find_models, prepare_adapters, prompts_from, stdlib_texts
from service.local_server import metric_samples, otlp_receiver, running_server

logger = logging.getLogger("benchmarks.serve")

ENDPOINTS = ("greedy", "beam4", "classify")


# ---- the load generator ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    endpoint: str  # one of ENDPOINTS
    clients: int
    batching: bool
    adapters: int  # distinct adapters in the mix (0 = base model)
    traced: bool = False  # on the server that exports OpenTelemetry spans (--tracing)

    @property
    def label(self) -> str:
        adapters = {0: "no adapter", 1: "1 adapter"}.get(self.adapters, f"{self.adapters} adapters")
        clients = f"{self.clients} client{'s' if self.clients != 1 else ''}"
        traced = ", traced" if self.traced else ""
        return f"{self.endpoint}, {clients}, batching {'on' if self.batching else 'off'}, {adapters}{traced}"

    @property
    def server(self) -> tuple[bool, bool]:
        """Which server runs the cell: (batching, traced)."""
        return self.batching, self.traced


@dataclass
class Result:
    cell: Cell
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    errors: int = 0
    first_error: str | None = None  # status and message of the first failed request
    seconds: float = 0.0
    rows_per_step: float | None = None  # mean tserve_batch_size over the cell
    server_cpu_s: float | None = None  # CPU time of the server process (all threads) over the cell
    skipped: str | None = None

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds > 0 else 0.0

    def percentile(self, q: float) -> float:
        values = sorted(self.latencies)
        if not values:
            return float("nan")
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


@dataclass
class Workload:
    """What every request of a run looks like."""

    generator: str | None
    classifier: str | None
    adapters: dict[str, list[str]]  # model -> adapter names available
    prompts: list[str]
    new_tokens: int

    def request(self, cell: Cell, i: int) -> tuple[str, dict]:
        model = self.classifier if cell.endpoint == "classify" else self.generator
        body: dict = {"inputs": [self.prompts[i % len(self.prompts)]]}
        if cell.adapters:
            body["adapter"] = self.adapters[model][i % cell.adapters]
        if cell.endpoint == "classify":
            return f"/v1/models/{model}/classify", body
        body.update(max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens)
        if cell.endpoint == "beam4":
            body.update(strategy="beam", num_beams=4)
        return f"/v1/models/{model}/generate", body

    def model_of(self, cell: Cell) -> str | None:
        return self.classifier if cell.endpoint == "classify" else self.generator


async def batch_sizes(client: httpx.AsyncClient, model: str) -> tuple[float, float]:
    """(sum, count) of the server's tserve_batch_size histogram for ``model``."""
    text = (await client.get("/metrics")).text
    key = (("model", model),)
    return (metric_samples(text, "tserve_batch_size_sum").get(key, 0.0),
            metric_samples(text, "tserve_batch_size_count").get(key, 0.0))


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) from /proc; None when unknown."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_cell(url: str, cell: Cell, workload: Workload, requests: int, cap_s: float,
                   pid: int | None = None) -> Result:
    """Send ``requests`` requests from ``cell.clients`` clients (stopping early after ``cap_s`` seconds)."""
    result = Result(cell)
    limits = httpx.Limits(max_connections=cell.clients + 2, max_keepalive_connections=cell.clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=max(cap_s * 2, 60.0), limits=limits) as client:
        model = workload.model_of(cell)
        warm = [workload.request(cell, i) for i in range(min(cell.clients, 4))]
        await asyncio.gather(*(client.post(path, json=body) for path, body in warm))  # connections, adapters
        before, cpu_before = await batch_sizes(client, model), process_cpu_s(pid)
        next_index, start = 0, time.perf_counter()
        deadline = start + cap_s

        async def one_client() -> None:
            nonlocal next_index
            while next_index < requests and time.perf_counter() < deadline:
                path, body = workload.request(cell, next_index)
                next_index += 1
                sent = time.perf_counter()
                try:
                    response = await client.post(path, json=body)
                    error = None if response.status_code == 200 else f"{response.status_code} {response.text[:200]}"
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                if error is None:
                    result.latencies.append(time.perf_counter() - sent)
                else:
                    result.errors += 1
                    result.first_error = result.first_error or error

        await asyncio.gather(*(one_client() for _ in range(cell.clients)))
        result.seconds = time.perf_counter() - start
        cpu_after = process_cpu_s(pid)
        if cpu_before is not None and cpu_after is not None:
            result.server_cpu_s = cpu_after - cpu_before
        after = await batch_sizes(client, model)
        if after[1] > before[1]:
            result.rows_per_step = (after[0] - before[0]) / (after[1] - before[1])
    return result


# ---- the run ----------------------------------------------------------------------------------------


def plan(args: argparse.Namespace, workload: Workload) -> list[Cell]:
    """Batching on then off for each endpoint and client count; then 1 then 8 adapters (batching on).

    Compared cells run back to back, so a change in the machine's load between them is less likely.
    """
    cells = [Cell(e, c, b, 0) for e in args.endpoints for c in args.clients for b in (True, False)]
    if args.tracing:  # each right after its untraced twin
        cells = [twin for cell in cells for twin in (cell, Cell(cell.endpoint, cell.clients, True, 0, True))
                 if not twin.traced or cell.batching]
    cells += [Cell(e, c, True, k) for e in args.adapter_endpoints for c in args.adapter_clients
              for k in (1, NUM_ADAPTERS)]
    return [cell for cell in cells if workload.model_of(cell) is not None]


def requests_for(cell: Cell, args: argparse.Namespace) -> int:
    return max(args.min_requests, args.requests_per_client * cell.clients)


Servers = dict[tuple[bool, bool], tuple[str, int | None] | None]  # (batching, traced) -> (url, pid)


def measure(urls: Servers, cells: list[Cell], workload: Workload, args: argparse.Namespace) -> dict[Cell, Result]:
    deadline = time.monotonic() + args.time_cap
    results = {}
    for cell in cells:
        server, model = urls.get(cell.server), workload.model_of(cell)
        left = deadline - time.monotonic()
        if server is None:
            results[cell] = Result(cell, skipped="no such server (unbatched or traced)")
        elif len(workload.adapters.get(model, [])) < cell.adapters:
            results[cell] = Result(cell, skipped=f"{model} has fewer than {cell.adapters} adapters")
        elif left < 5:
            results[cell] = Result(cell, skipped="overall time cap")
        else:
            cap = min(args.cell_cap, left)
            url, pid = server
            result = results[cell] = asyncio.run(run_cell(url, cell, workload, requests_for(cell, args), cap, pid))
            logger.info("%s: %d ok, %d errors, %.2f req/s, p50 %.3f s", cell.label, len(result.latencies),
                        result.errors, result.throughput, result.percentile(50))
    return results


def _rate(r: Result | None, new_tokens: int) -> list[str]:
    """req/s (new tokens/s), p50/p95/p99 ms, rows/step, server CPU ms per request, requests of one cell."""
    if r is None or r.skipped or not r.latencies:
        return ["-"] * 5
    tokens = f" ({r.throughput * new_tokens:,.0f} tok/s)" if r.cell.endpoint != "classify" else ""
    pcts = " / ".join(f"{r.percentile(q) * 1000:,.0f}" for q in (50, 95, 99))
    rows = f"{r.rows_per_step:.1f}" if r.rows_per_step is not None else "-"
    cpu = f"{r.server_cpu_s * 1000 / len(r.latencies):,.0f}" if r.server_cpu_s is not None else "-"
    return [f"{r.throughput:,.2f}{tokens}", pcts, rows, cpu, f"{len(r.latencies)} in {r.seconds:.1f} s"]


def _ratio(a: Result | None, b: Result | None) -> float | None:
    if a is None or b is None or not a.latencies or not b.latencies or a.skipped or b.skipped:
        return None
    return a.throughput / b.throughput


def batching_table(results: dict[Cell, Result], args: argparse.Namespace) -> str:
    rows = []
    for endpoint in args.endpoints:
        for c in args.clients:
            on, off = results.get(Cell(endpoint, c, True, 0)), results.get(Cell(endpoint, c, False, 0))
            if on is None and off is None:
                continue
            ratio = _ratio(on, off)
            rows.append([endpoint, c, *_rate(on, args.new_tokens), *_rate(off, args.new_tokens),
                         f"{ratio:.1f}x" if ratio is not None else "-"])
    headers = ["endpoint", "clients", "on: req/s", "on: p50/p95/p99 ms", "on: rows/step", "on: CPU ms/req",
               "on: requests", "off: req/s", "off: p50/p95/p99 ms", "off: rows/step", "off: CPU ms/req",
               "off: requests", "on/off"]
    return markdown_table(headers, rows)


def tracing_table(results: dict[Cell, Result], args: argparse.Namespace) -> str:
    rows = []
    for endpoint in args.endpoints:
        for c in args.clients:
            off, on = results.get(Cell(endpoint, c, True, 0)), results.get(Cell(endpoint, c, True, 0, True))
            ratio = _ratio(on, off)
            rows.append([endpoint, c, *[_rate(off, args.new_tokens)[i] for i in (0, 1, 3)],
                         *[_rate(on, args.new_tokens)[i] for i in (0, 1, 3)], f"{ratio:.2f}" if ratio else "-"])
    headers = ["endpoint", "clients", "untraced: req/s", "untraced: p50/p95/p99 ms", "untraced: CPU ms/req",
               "traced: req/s", "traced: p50/p95/p99 ms", "traced: CPU ms/req", "traced / untraced"]
    return markdown_table(headers, rows)


def adapters_table(results: dict[Cell, Result], args: argparse.Namespace) -> str:
    rows = []
    for endpoint in args.adapter_endpoints:
        for c in args.adapter_clients:
            base = results.get(Cell(endpoint, c, True, 0))
            one, many = results.get(Cell(endpoint, c, True, 1)), results.get(Cell(endpoint, c, True, NUM_ADAPTERS))
            if one is None and many is None:
                continue
            ratio = _ratio(many, one)
            base_rate = _rate(base, args.new_tokens)[0]
            rows.append([endpoint, c, base_rate, *_rate(one, args.new_tokens)[:4], *_rate(many, args.new_tokens)[:4],
                         f"{ratio:.0%}" if ratio is not None else "-"])
    headers = ["endpoint", "clients", "no adapter: req/s", "1 adapter: req/s", "1: p50/p95/p99 ms", "1: rows/step",
               "1: CPU ms/req", f"{NUM_ADAPTERS} adapters: req/s", f"{NUM_ADAPTERS}: p50/p95/p99 ms",
               f"{NUM_ADAPTERS}: rows/step", f"{NUM_ADAPTERS}: CPU ms/req", f"{NUM_ADAPTERS} / 1"]
    return markdown_table(headers, rows)


def _cpu_ratio(a: Result | None, b: Result | None) -> str:
    """Server CPU per request of ``a`` and ``b`` and ``a``'s requests per CPU second relative to ``b``'s.

    CPU time is what other load on the machine inflates least, so it backs up the wall-clock ratio.
    """
    if _ratio(a, b) is None or a.server_cpu_s is None or b.server_cpu_s is None or not a.server_cpu_s:
        return ""
    per_a, per_b = a.server_cpu_s / len(a.latencies), b.server_cpu_s / len(b.latencies)
    return (f"; server CPU per request {per_a * 1000:,.0f} vs {per_b * 1000:,.0f} ms, i.e. {per_b / per_a:.2f}x "
            f"the requests per CPU second")


def verdicts(results: dict[Cell, Result], args: argparse.Namespace) -> list[str]:
    """The targets, with the measured ratios (reported, not asserted)."""
    clients = max(args.clients)
    lines = []
    on, off = results.get(Cell("greedy", clients, True, 0)), results.get(Cell("greedy", clients, False, 0))
    ratio = _ratio(on, off)
    if ratio is not None:
        verdict = f"target >= 4x: {'met' if ratio >= 4 else 'MISSED'}" if clients == 32 else "target is at 32 clients"
        lines.append(f"- Batching on / off, greedy generation, {clients} clients: {ratio:.1f}x the throughput "
                     f"({verdict}){_cpu_ratio(on, off)}")
    for endpoint in args.adapter_endpoints:
        c = max(args.adapter_clients)
        one, many = results.get(Cell(endpoint, c, True, 1)), results.get(Cell(endpoint, c, True, NUM_ADAPTERS))
        ratio = _ratio(many, one)
        if ratio is not None:
            verdict = f"target >= 70%: {'met' if ratio >= 0.7 else 'MISSED'}" if c == 32 else "target is at 32 clients"
            lines.append(f"- {NUM_ADAPTERS} adapters / 1 adapter, {endpoint}, {c} clients: {ratio:.0%} of the "
                         f"throughput ({verdict}){_cpu_ratio(many, one)}")
    problems = [f"{r.cell.label}: {r.skipped or f'{r.errors} errors, the first: {r.first_error}'}"
                for r in results.values() if r.skipped or r.errors]
    return lines + [f"- Not measured or failed: {p}" for p in problems]


@contextmanager
def servers(args: argparse.Namespace, models_dir: Path | None, adapters_dir: Path | None, spans: list
            ) -> Iterator[Servers]:
    """(url, pid) of the servers by (batching, traced): the given URLs (pid unknown), or servers started here,
    batching on and off, and with --tracing one more with batching on exporting its spans into ``spans``."""
    if args.url:
        yield {(True, False): (args.url, None),
               (False, False): (args.url_unbatched, None) if args.url_unbatched else None}
        return
    env = dict(TSERVE_THREADS=str(args.threads), TSERVE_WARMUP="true", TSERVE_MAX_QUEUE="1024",
               TSERVE_REQUEST_TIMEOUT_S="600", TSERVE_MAX_RESIDENT_ADAPTERS=str(NUM_ADAPTERS))
    with ExitStack() as stack:
        urls: Servers = {}
        kinds = [(True, False), (False, False)] + ([(True, True)] if args.tracing else [])
        for batching, traced in kinds:  # started one after the other, so loading does not overlap
            settings = dict(env, TSERVE_MAX_BATCH_SIZE=str(args.max_batch_size if batching else 1))
            if traced:
                endpoint, received = stack.enter_context(otlp_receiver())
                settings |= dict(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
                spans.append(received)
            server = stack.enter_context(running_server(models_dir, adapters_dir, ready_timeout_s=300, **settings))
            urls[batching, traced] = (server.url, server.process.pid)
        yield urls


def discover(url: str) -> tuple[str | None, str | None, dict[str, list[str]]]:
    """(generator, classifier, adapters per model) of a running server."""
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    by_family: dict[str, list[str]] = {}
    for m in models:
        by_family.setdefault(m["family"], []).append(m["name"])
    generator = (by_family.get("causal_lm") or by_family.get("seq2seq") or [None])[0]
    classifier = (by_family.get("classifier") or [None])[0]
    return generator, classifier, {m["name"]: sorted(m["adapters"]) for m in models}


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path | None, Path | None, str, str]:
    """(models dir, adapters dir, what the models are, what the adapters are) for the servers started here."""
    if args.url:
        return None, None, f"those of the server at {args.url}", "those the server has (8 needed per model)"
    models_dir = Path(args.models) if args.models else work / "models"
    if args.models:
        generator, classifier = find_models(models_dir)
        source = f"checkpoints in {models_dir}"
    else:
        generator, classifier = build_models(models_dir)
        source = ("random-weight checkpoints built here: causal_lm and classifier, d_model 256, 4 layers, 4 heads, "
                  "ffn 1024, BPE vocab 8000 trained on Python stdlib source, fp32")
    given = Path(args.adapters) if args.adapters else None
    adapters_dir, note = prepare_adapters(given, models_dir, [generator, classifier], work)
    return models_dir, adapters_dir, source, note


def describe(args: argparse.Namespace, workload: Workload, source: str, adapters: str,
             loads: tuple[tuple[float, ...], tuple[float, ...]]) -> list[str]:
    server = (f"python -m service on 127.0.0.1 (service/local_server.py), TSERVE_THREADS={args.threads}, "
              f"max_wait_ms 5 (default: classify only; generation starts at once), "
              f"batching on = max_batch_size {args.max_batch_size}, off = max_batch_size 1"
              if not args.url else f"{args.url} (batching on), {args.url_unbatched or 'none'} (batching off)")
    return [
        f"Machine: {machine_line()} (the load generator's process)",
        f"Load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in loads[0])} before, "
        f"{'/'.join(f'{x:.2f}' for x in loads[1])} after",
        f"Models: {source}; generator {workload.generator!r}, classifier {workload.classifier!r}",
        f"Adapters: {adapters}",
        f"Server: {server}; load generator (httpx, asyncio) in this process on the same machine",
        f"Requests: generate {args.new_tokens} new tokens each (min_new_tokens = max_new_tokens), prompts of "
        f"2-3 stdlib source lines; classify one such text per request; per cell max({args.min_requests}, "
        f"{args.requests_per_client} x clients) requests, capped at {args.cell_cap:.0f} s per cell and "
        f"{args.time_cap:.0f} s overall; rows/step = mean tserve_batch_size over the cell; CPU ms/req = CPU time "
        f"of the server process (all threads: HTTP and model) per request, which other load on the machine "
        f"does not inflate the way it inflates wall-clock numbers",
    ]


def run(args: argparse.Namespace) -> str:
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        models_dir, adapters_dir, source, adapters_note = prepare(args, work)
        received: list = []  # the traced server's spans, once it exists
        with servers(args, models_dir, adapters_dir, received) as urls:
            generator, classifier, adapters = discover(urls[True, False][0])
            workload = Workload(generator, classifier, adapters, prompts_from(stdlib_texts(300_000)), args.new_tokens)
            results = measure(urls, plan(args, workload), workload, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tracing = ["", f"Tracing off vs on (batching on; spans exported over OTLP/HTTP to a receiver in this process: "
                   f"{len(received[0]) if received else 0} received):", "", tracing_table(results, args)
               ] if args.tracing else []
    return "\n".join([
        *describe(args, workload, source, adapters_note, (load_before, os.getloadavg())),
        "",
        f"Batching on (max_batch_size {args.max_batch_size}) vs off (max_batch_size 1), base model:",
        "",
        batching_table(results, args),
        "",
        f"1 vs {NUM_ADAPTERS} distinct adapters in the mix (request i uses adapter i mod k), batching on:",
        "",
        adapters_table(results, args),
        *tracing,
        "",
        "Targets:",
        *verdicts(results, args),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="benchmark the checkpoints in this directory (default: build random ones)")
    parser.add_argument("--adapters", help="adapters directory (<model>/<name>/) with 8 adapters per model")
    parser.add_argument("--url", help="measure a running server instead of starting one (batching on)")
    parser.add_argument("--url-unbatched", help="with --url: a second server started with max_batch_size 1")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer requests and tokens (~2 min)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--endpoints", nargs="+", default=list(ENDPOINTS), choices=ENDPOINTS)
    parser.add_argument("--adapter-clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--adapter-endpoints", nargs="+", default=list(ENDPOINTS), choices=ENDPOINTS)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=32)
    parser.add_argument("--cell-cap", type=float, default=60.0, help="seconds per cell at most")
    parser.add_argument("--time-cap", type=float, default=540.0, help="seconds of measurement in all at most")
    parser.add_argument("--threads", type=int, default=1, help="server torch intra-op threads (TSERVE_THREADS)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="max_batch_size with batching on")
    parser.add_argument("--tracing", action="store_true",
                        help="also measure every base-model cell on a server exporting OpenTelemetry spans")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.requests_per_client, args.min_requests = min(args.new_tokens, 16), 1, 8
        args.cell_cap, args.time_cap = min(args.cell_cap, 15.0), min(args.time_cap, 150.0)
    if args.url_unbatched and not args.url:
        parser.error("--url-unbatched needs --url")
    if args.tracing and args.url:
        parser.error("--tracing starts its own servers: it cannot measure --url")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "model"):  # a line per request, per adapter made
        logging.getLogger(noisy).setLevel(logging.WARNING)
    print(run(args))


if __name__ == "__main__":
    main()
