"""Soak test: `python -m benchmarks.soak [--minutes 5] [--clients 8] [--url URL --pid PID] [--json FILE]`.

Mixed traffic from concurrent clients against a real server on 127.0.0.1 for N minutes: generation
(greedy, beam, seeded sampling, SSE streams, OpenAI completions), classify, embed, requests on an
adapter that is replaced under its name every second (uploads alternating two versions) while a
second adapter is loaded and unloaded, invalid requests, and clients that hang up mid-request.

Without ``--url`` it makes tiny random-weight checkpoints and adapters of the test suite's shapes
(benchmarks/serve_setup.py ``build_tiny_models``: causal_lm, seq2seq and classifier of d_model 32, 2 layers, one
random LoRA adapter each) and starts ``python -m service`` on them with a small queue (``--max-queue``, so that
bursts meet 429s).

Every answer is classified: succeeded (the expected status, and for deterministic requests the same
tokens or labels as the request gave alone at warm-up), rejected (429), or failed (anything else:
5xx, a wrong result, an unexpected status or a dropped connection). Invalid requests succeed when
refused with their 4xx; deliberate hang-ups are counted apart. Reports requests, outcomes,
p50/p99 latency per kind, and the server's RSS (/proc/<pid>/status) after warm-up and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import machine_line, markdown_table
from benchmarks.serve_setup import build_tiny_models
from service.local_server import adapter_archive, adapter_variant, metric_samples, rss_bytes, running_server

logger = logging.getLogger("benchmarks.soak")

LM, MT, CLS = "tiny-lm", "tiny-mt", "tiny-cls"
PROMPTS = ["hello world", "the cat", "gold", "delete file 3", "i love this", "open the window", "a journey"]
SWAP, EXTRA = "soak-swap", "soak-extra"
NEW_TOKENS = 16
# kind -> weight in the mix
MIX = {
    "greedy": 3, "beam": 2, "sample": 1, "stream": 1, "completions": 1, "classify": 2, "embed": 1,
    "swap-adapter": 1, "invalid": 1, "disconnect": 0.5,
}  # fmt: skip
INVALID = [  # (path, body, expected status)
    (f"/v1/models/{LM}/generate", {"inputs": []}, 422),
    (f"/v1/models/{LM}/generate", {"inputs": ["x"], "max_new_tokens": 10**9}, 422),
    (f"/v1/models/{LM}/generate", {"inputs": ["x"], "adapter": "../etc"}, 422),
    (f"/v1/models/{LM}/generate", {"inputs": ["x"], "adapter": "no-such-adapter"}, 404),
    ("/v1/models/no-such-model/generate", {"inputs": ["x"]}, 404),
    (f"/v1/models/{CLS}/classify", {"inputs": [["a", "b", "c"]]}, 422),
    (f"/v1/models/{LM}/generate", {"inputs": ["x" * 70_000]}, (413, 422)),  # 413 over max_body_bytes
]


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome)
    failures: list[str] = field(default_factory=list)

    def record(self, kind: str, outcome: str, seconds: float | None = None, why: str = "") -> None:
        self.outcomes[(kind, outcome)] += 1
        if seconds is not None and outcome == "succeeded":
            self.latencies[kind].append(seconds)
        if outcome == "failed" and len(self.failures) < 20:
            self.failures.append(f"{kind}: {why}"[:300])


# ---- server and adapters -----------------------------------------------------------------------------


@contextmanager
def own_server(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[str, int, Path]]:
    """Tiny random checkpoints and a ``python -m service`` on them: (url, pid, adapters dir)."""
    start = time.perf_counter()
    models, adapters = build_tiny_models(workdir)
    logger.info("made the tiny checkpoints and adapters in %.0f s", time.perf_counter() - start)
    env = dict(TSERVE_MAX_QUEUE=str(args.max_queue), TSERVE_LOG_LEVEL="warning", TSERVE_THREADS=str(args.threads),
               TSERVE_MAX_BODY_BYTES="65536")  # fmt: skip
    with running_server(models, adapters, **env) as server:
        yield server.url, server.process.pid, adapters


# ---- traffic -----------------------------------------------------------------------------------------


def outputs_key(body: dict) -> list:
    return [(o["text"], o["tokens"]) for o in body["outputs"]]


async def reference(c: httpx.AsyncClient, kind: str, prompt: str, adapter: str | None) -> object:
    """What a deterministic request gives alone (the check for the same request under load)."""
    if kind == "beam":
        body = {"inputs": [prompt], "strategy": "beam", "num_beams": 4, "max_new_tokens": NEW_TOKENS}
        return outputs_key((await c.post(f"/v1/models/{MT}/generate", json=body)).json())
    if kind == "classify":
        body = {"inputs": PROMPTS[:4], "adapter": adapter}
        return [o["label"] for o in (await c.post(f"/v1/models/{CLS}/classify", json=body)).json()["outputs"]]
    body = {"inputs": [prompt], "max_new_tokens": NEW_TOKENS, "adapter": adapter}
    r = await c.post(f"/v1/models/{LM}/generate", json=body)
    assert r.status_code == 200, r.text
    return outputs_key(r.json())


class Traffic:
    def __init__(self, url: str, adapters: dict[str, str], refs: dict, stats: Stats, seed: int) -> None:
        self.url, self.adapters, self.refs, self.stats = url, adapters, refs, stats
        self.rng = random.Random(seed)

    async def client(self, k: int, end: float) -> None:
        rng = random.Random(self.rng.random() + k)
        kinds, weights = list(MIX), list(MIX.values())
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as c:
            while time.monotonic() < end:
                kind = rng.choices(kinds, weights)[0]
                start = time.perf_counter()
                try:
                    outcome, why = await self.one(c, kind, rng)
                except httpx.TransportError as exc:
                    outcome, why = "failed", f"{type(exc).__name__}: {exc}"
                self.stats.record(kind, outcome, time.perf_counter() - start, why)

    async def one(self, c: httpx.AsyncClient, kind: str, rng: random.Random) -> tuple[str, str]:
        prompt = rng.choice(PROMPTS)
        lm_adapter = rng.choice([None, self.adapters[LM]])
        if kind == "invalid":
            path, body, expected = rng.choice(INVALID)
            r = await c.post(path, json=body)
            ok = r.status_code in (expected if isinstance(expected, tuple) else (expected,))
            return ("succeeded", "") if ok else ("failed", f"{path}: {r.status_code} {r.text[:200]}")
        if kind == "disconnect":
            body = {"inputs": [prompt], "max_new_tokens": 100, "min_new_tokens": 100}
            if rng.random() < 0.5:
                async with c.stream("POST", f"/v1/models/{LM}/generate", json={**body, "stream": True}) as r:
                    if r.status_code == 429:
                        return "rejected", ""
                    await anext(r.aiter_lines())  # first event, then hang up
            else:
                with suppress(httpx.TimeoutException):  # the client gives up after 50 ms
                    await c.post(f"/v1/models/{LM}/generate", json=body, timeout=0.05)
            return "hung up", ""
        if kind == "stream":
            body = {"inputs": [prompt], "max_new_tokens": NEW_TOKENS, "adapter": lm_adapter, "stream": True}
            text, events = "", []
            async with c.stream("POST", f"/v1/models/{LM}/generate", json=body) as r:
                if r.status_code != 200:
                    return self.status(r, await r.aread())
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            if any("error" in e for e in events):
                return "failed", f"stream error event {events[-1]}"
            text = "".join(e["text"] for e in events)
            want = self.refs[("greedy", prompt, lm_adapter)][0][0]
            return ("succeeded", "") if text == want else ("failed", f"stream text {text!r} != {want!r}")
        if kind == "completions":
            body = {"model": LM, "prompt": prompt, "max_tokens": 8, "temperature": 0.7, "seed": 1}
            r = await c.post("/v1/completions", json=body)
            return self.status(r)
        if kind == "sample":
            body = {"inputs": [prompt], "strategy": "sample", "seed": rng.randrange(1000), "top_p": 0.9,
                    "max_new_tokens": NEW_TOKENS, "adapter": lm_adapter}  # fmt: skip
            return self.status(await c.post(f"/v1/models/{LM}/generate", json=body))
        if kind == "embed":
            return self.status(await c.post(f"/v1/models/{CLS}/embed", json={"inputs": PROMPTS[:3]}))
        if kind == "classify":
            adapter = rng.choice([None, self.adapters[CLS]])
            r = await c.post(f"/v1/models/{CLS}/classify", json={"inputs": PROMPTS[:4], "adapter": adapter})
            got = [o["label"] for o in r.json()["outputs"]] if r.status_code == 200 else None
            return self.check(r, got, [self.refs[("classify", None, adapter)]])
        if kind == "beam":
            body = {"inputs": [prompt], "strategy": "beam", "num_beams": 4, "max_new_tokens": NEW_TOKENS}
            r = await c.post(f"/v1/models/{MT}/generate", json=body)
            return self.check(
                r, outputs_key(r.json()) if r.status_code == 200 else None, [self.refs[("beam", prompt, None)]]
            )
        adapter = SWAP if kind == "swap-adapter" else lm_adapter
        body = {"inputs": [prompt], "max_new_tokens": NEW_TOKENS, "adapter": adapter}
        r = await c.post(f"/v1/models/{LM}/generate", json=body)
        keys = [(SWAP, "v1"), (SWAP, "v2")] if adapter == SWAP else [adapter]
        wanted = [self.refs[("greedy", prompt, a)] for a in keys]
        return self.check(r, outputs_key(r.json()) if r.status_code == 200 else None, wanted)

    @staticmethod
    def status(r: httpx.Response, content: bytes | None = None) -> tuple[str, str]:
        if r.status_code == 200:
            return "succeeded", ""
        if r.status_code == 429:
            return "rejected", ""
        return "failed", f"{r.request.url.path}: {r.status_code} {(content or r.content)[:200]!r}"

    def check(self, r: httpx.Response, got: object, wanted: list) -> tuple[str, str]:
        outcome, why = self.status(r)
        if outcome == "succeeded" and got not in wanted:
            return "failed", f"{r.request.url.path}: result {got} is none of {wanted}"
        return outcome, why


async def swapper(url: str, versions: list[bytes], end: float, stats: Stats) -> None:
    """Replace SWAP every second (alternating versions); load and unload EXTRA every third second."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        i = 0
        while time.monotonic() < end:
            i += 1
            calls = [("replace", c.put(f"/v1/models/{LM}/adapters/{SWAP}", content=versions[i % 2],
                                       headers={"Content-Type": "application/gzip"}))]  # fmt: skip
            if i % 3 == 0:
                calls.append(("load", c.put(f"/v1/models/{LM}/adapters/{EXTRA}")))
            for what, call in calls:
                start = time.perf_counter()
                r = await call
                ok = r.status_code == 200
                stats.record(f"admin {what}", "succeeded" if ok else "failed", time.perf_counter() - start, r.text)
            if i % 3 == 0:
                await asyncio.sleep(0.3)
                r = await c.delete(f"/v1/models/{LM}/adapters/{EXTRA}")
                stats.record("admin unload", "succeeded" if r.status_code == 204 else "failed", None, r.text)
            await asyncio.sleep(1.0)


