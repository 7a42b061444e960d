"""Multi-turn chat and the prefix cache: `python -m benchmarks.chat_turns [--conversations K] [--turns T]
[--user-words N] [--reply-tokens N] [--threads N] [--compare-off] [--tiny] [--url URL --model NAME]`.

K conversations of T turns each go through ``POST /v1/chat/completions``, as chat clients send them: every turn
resends the whole conversation so far (the system prompt the template adds, each earlier user message and the
assistant's reply to it) plus a new user message. The K conversations run side by side in lockstep: turn t of
every conversation is sent at once (a burst of K streamed requests), turn t + 1 when all K have answered. Each
user message is ``--user-words`` consecutive alphabetic words of Python's standard library source from a seeded
place; each reply is exactly ``--reply-tokens`` tokens (``min_tokens`` = ``max_tokens``), sampled at temperature 1
with a seed per conversation and turn: the random weights' greedy choice repeats one token (a newline, which the
route trims from content), while sampled replies are text that the next turn resends, as a real model's are. (Most
sampled tokens are the shape tokenizer's filler tokens, which no merge builds: resent, a reply is ~5x its generated
length in tokens, so prompts grow faster than with a trained model, and the previous prompt's share is lower.)

The model: benchmarks/shapes.py's random-weight smollm2-135m directory (``--tiny``: its toy size, the test's),
served under the name ``smollm2-135m`` with SmolLM2-Instruct's ChatML template added here (:func:`chat_directory`:
the template in tokenizer_config.json, ``<|im_start|>`` and ``<|im_end|>`` as special tokens in place of two
filler ids), by benchmarks/open_loop.py's ``server_url`` (``python -m service`` on 127.0.0.1); ``--url`` measures a
running server's ``--model`` instead.

Reported per turn: the mean prompt tokens (the response's ``usage``), the previous turn's prompt tokens over this
prompt's (the part of this prompt that the cache can hold: tserve's prefix cache keeps prompts' blocks of 16 tokens,
not generated tokens, so the previous reply and the new message are computed again), the share the server's prefix
cache found (``tserve_prefix_cache_hits_total`` / ``tserve_prefix_cache_queries_total`` over the turn, in tokens)
and time to first token (from sending to the first chunk, which the route sends with the first token) p50 / max over
the K requests. ``--compare-off`` measures the same conversations again on a server with the prefix cache off
(``TSERVE_PREFIX_CACHE_MB=0``) and adds its TTFT, and says whether the seeded replies were the same on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import machine_line, markdown_table
from benchmarks.open_loop import server_url
from benchmarks.open_loop_load import model_counters, source_words
from benchmarks.shapes import DEFAULT_CACHE, build

logger = logging.getLogger("benchmarks.chat_turns")

SHAPE = "smollm2-135m"
# HuggingFaceTB/SmolLM2-135M-Instruct's chat template (ChatML, with its default system prompt).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


# ---- the model: the shape's directory with a chat template ----------------------------------------


def chat_directory(hf: Path, out: Path) -> Path:
    """``out``: the HF directory ``hf`` (its files linked) with ChatML: :data:`CHAT_TOKENS` as special tokens in
    place of the two filler tokens just below <|endoftext|> (the last id; the model's vocabulary keeps its size, as
    SmolLM2's holds them among its first ids) and :data:`CHATML` as tokenizer_config.json's chat_template."""
    out.mkdir(parents=True)
    for path in hf.iterdir():
        if path.name not in ("tokenizer.json", "tokenizer_config.json"):
            (out / path.name).symlink_to(path.resolve())
    tokenizer = json.loads((hf / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: token for token, i in vocab.items()}
    last = max(by_id)
    added = []
    for token, i in zip(CHAT_TOKENS, (last - 2, last - 1), strict=True):
        del vocab[by_id[i]]
        vocab[token] = i
        added.append({"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    tokenizer["added_tokens"] = sorted([*tokenizer.get("added_tokens", []), *added], key=lambda t: t["id"])
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((hf / "tokenizer_config.json").read_text())
    decoder = config.setdefault("added_tokens_decoder", {})
    for token in added:
        decoder[str(token["id"])] = {k: v for k, v in token.items() if k != "id"}
    config["additional_special_tokens"] = list(CHAT_TOKENS)
    config["chat_template"] = CHATML
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


# ---- the conversations --------------------------------------------------------------------------


def user_messages(conversations: int, turns: int, words_per_message: int, seed: int,
                  words: Sequence[str]) -> list[list[str]]:
    """[conversation][turn] -> its user message: ``words_per_message`` consecutive ``words`` from a seeded place."""
    places = random.Random(f"chat-turns-{seed}")
    out = []
    for _ in range(conversations):
        starts = [places.randrange(len(words) - words_per_message) for _ in range(turns)]
        out.append([" ".join(words[s:s + words_per_message]) for s in starts])
    return out


@dataclass
class Reply:
    """What the client saw of one turn of one conversation."""

    text: str = ""
    ttft_s: float | None = None  # from sending to the first chunk (the route sends it with the first token)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


def chat_body(model: str, messages: list[dict], reply_tokens: int, seed: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": reply_tokens, "min_tokens": reply_tokens,
            "temperature": 1.0, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}


async def send_turn(client: httpx.AsyncClient, body: dict) -> Reply:
    """POST one streamed chat completion and read its chunks: text, first-token time, usage."""
    reply = Reply()
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                reply.error = f"{response.status_code} {(await response.aread()).decode(errors='replace')[:300]}"
                return reply
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    reply.error = f"{chunk['error'].get('code')}: {chunk['error'].get('message')}"
                    return reply
                for choice in chunk.get("choices") or []:
                    if reply.ttft_s is None:
                        reply.ttft_s = time.perf_counter() - sent
                    reply.text += (choice.get("delta") or {}).get("content") or ""
                if chunk.get("usage"):
                    reply.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    reply.completion_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError) as exc:
        reply.error = f"{type(exc).__name__}: {exc}"
    return reply


@dataclass
class TurnResult:
    turn: int  # 1-based
    replies: list[Reply]
    hits: float  # prefix-cache tokens found over the turn (all K requests)
    queries: float  # prefix-cache tokens looked up over the turn

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    @property
    def ttfts_s(self) -> list[float]:
        return [r.ttft_s for r in self.replies if r.ttft_s is not None]

    @property
    def prompt_tokens(self) -> float:
        return statistics.fmean(r.prompt_tokens for r in self.replies)


@dataclass
class RunResult:
    label: str  # the server's prefix-cache setting
    turns: list[TurnResult] = field(default_factory=list)

    def texts(self) -> list[list[str]]:
        """[turn][conversation] -> the reply's text."""
        return [[r.text for r in t.replies] for t in self.turns]


async def converse(url: str, model: str, messages: list[list[str]], reply_tokens: int, seed: int,
                   label: str) -> RunResult:
    """Every conversation's turns in lockstep; the server's prefix-cache counters read around each turn."""
    history: list[list[dict]] = [[] for _ in messages]
    result = RunResult(label)
    limits = httpx.Limits(max_connections=len(messages) + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for turn in range(len(messages[0])):
            for conversation, said in zip(history, messages, strict=True):
                conversation.append({"role": "user", "content": said[turn]})
            _, hits_before, queries_before = await model_counters(client, model)
            replies = await asyncio.gather(*(
                send_turn(client, chat_body(model, list(c), reply_tokens, seed + 1000 * i + turn))
                for i, c in enumerate(history)))
            _, hits, queries = await model_counters(client, model)
            failed = [r.error for r in replies if r.error]
            if failed:
                raise SystemExit(f"turn {turn + 1}: {len(failed)} of {len(replies)} requests failed, the first: "
                                 f"{failed[0]}")
            for conversation, reply in zip(history, replies, strict=True):
                conversation.append({"role": "assistant", "content": reply.text})
            result.turns.append(TurnResult(turn + 1, replies, hits - hits_before, queries - queries_before))
            logger.info("%s: turn %d: %.0f prompt tokens, prefix hit %s", label, turn + 1,
                        result.turns[-1].prompt_tokens, _share(result.turns[-1].hit_rate))
    return result


# ---- the report -------------------------------------------------------------------------------------


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(values: Sequence[float]) -> str:
    return f"{statistics.median(values) * 1000:,.0f} / {max(values) * 1000:,.0f}" if values else "-"


def previous_share(previous: TurnResult | None, turn: TurnResult) -> float | None:
    """Of this turn's prompt tokens, the share the previous turn's prompts make up (over the conversations)."""
    if previous is None:
        return None
    return sum(p.prompt_tokens for p in previous.replies) / sum(r.prompt_tokens for r in turn.replies)


def report_table(on: RunResult, off: RunResult | None) -> str:
    headers = ["turn", "prompt tok (mean)", "previous prompt's share", "prefix hit", "TTFT p50 / max ms (cache on)"]
    if off is not None:
        headers.append("TTFT p50 / max ms (cache off)")
    rows = []
    for i, turn in enumerate(on.turns):
        row = [turn.turn, f"{turn.prompt_tokens:.0f}", _share(previous_share(on.turns[i - 1] if i else None, turn)),
               _share(turn.hit_rate), _ms(turn.ttfts_s)]
        if off is not None:
            row.append(_ms(off.turns[i].ttfts_s))
        rows.append(row)
    return markdown_table(headers, rows)


@dataclass
class Report:
    description: list[str]
    on: RunResult
    off: RunResult | None

    def text(self) -> str:
        return "\n".join([*self.description, "", report_table(self.on, self.off)])


# ---- the run ----------------------------------------------------------------------------------------


def serve_args(args: argparse.Namespace, models: Path | None, prefix_cache_mb: float | None) -> argparse.Namespace:
    """benchmarks/open_loop.py's server options: ``models`` served here (or ``--url``)."""
    return argparse.Namespace(url=args.url, models=str(models) if models else None, shape=None, threads=args.threads,
                              quantize=None, prefix_cache_mb=prefix_cache_mb)


def measure(args: argparse.Namespace, models: Path | None, prefix_cache_mb: float | None, label: str,
            messages: list[list[str]]) -> RunResult:
    with server_url(serve_args(args, models, prefix_cache_mb)) as (url, _, _):
        return asyncio.run(converse(url, args.model, messages, args.reply_tokens, args.seed, label))


def run(args: argparse.Namespace) -> Report:
    messages = user_messages(args.conversations, args.turns, args.user_words, args.seed, source_words())
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-chat-turns-"))
    try:
        models = None
        if not args.url:
            models = work / "models"
            chat_directory(build(SHAPE, args.cache, args.tiny).hf, models / args.model)
        on = measure(args, models, None, "cache on", messages)
        off = measure(args, models, 0, "cache off", messages) if args.compare_off else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = " at toy sizes (--tiny)" if args.tiny else ""
    off_too = " (then another with it off: TSERVE_PREFIX_CACHE_MB=0)" if args.compare_off else ""
    server = (args.url if args.url else f"python -m service on 127.0.0.1 (service/local_server.py), "
              f"TSERVE_THREADS={args.threads}, prefix cache at its default size{off_too}")
    description = [
        f"Machine: {machine_line()} (the client's process)",
        f"Load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())} after",
        f"Model: {args.model!r}" + ("" if args.url else f", benchmarks/shapes.py's {SHAPE} shape{size} (random "
                                    "weights, HF layout, fp32) with SmolLM2-Instruct's ChatML template"),
        f"Server: {server}",
        f"Load: {args.conversations} conversations x {args.turns} turns in lockstep (turn t of all sent at once), "
        f"user messages of {args.user_words} stdlib words (seed {args.seed}), replies of exactly "
        f"{args.reply_tokens} tokens (sampled, temperature 1, seeded), the whole conversation resent every turn, "
        "streamed",
        "Columns: prompt tok = usage.prompt_tokens; previous prompt's share = previous turn's prompt tokens / this "
        "prompt's (what a cache of prompts can find); prefix hit = the server's prefix-cache hits / queries (tokens) "
        "over the turn; TTFT = sending to the first chunk, over the turn's requests",
    ]
    if off is not None:
        same = sum(a == b for t_on, t_off in zip(on.texts(), off.texts(), strict=True)
                   for a, b in zip(t_on, t_off, strict=True))
        description.append(f"Replies the same with the cache on and off: {same} of "
                           f"{args.conversations * args.turns}")
    return Report(description, on, off)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4, help="K conversations, side by side")
    parser.add_argument("--turns", type=int, default=6, help="T turns each")
    parser.add_argument("--user-words", type=int, default=24, help="words of each user message")
    parser.add_argument("--reply-tokens", type=int, default=32, help="tokens of each reply")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="server torch intra-op threads (TSERVE_THREADS)")
    parser.add_argument("--compare-off", action="store_true",
                        help="measure the same conversations again with the prefix cache off")
    parser.add_argument("--tiny", action="store_true", help="the shape at toy sizes (the test's)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help="where benchmarks/shapes.py keeps the shape's files between runs (default %(default)s)")
    parser.add_argument("--url", help="measure a running server instead of starting one (with --model)")
    parser.add_argument("--model", default=SHAPE, help="the chat model's name (default %(default)s)")
    args = parser.parse_args(argv)
    for name in ("conversations", "turns", "user_words", "reply_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.url and args.compare_off:
        parser.error("--compare-off starts its own servers: not with --url")
    return args


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(args)
    print(report.text())
    return report


if __name__ == "__main__":
    main()
