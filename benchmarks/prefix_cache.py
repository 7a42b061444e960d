"""Prefix caching, time to first token: `python -m benchmarks.prefix_cache [--requests 32] [--prefix-tokens 384]
[--suffix-tokens 16] [--rounds 3] [--threads 2] [--tiny]`.

A burst of ``--requests`` streamed requests sharing a prompt prefix of about ``--prefix-tokens`` tokens (a system
prompt: consecutive words of Python's standard library source), each with its own suffix of about
``--suffix-tokens`` tokens, all sent at once. Each round starts ``python -m service`` twice on the same random-
weight causal LM, one after the other: prefix caching off (``TSERVE_PREFIX_CACHE_MB=0``) and on (the default),
and sends each two bursts with different suffixes: "cold" (the prefix was never seen: with the cache, the first
prefill computes the shared blocks once and every row reuses them) and "warm" (the cold burst left the prefix in
the cache). TTFT is timed by the client from sending to the first token event. Reported per burst: TTFT p50 and
p90 over all rounds' requests with the cache off and on, the ratio of the p50s (off / on), and the server's
prefix-cache hits over its queries (tokens). The issue's goal: TTFT with the cache >= 5x lower (warm burst).

Then, in this process, one running batch of the burst (service/engine/runners.py's ``CausalRunner``, as the server runs
it) with the cache off and on: the KV memory the batch holds (``KVCache.nbytes``: with the cache, its rows read
the cached prefix blocks in place, so the batch holds the prefix once) and the time of its decoding steps,
alternating off and on step by step; the greedy tokens of the two must agree.

``--distinct [--seconds 30] [--clients 4] [--prompt-tokens 860] [--budget-mb 64] [--rounds 1] [--before-tree DIR]``
(issue 33) measures what the cache costs a workload that never repeats a prefix: ``--clients`` closed-loop clients send
distinct prompts of about ``--prompt-tokens`` tokens (consecutive stdlib words from random places) for
``--seconds`` to a tiny random causal LM (max_len 1024), one server after the other: cache off, cache on at
``--budget-mb``, and, with ``--before-tree`` (a source tree, e.g. ``git archive HEAD | tar -x -C DIR``), cache on
served from that tree's code. Reported per server: requests/s and its ratio to cache off, the server's RSS added
over the run (after one warm-up request), that minus cache off's, and the latter over the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from benchmarks.common import machine_line, markdown_table
from benchmarks.open_loop_load import PlannedRequest, RequestRecord, percentile, send, source_words
from benchmarks.serve_setup import stdlib_texts
from model.causal_lm import CausalLM
from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import CausalLMConfig
from model.prefix_cache import ENTRY_OVERHEAD_BYTES, PrefixCache
from model.tokenizer import Tokenizer
from service.engine.runners import CausalRunner
from service.local_server import metric_samples, rss_bytes, running_server

logger = logging.getLogger("benchmarks.prefix_cache")

MODEL = "prefix-lm"
SIZES = dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6, vocab_size=8000, max_len=512, dropout=0.0)
TINY_SIZES = dict(d_model=64, n_heads=4, d_ff=128, n_layers=2, vocab_size=1000, max_len=512, dropout=0.0)
DISTINCT_SIZES = dict(TINY_SIZES, max_len=1024)  # --distinct: the tiny random LM with 1024 positions
BURSTS = ("cold", "warm")
OUTPUT_TOKENS = 4  # TTFT is the point; a few tokens check that the streams carry on
BATCH_STEPS = 32  # decoding steps of the in-process running batch, each timed off and on


@dataclass
class Burst:
    """TTFTs (s) of one kind of burst over the rounds, with the cache off and on, and the on-server's counters."""

    off: list[float] = field(default_factory=list)
    on: list[float] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0