async def sample_rss(pid: int | None, end: float, samples: list[tuple[float, int]]) -> None:
    while pid is not None and time.monotonic() < end:
        samples.append((time.monotonic(), rss_bytes(pid)))
        await asyncio.sleep(5)


async def soak(args: argparse.Namespace, url: str, pid: int | None, adapters_dir: Path | None) -> dict:
    warm, stats, rss = Stats(), Stats(), []  # the report counts what comes after the warm-up
    adapters = {LM: "lm-a", CLS: "cls-a"}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        v1 = adapters_dir / LM / adapters[LM]
        tmp = Path(tempfile.mkdtemp(prefix="soak-"))
        versions = [adapter_archive(v1), adapter_archive(adapter_variant(v1, tmp / "v2"))]
        shutil.copytree(v1, adapters_dir / LM / EXTRA, dirs_exist_ok=True)
        upload = {"Content-Type": "application/gzip"}
        refs: dict = {}
        for version, data in (("v2", versions[1]), ("v1", versions[0])):  # SWAP alternates: both results are right
            r = await c.put(f"/v1/models/{LM}/adapters/{SWAP}", content=data, headers=upload)
            assert r.status_code == 200, r.text
            for p in PROMPTS:
                refs[("greedy", p, (SWAP, version))] = await reference(c, "greedy", p, SWAP)
        for p in PROMPTS:
            for a in (None, adapters[LM]):
                refs[("greedy", p, a)] = await reference(c, "greedy", p, a)
            refs[("beam", p, None)] = await reference(c, "beam", p, None)
        for a in (None, adapters[CLS]):
            refs[("classify", None, a)] = await reference(c, "classify", "", a)
        shutil.rmtree(tmp, ignore_errors=True)

    traffic = Traffic(url, adapters, refs, warm, args.seed)
    warm_end = time.monotonic() + args.warmup_s
    await asyncio.gather(*(traffic.client(k, warm_end) for k in range(args.clients)))
    rss_start = rss_bytes(pid) if pid else None
    traffic.stats = stats
    start = time.monotonic()
    end = start + args.minutes * 60
    await asyncio.gather(*(traffic.client(k, end) for k in range(args.clients)),
                         swapper(url, versions, end, stats), sample_rss(pid, end, rss))  # fmt: skip
    elapsed = time.monotonic() - start
    rss_end = rss_bytes(pid) if pid else None
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        server_statuses = Counter()
        for labels, value in metric_samples((await c.get("/metrics")).text, "tserve_requests_total").items():
            server_statuses[dict(labels)["status"]] += int(value)
        healthy = (await c.get("/health")).status_code == 200
    return {"stats": stats, "warm": warm, "elapsed": elapsed, "rss_start": rss_start, "rss_end": rss_end,
            "rss_samples": rss, "server_statuses": server_statuses, "healthy": healthy}  # fmt: skip


