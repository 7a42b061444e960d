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

Then, in this process, one running batch of the burst (service/runners.py's ``CausalRunner``, as the server runs
it) with the cache off and on: the KV memory the batch holds (``KVCache.nbytes``: with the cache, its rows read
the cached prefix blocks in place, so the batch holds the prefix once) and the time of its decoding steps,
alternating off and on step by step; the greedy tokens of the two must agree.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from benchmarks.common import machine_line, markdown_table
from benchmarks.open_loop import PlannedRequest, RequestRecord, percentile, send, source_words
from benchmarks.serve_setup import stdlib_texts
from model.causal_lm import CausalLM
from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import CausalLMConfig
from model.prefix_cache import PrefixCache
from model.tokenizer import Tokenizer
from service.runners import CausalRunner
from tests.service.server import metric_samples, running_server

logger = logging.getLogger("benchmarks.prefix_cache")

MODEL = "prefix-lm"
SIZES = dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6, vocab_size=8000, max_len=512, dropout=0.0)
TINY_SIZES = dict(d_model=64, n_heads=4, d_ff=128, n_layers=2, vocab_size=1000, max_len=512, dropout=0.0)
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


def build_model(directory: Path, tiny: bool) -> str:
    """A random-weight causal LM with a BPE trained on stdlib source; returns what it is."""
    sizes = TINY_SIZES if tiny else SIZES
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32, help="requests per burst")
    parser.add_argument("--prefix-tokens", type=int, default=384, help="tokens of the shared prefix")
    parser.add_argument("--suffix-tokens", type=int, default=16, help="tokens of each request's own suffix")
    parser.add_argument("--rounds", type=int, default=3, help="server pairs (off, on) started one after the other")
    parser.add_argument("--threads", type=int, default=2, help="server torch intra-op threads (TSERVE_THREADS)")
    parser.add_argument("--tiny", action="store_true", help="a toy model and short run (the test suite's smoke run)")
    args = parser.parse_args(argv)
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
    text = run(args)
    print(text)
    return text


if __name__ == "__main__":
    main()