def build_model(directory: Path, tiny: bool, sizes: dict | None = None) -> str:
    """A random-weight causal LM with a BPE trained on stdlib source; returns what it is."""
    sizes = sizes or (TINY_SIZES if tiny else SIZES)
    tokenizer = Tokenizer.train(stdlib_texts(200_000 if tiny else 2_000_000), vocab_size=sizes["vocab_size"])
    torch.manual_seed(0)
    model = CausalLM(CausalLMConfig(**dict(sizes, vocab_size=tokenizer.vocab_size))).eval()
    save_checkpoint(directory / MODEL, model, tokenizer)
    return (f"random-weight causal_lm d_model {sizes['d_model']}, {sizes['n_layers']} layers, {sizes['n_heads']} "
            f"heads, ffn {sizes['d_ff']}, BPE vocab {tokenizer.vocab_size} (stdlib source), fp32")


def passages(tokenizer: Tokenizer, words: list[str], tokens: int, count: int, seed: int) -> list[str]:
    """``count`` runs of consecutive words from random places, each the shortest reaching ``tokens`` tokens."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        start = rng.randrange(len(words) - 4 * tokens)
        end = start + 1
        while len(tokenizer.encode(" ".join(words[start:end]))) < tokens:
            end += 1
        out.append(" ".join(words[start:end]))
    return out


async def burst(url: str, prompts: list[str]) -> list[RequestRecord]:
    """Send every prompt at once, streamed; raise on any failed request."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        path = f"/v1/models/{MODEL}/generate"
        now = time.perf_counter()
        records = await asyncio.gather(*(send(client, path, PlannedRequest(0.0, p, len(p.split()), OUTPUT_TOKENS), now)
                                         for p in prompts))
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return list(records)


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    hits = sum(metric_samples(text, "tserve_prefix_cache_hits_total").values())
    return hits, sum(metric_samples(text, "tserve_prefix_cache_queries_total").values())


def run(args: argparse.Namespace) -> str:
    work = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    try:
        models = work / "models"
        models.mkdir()
        described = build_model(models, args.tiny)
        tokenizer = Tokenizer.load(models / MODEL / "tokenizer.json")
        words = source_words()
        system = passages(tokenizer, words, args.prefix_tokens, 1, seed=0)[0]
        prompt_tokens = []
        bursts = {kind: Burst() for kind in BURSTS}
        load_before = os.getloadavg()
        for round_ in range(args.rounds):
            suffixes = {kind: passages(tokenizer, words, args.suffix_tokens, args.requests, seed=1 + 2 * round_ + i)
                        for i, kind in enumerate(BURSTS)}
            for cache_on in (False, True):
                env = dict(TSERVE_THREADS=str(args.threads), TSERVE_REQUEST_TIMEOUT_S="600",
                           TSERVE_PREFIX_CACHE_MB="256" if cache_on else "0")
                with running_server(models, ready_timeout_s=300, **env) as server:
                    for kind in BURSTS:
                        prompts = [f"{system}\n{s}" for s in suffixes[kind]]
                        before = prefix_counters(server.url)
                        records = asyncio.run(burst(server.url, prompts))
                        after = prefix_counters(server.url)
                        ttfts = [r.ttft_s for r in records]
                        getattr(bursts[kind], "on" if cache_on else "off").extend(ttfts)
                        if cache_on:
                            bursts[kind].hits += after[0] - before[0]
                            bursts[kind].queries += after[1] - before[1]
                        prompt_tokens += [len(tokenizer.encode(p, add_bos=True)) for p in prompts]
                        logger.info("round %d, cache %s, %s burst: TTFT p50 %.3f s", round_ + 1,
                                    "on" if cache_on else "off", kind, percentile(ttfts, 50))
        batch = running_batch(models / MODEL, [f"{system}\n{s}" for s in suffixes["warm"]], args.threads)
        loads = (load_before, os.getloadavg())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(args, described, bursts, sum(prompt_tokens) / len(prompt_tokens), loads) + "\n\n" + batch