# ---- report ------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(args: argparse.Namespace, result: dict) -> tuple[str, dict]:
    stats: Stats = result["stats"]
    kinds = sorted({k for k, _ in stats.outcomes})
    rows = []
    for kind in kinds:
        n = {o: stats.outcomes[(kind, o)] for o in ("succeeded", "rejected", "failed", "hung up")}
        lat = stats.latencies.get(kind, [])
        rows.append([kind, sum(n.values()), n["succeeded"], n["rejected"], n["failed"], n["hung up"],
                     f"{percentile(lat, 0.5) * 1000:.0f}", f"{percentile(lat, 0.99) * 1000:.0f}"])  # fmt: skip
    totals = Counter()
    for (_, outcome), count in stats.outcomes.items():
        totals[outcome] += count
    every = [t for lat in stats.latencies.values() for t in lat]
    sent = sum(totals.values())
    rows.append(["**all**", sent, totals["succeeded"], totals["rejected"], totals["failed"], totals["hung up"],
                 f"{percentile(every, 0.5) * 1000:.0f}", f"{percentile(every, 0.99) * 1000:.0f}"])  # fmt: skip
    rss_start, rss_end = result["rss_start"], result["rss_end"]
    growth = (rss_end - rss_start) / rss_start * 100 if rss_start else float("nan")
    peak = max([b for _, b in result["rss_samples"]] + [rss_end or 0])
    first = result["rss_samples"][0][0] if result["rss_samples"] else 0.0
    by_minute = {}  # RSS at the first sample of each minute of the run: the trend, not just two points
    for at, rss in result["rss_samples"]:
        by_minute.setdefault(int((at - first) // 60), round(rss / 2**20, 1))
    summary = {
        "minutes": round(result["elapsed"] / 60, 2), "clients": args.clients, "sent": sent,
        "succeeded": totals["succeeded"], "rejected_429": totals["rejected"], "failed": totals["failed"],
        "hung_up": totals["hung up"], "p50_ms": round(percentile(every, 0.5) * 1000, 1),
        "p99_ms": round(percentile(every, 0.99) * 1000, 1), "rss_start_mb": rss_start and round(rss_start / 2**20, 1),
        "rss_end_mb": rss_end and round(rss_end / 2**20, 1), "rss_peak_mb": round(peak / 2**20, 1),
        "rss_growth_pct": round(growth, 2), "rss_by_minute_mb": list(by_minute.values()),
        "server_statuses": dict(result["server_statuses"]),
        "healthy_after": result["healthy"], "failures": stats.failures,
        "warmup_requests": sum(result["warm"].outcomes.values()),
    }  # fmt: skip
    lines = [
        f"# Soak: {summary['minutes']} min, {args.clients} clients",
        "",
        machine_line(),
        "",
        f"Server: {args.url or 'python -m service on tiny random checkpoints'}"
        + ("" if args.url else f", max_queue {args.max_queue}, {args.threads} torch thread(s), max_body_bytes 65536"),
        "",
        markdown_table(["kind", "sent", "succeeded", "429", "failed", "hung up", "p50 ms", "p99 ms"], rows),
        "",
        f"Server RSS: {summary['rss_start_mb']} MB after warm-up ({args.warmup_s:.0f} s, "
        f"{summary['warmup_requests']} requests), {summary['rss_end_mb']} MB at the end ({growth:+.2f}%), "
        f"peak {summary['rss_peak_mb']} MB; by minute: {summary['rss_by_minute_mb']} MB.",
        "Server-side statuses (tserve_requests_total, warm-up included): "
        f"{dict(sorted(summary['server_statuses'].items()))}.",
        f"Healthy after: {summary['healthy_after']}.",
    ]
    if stats.failures:
        lines += ["", "Failures (first 20):", *[f"- {f}" for f in stats.failures]]
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the measured run (default 5)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--warmup-s", type=float, default=20.0, help="traffic before the measured run (default 20)")
    parser.add_argument("--max-queue", type=int, default=4, help="the started server's max_queue (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="the started server's torch threads (default 1)")
    parser.add_argument("--url", help="a running server (with the tiny-lm/tiny-mt/tiny-cls models) instead")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    parser.add_argument("--adapters", type=Path, help="with --url: the server's adapters directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    with tempfile.TemporaryDirectory(prefix="soak-") as workdir:
        if args.url:
            if args.adapters is None:
                parser.error("--url needs --adapters (the swap adapter is uploaded there)")
            result = asyncio.run(soak(args, args.url, args.pid, args.adapters))
        else:
            with own_server(args, Path(workdir)) as (url, pid, adapters):
                result = asyncio.run(soak(args, url, pid, adapters))
    text, summary = report(args, result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["failed"] == 0 and summary["healthy_after"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
