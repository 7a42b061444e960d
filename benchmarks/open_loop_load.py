"""The open-loop load generator of benchmarks/open_loop.py (and benchmarks/prefix_cache.py): Poisson arrivals and
drawn lengths from a seed, one streamed request timed per token event, one rate's run sent at the arrival times
whatever is in flight, and its result (percentiles, throughput, the server's counters over the rate).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from benchmarks.serve import batch_sizes, process_cpu_s
from benchmarks.serve_setup import stdlib_texts
from service.local_server import metric_samples

# ---- the workload: Poisson arrivals, drawn lengths --------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    """What one rate's load looks like, and its bounds."""

    duration_s: float
    seed: int
    prompt_words: tuple[int, int]  # inclusive range, uniform
    output_tokens: tuple[int, int]  # inclusive range, uniform
    max_in_flight: int
    drain_s: float
    system_words: int = 0  # every prompt opens with the same passage of this many words (a shared system prompt)


@dataclass(frozen=True)
class PlannedRequest:
    arrival_s: float  # after the start of the rate's run
    prompt: str
    prompt_words: int  # drawn: the words after the system prompt, if any
    output_tokens: int


def arrival_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrivals at ``rate`` per second in [0, duration_s): cumulative exponential gaps."""
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def plan_requests(rate: float, config: LoadConfig, words: Sequence[str]) -> list[PlannedRequest]:
    """The requests of one rate. Request i has the same prompt and output lengths at every rate (their own
    seeded stream), and the arrivals are the same seeded unit-rate process scaled by 1 / rate. Its words are
    drawn per rate (a stream seeded by the seed and the rate): a prompt an earlier rate sent would be found in
    the server's prefix cache. With ``config.system_words``, every prompt is the first that many ``words`` (the
    system prompt), a space, then its drawn words (the same draws as without it)."""
    arrivals = arrival_times(rate, config.duration_s, random.Random(f"arrivals-{config.seed}"))
    lengths = random.Random(f"lengths-{config.seed}")
    places = random.Random(f"places-{config.seed}-{rate!r}")
    system = " ".join(words[:config.system_words])
    planned = []
    for arrival in arrivals:
        count = lengths.randint(*config.prompt_words)
        start = places.randrange(len(words) - count)
        drawn = " ".join(words[start:start + count])
        planned.append(PlannedRequest(arrival, f"{system} {drawn}" if system else drawn, count,
                                      lengths.randint(*config.output_tokens)))
    return planned


def source_words(limit_chars: int = 300_000) -> list[str]:
    """The alphabetic words of Python's standard library source, in order (the prompts' material): names,
    keywords, comments and docstrings without punctuation, so a word is a token or two of a BPE and a
    prompt's token count follows its word count closely enough to keep prompt + output within a model."""
    return [word for text in stdlib_texts(limit_chars) for word in text.split() if word.isalpha()]


# ---- one request, streamed --------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds)."""

    planned: PlannedRequest
    send_lag_s: float  # sent this long after its arrival time
    token_times: list[float] = field(default_factory=list)  # after sending, one per token event
    e2e_s: float | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.token_times[0]

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def generate_body(request: PlannedRequest) -> dict:
    """A streamed greedy generate of exactly the drawn number of tokens."""
    tokens = request.output_tokens
    return {"inputs": [request.prompt], "strategy": "greedy", "max_new_tokens": tokens, "min_new_tokens": tokens,
            "stream": True}


async def send(client: httpx.AsyncClient, path: str, request: PlannedRequest, scheduled: float) -> RequestRecord:
    """Send ``request`` (scheduled at perf_counter ``scheduled``) and time each token event of its stream."""
    sent = time.perf_counter()
    record = RequestRecord(request, sent - scheduled)
    try:
        async with client.stream("POST", path, json=generate_body(request)) as response:
            if response.status_code != 200:
                record.error = f"{response.status_code} {(await response.aread()).decode(errors='replace')[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:  # the stream failed after its first event
                    record.error = f"{event['error']['code']}: {event['error']['message']}"
                    return record
                if event.get("token") is not None:
                    record.token_times.append(time.perf_counter() - sent)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event that is not JSON
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e_s = time.perf_counter() - sent
    if len(record.token_times) != request.output_tokens:
        record.error = f"{len(record.token_times)} token events, expected {request.output_tokens}"
    return record