def running_batch(model_dir: Path, texts: list[str], threads: int) -> str:
    """One running batch of ``texts`` prefilled and decoded by the server's runner with the prefix cache off and on:
    its KV memory and decoding-step times (medians, the two alternating step by step), as a table."""
    torch.set_num_threads(threads)
    ckpt = load_checkpoint(model_dir, device="cpu")
    prompts = [ckpt.tokenizer.encode(text, add_bos=True) for text in texts]
    runners = {"off": CausalRunner(ckpt.model), "on": CausalRunner(ckpt.model, PrefixCache(256 << 20))}
    caches, tokens, held, steps = {}, {}, {}, {name: [] for name in runners}
    with torch.no_grad():
        for name, runner in runners.items():
            logits, caches[name] = runner.prefill(prompts, [None] * len(prompts), [[] for _ in prompts])
            tokens[name], held[name] = logits.argmax(-1), caches[name].nbytes
        for _ in range(BATCH_STEPS):
            for name, runner in runners.items():
                start = time.perf_counter()
                logits = runner.decode(tokens[name], caches[name])
                steps[name].append(time.perf_counter() - start)
                tokens[name] = logits.argmax(-1)
            if not torch.equal(tokens["off"], tokens["on"]):
                raise RuntimeError("the batch with the prefix cache chose other tokens than the one without")
    off, on = held["off"], held["on"]
    step_off, step_on = percentile(steps["off"], 50), percentile(steps["on"], 50)
    return "\n".join([
        f"Running batch (in process, torch threads {threads}): {len(prompts)} rows of the warm burst, "
        f"{BATCH_STEPS} greedy decoding steps (the same tokens off and on)",
        "",
        markdown_table(["prefix cache", "KV bytes held by the batch after its prefill", "decoding step p50 (ms)"], [
            ["off (each row holds its whole prompt)", f"{off / 2**20:,.1f} MiB", f"{step_off * 1000:.1f}"],
            ["on (rows read the cached prefix blocks in place)", f"{on / 2**20:,.1f} MiB", f"{step_on * 1000:.1f}"],
            ["off / on", f"{off / on:.1f}x", f"{step_off / step_on:.2f}x"],
        ]),
    ])


def report(args: argparse.Namespace, described: str, bursts: dict[str, Burst], mean_prompt: float,
           loads: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    rows = []
    for kind, b in bursts.items():
        off50, on50 = percentile(b.off, 50), percentile(b.on, 50)
        rows.append([kind, f"{off50 * 1000:,.0f}", f"{percentile(b.off, 90) * 1000:,.0f}", f"{on50 * 1000:,.0f}",
                     f"{percentile(b.on, 90) * 1000:,.0f}", f"{off50 / on50:.1f}x",
                     f"{b.hits / b.queries:.0%}" if b.queries else "-"])
    table = markdown_table(["burst", "TTFT p50 off (ms)", "p90 off", "TTFT p50 on (ms)", "p90 on",
                            "p50 off / on", "prefix-cache hits / queries"], rows)
    lines = [
        f"Machine: {machine_line()}",
        f"Load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in loads[0])} before, "
        f"{'/'.join(f'{x:.2f}' for x in loads[1])} after",
        f"Model: {described}",
        f"Server: python -m service on 127.0.0.1, TSERVE_THREADS={args.threads}, max_batch_size 32 "
        "(default; generation starts a lone request at once); cache off = TSERVE_PREFIX_CACHE_MB=0, on = 256; "
        "client (httpx, asyncio) on the same machine",
        f"Load: {args.rounds} rounds x {args.requests} requests per burst, all sent at once; a shared prefix of "
        f"{args.prefix_tokens} tokens + a suffix of {args.suffix_tokens} tokens (mean prompt {mean_prompt:.0f} "
        f"tokens with BOS and the newline between), {OUTPUT_TOKENS} greedy tokens streamed",
        "",
        table,
    ]
    return "\n".join(lines)


@dataclass
class Served:
    """One server of the distinct-prompts case: what it served and the RSS it added (bytes)."""

    label: str
    requests: int
    seconds: float
    rss_added: int
    cache_bytes: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


async def closed_loop(url: str, clients: int, seconds: float, prompt: Callable[[], str]) -> int:
    """``clients`` loops each sending one request after the other (at least one) until ``seconds`` have passed;
    returns how many completed."""
    done = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while done == 0 or time.perf_counter() < end:
            text = prompt()
            record = await send(http, f"/v1/models/{MODEL}/generate",
                                PlannedRequest(0.0, text, len(text.split()), OUTPUT_TOKENS), time.perf_counter())
            if record.error is not None:
                raise RuntimeError(f"a request failed: {record.error}")
            done += 1

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        end = time.perf_counter() + seconds
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return done


def serve_distinct(models: Path, label: str, budget_mb: float, args: argparse.Namespace, prompt: Callable[[], str],
                   tree: Path | None = None) -> Served:
    """Start a server (from ``tree``'s code if given), send one warm-up request, then the closed loop."""
    module = ("-m", "service") if tree is None else (
        "-c", f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); "
              "runpy.run_module('service', run_name='__main__', alter_sys=True)")
    env = dict(TSERVE_THREADS=str(args.threads), TSERVE_REQUEST_TIMEOUT_S="600", TSERVE_PREFIX_CACHE_MB=str(budget_mb))
    with running_server(models, ready_timeout_s=300, module_args=module, **env) as server:
        asyncio.run(closed_loop(server.url, 1, 0.0, prompt))  # one request: the first prefill's allocations
        before = rss_bytes(server.process.pid)
        start = time.perf_counter()
        requests = asyncio.run(closed_loop(server.url, args.clients, args.seconds, prompt))
        seconds = time.perf_counter() - start
        added = rss_bytes(server.process.pid) - before
        text = httpx.get(server.url + "/metrics", timeout=30).text
        cache = sum(metric_samples(text, "tserve_prefix_cache_bytes").values())
    logger.info("%s: %d requests in %.1f s, RSS +%.0f MiB", label, requests, seconds, added / 2**20)
    return Served(label, requests, seconds, added, cache)


def run_distinct(args: argparse.Namespace) -> str:
    """The distinct-prompts case (module docstring): cache off, on, and on from ``--before-tree``, as a table."""
    work = Path(tempfile.mkdtemp(prefix="bench-prefix-distinct-"))
    try:
        models = work / "models"
        models.mkdir()
        described = build_model(models, True, DISTINCT_SIZES)
        tokenizer = Tokenizer.load(models / MODEL / "tokenizer.json")
        words = source_words()
        sample = passages(tokenizer, words, args.prompt_tokens, 8, seed=0)
        per_word = sum(len(tokenizer.encode(t)) for t in sample) / sum(len(t.split()) for t in sample)
        length = int(args.prompt_tokens / per_word)
        starts = random.Random(0).sample(range(len(words) - 2 * length), len(words) - 2 * length)  # no start twice

        def prompt() -> str:  # about --prompt-tokens tokens: cut by tokens, not words (their ratio varies)
            start = starts.pop()
            return tokenizer.decode(tokenizer.encode(" ".join(words[start: start + 2 * length]))[: args.prompt_tokens])

        mean = sum(len(tokenizer.encode(prompt(), add_bos=True)) for _ in range(32)) / 32
        load_before = os.getloadavg()
        runs: list[list[Served]] = []
        for _ in range(args.rounds):  # the servers in turn, round after round: the machine's load hits them alike
            runs.append([serve_distinct(models, "off", 0, args, prompt),
                         serve_distinct(models, f"on, {args.budget_mb:g} MB", args.budget_mb, args, prompt)])
            if args.before_tree is not None:
                runs[-1].append(serve_distinct(models, f"on, {args.budget_mb:g} MB, before (--before-tree)",
                                               args.budget_mb, args, prompt, args.before_tree))
        served = [Served(rounds[0].label, sum(r.requests for r in rounds), sum(r.seconds for r in rounds),
                         int(statistics.median(r.rss_added for r in rounds)), rounds[-1].cache_bytes)
                  for rounds in zip(*runs, strict=True)]
        loads = (load_before, os.getloadavg())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return distinct_report(args, described, mean, served, loads)