# ---- one rate, open loop ----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks; nan when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class RateResult:
    rate: float  # offered, requests per second
    planned: int
    completed: list[RequestRecord]
    failed: list[RequestRecord]
    shed: int  # arrivals not sent: the in-flight cap was reached
    unfinished: int  # cancelled at the drain deadline
    seconds: float  # from the start of the arrivals to the last answer (or the drain deadline)
    peak_in_flight: int
    send_lags_s: list[float]  # of every request sent
    client_cpu_s: float
    prompt_tokens: float | None = None  # the server's count over the rate (None: unknown)
    rows_per_call: float | None = None  # the server's mean tserve_batch_size (decode steps and prefills) over the rate
    server_cpu_s: float | None = None  # CPU time of the server process over the rate (None: unknown)
    prefix_hit_rate: float | None = None  # prompt tokens found in the server's prefix cache / looked up (None: none)

    @property
    def first_error(self) -> str | None:
        return self.failed[0].error if self.failed else None

    @property
    def request_throughput(self) -> float:
        return len(self.completed) / self.seconds if self.seconds > 0 else 0.0

    @property
    def token_throughput(self) -> float:
        tokens = sum(r.planned.output_tokens for r in self.completed)
        return tokens / self.seconds if self.seconds > 0 else 0.0

    def ttft(self, q: float) -> float:
        return percentile([r.ttft_s for r in self.completed], q)

    def itl(self, q: float) -> float:
        return percentile([gap for r in self.completed for gap in r.itls_s], q)

    def e2e(self, q: float) -> float:
        return percentile([r.e2e_s for r in self.completed], q)

    def saturated(self, slo_s: float) -> bool:
        """p99 TTFT above ``slo_s``, or requests whose TTFT is unbounded (shed, unfinished) or none completed."""
        return not self.completed or self.shed > 0 or self.unfinished > 0 or self.ttft(99) > slo_s


COUNTERS = ("tserve_prompt_tokens_total", "tserve_prefix_cache_hits_total", "tserve_prefix_cache_queries_total")


async def model_counters(client: httpx.AsyncClient, model: str) -> tuple[float, ...]:
    """The server's :data:`COUNTERS` for ``model`` (all adapters), in that order."""
    text = (await client.get("/metrics")).text
    return tuple(sum(value for labels, value in metric_samples(text, name).items() if ("model", model) in labels)
                 for name in COUNTERS)


@dataclass(frozen=True)
class ServerCounters:
    """The server's cumulative counters that a rate's result reports the increase of."""

    prompt_tokens: float
    prefix: tuple[float, float]  # (hits, queries) of the prefix cache, in tokens
    batch_rows: tuple[float, float]  # (sum, count) of tserve_batch_size
    cpu_s: float | None

    @classmethod
    async def read(cls, client: httpx.AsyncClient, model: str, pid: int | None) -> ServerCounters:
        prompt_tokens, hits, queries = await model_counters(client, model)
        return cls(prompt_tokens, (hits, queries), await batch_sizes(client, model), process_cpu_s(pid))

    def since(self, before: ServerCounters) -> dict[str, float | None]:
        """RateResult's server fields over the time from ``before`` to this reading."""
        calls = self.batch_rows[1] - before.batch_rows[1]
        queries = self.prefix[1] - before.prefix[1]
        return dict(prompt_tokens=self.prompt_tokens - before.prompt_tokens,
                    prefix_hit_rate=(self.prefix[0] - before.prefix[0]) / queries if queries else None,
                    rows_per_call=(self.batch_rows[0] - before.batch_rows[0]) / calls if calls else None,
                    server_cpu_s=self.cpu_s - before.cpu_s if self.cpu_s is not None and before.cpu_s is not None
                    else None)


async def run_rate(url: str, model: str, rate: float, planned: list[PlannedRequest], config: LoadConfig,
                   pid: int | None = None) -> RateResult:
    """Send ``planned`` at their arrival times, never waiting for answers; then wait up to the drain time.
    ``pid``: the server's process, for its CPU time (None: not reported)."""
    limits = httpx.Limits(max_connections=config.max_in_flight + 4, max_keepalive_connections=config.max_in_flight)
    timeout = httpx.Timeout(config.duration_s + config.drain_s + 60.0)
    path = f"/v1/models/{model}/generate"
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        server_before, cpu_before = await ServerCounters.read(client, model, pid), time.process_time()
        tasks: list[asyncio.Task[RequestRecord]] = []
        in_flight: set[asyncio.Task[RequestRecord]] = set()
        shed = peak = 0
        start = time.perf_counter()
        for request in planned:
            scheduled = start + request.arrival_s
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            if len(in_flight) >= config.max_in_flight:
                shed += 1
                continue
            task = asyncio.create_task(send(client, path, request, scheduled))
            tasks.append(task)
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            peak = max(peak, len(in_flight))
        drain_deadline = start + config.duration_s + config.drain_s
        await finish(tasks, drain_deadline - time.perf_counter())
        seconds = time.perf_counter() - start
        records = [t.result() for t in tasks if not t.cancelled()]
        unfinished = len(tasks) - len(records)
        cpu = time.process_time() - cpu_before
        server = (await ServerCounters.read(client, model, pid)).since(server_before)
    failed = [r for r in records if r.error]
    return RateResult(rate, len(planned), [r for r in records if not r.error], failed, shed, unfinished, seconds,
                      peak, [r.send_lag_s for r in records], cpu, **server)


async def finish(tasks: list[asyncio.Task[RequestRecord]], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for ``tasks``, then cancel the rest (closing their streams: the server drops them)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(timeout_s, 0.0))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