def distinct_report(args: argparse.Namespace, described: str, mean_prompt: float, served: list[Served],
                    loads: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    off, budget = served[0], args.budget_mb * 2**20
    rows = [[s.label, f"{s.requests:,}", f"{s.rate:.1f}", f"{s.rate / off.rate:.2f}x", f"{s.rss_added / 2**20:+,.0f}",
             "-" if s is off else f"{(s.rss_added - off.rss_added) / 2**20:+,.0f}",
             "-" if s is off else f"{(s.rss_added - off.rss_added) / budget:.2f}x", f"{s.cache_bytes / 2**20:,.0f}"]
            for s in served]
    block = DISTINCT_SIZES["n_layers"] * 2 * DISTINCT_SIZES["d_model"] * 16 * 4
    return "\n".join([
        f"Machine: {machine_line()}",
        f"Load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in loads[0])} before, "
        f"{'/'.join(f'{x:.2f}' for x in loads[1])} after",
        f"Model: {described}, max_len {DISTINCT_SIZES['max_len']} (a cached block: {block / 1024:.0f} KiB of K/V "
        f"+ ~{ENTRY_OVERHEAD_BYTES / 1024:.0f} KiB of RSS besides: a full cache should add "
        f"{1 + ENTRY_OVERHEAD_BYTES / block:.2f}x its budget)",
        f"Load: {args.clients} closed-loop clients x {args.seconds:g} s per server and round, {args.rounds} rounds "
        f"(servers in turn; requests/s over all rounds, RSS added: the median round's), distinct prompts of "
        f"{mean_prompt:.0f} tokens on average (with BOS), {OUTPUT_TOKENS} greedy tokens streamed; "
        f"TSERVE_THREADS={args.threads}",
        "",
        markdown_table(["server", "requests", "requests/s", "vs cache off", "RSS added (MiB)",
                        "minus cache off's (MiB)", "that / budget", "tserve_prefix_cache_bytes (MiB)"], rows),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32, help="requests per burst")
    parser.add_argument("--prefix-tokens", type=int, default=384, help="tokens of the shared prefix")
    parser.add_argument("--suffix-tokens", type=int, default=16, help="tokens of each request's own suffix")
    parser.add_argument("--rounds", type=int, help="server pairs (off, on) started one after the other (default 3; "
                        "--distinct: 1)")
    parser.add_argument("--threads", type=int, default=2, help="server torch intra-op threads (TSERVE_THREADS)")
    parser.add_argument("--tiny", action="store_true", help="a toy model and short run (the test suite's smoke run)")
    parser.add_argument("--distinct", action="store_true", help="the distinct-prompts case instead (issue 33)")
    parser.add_argument("--seconds", type=float, default=30.0, help="--distinct: closed-loop seconds per server")
    parser.add_argument("--clients", type=int, default=4, help="--distinct: concurrent closed-loop clients")
    parser.add_argument("--prompt-tokens", type=int, default=860, help="--distinct: tokens per prompt, about")
    parser.add_argument("--budget-mb", type=float, default=64.0, help="--distinct: the cache-on servers' budget")
    parser.add_argument("--before-tree", type=Path, help="--distinct: also serve cache on from this source tree")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.distinct else 3
    if args.distinct:
        too_long = args.prompt_tokens + OUTPUT_TOKENS + 8 > DISTINCT_SIZES["max_len"]
        if too_long or min(args.clients, args.seconds, args.rounds) <= 0:
            parser.error(f"--prompt-tokens + {OUTPUT_TOKENS} must fit {DISTINCT_SIZES['max_len']} positions, and "
                         "--clients, --seconds and --rounds be positive")
        return args
    if args.tiny:
        args.requests, args.prefix_tokens, args.suffix_tokens, args.rounds = 4, 64, 8, 1
    if min(args.requests, args.prefix_tokens, args.suffix_tokens, args.rounds, args.threads) < 1:
        parser.error("--requests, --prefix-tokens, --suffix-tokens, --rounds and --threads must be >= 1")
    if args.prefix_tokens + args.suffix_tokens + OUTPUT_TOKENS + 8 > SIZES["max_len"]:
        parser.error(f"prefix + suffix + {OUTPUT_TOKENS} new tokens must fit the model's {SIZES['max_len']} positions")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    text = run_distinct(args) if args.distinct else run(args)
    print(text)
    return text


if __name__ == "__main__":
    main()
