"""Speculative decoding at batch 1: `python -m benchmarks.speculative [--models DIR] [--new-tokens 64]
[--prompts 16] [--num-tokens 4] [--threads 2] [--draft-model NAME] [--quantize SPEC] [--tiny]`.

Two workloads, each request alone (batch 1) through the engine in this process (service.engine.worker, its scheduler
thread): **code**, completions of windows of Python's standard library source by the models directory's causal
LM (default `code`), and **translation**, copy-heavy messages (paths, placeholders, options, numbers) by its
seq2seq model (default `translation`). Greedy, exactly ``--new-tokens`` per request where the model allows
(``min_new_tokens``; a translation ends at its EOS); every request runs plain and with
``"speculative": {"method": "ngram", "num_tokens": K}`` (with ``--draft-model NAME``, the code workload drafts
with that model of the models directory instead: ``"method": "draft_model"``), alternating which goes first, and
both outputs must be equal (the harness raises otherwise). Reported per workload: generated tokens per second
plain and speculative over all requests, their ratio, the acceptance rate (accepted / drafted draft tokens, from
the engine's counters) and the tokens per model step of the speculative
runs. ``--models`` defaults to `checkpoints/models` (`make train-quick`); ``--tiny`` builds a random-weight causal
LM instead, and a smaller one with its tokenizer, `code-draft` (code only: the suite's smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import machine_line, markdown_table
from benchmarks.serve_setup import stdlib_texts
from model.causal_lm import CausalLM
from model.checkpoint import save_checkpoint
from model.config import CausalLMConfig
from model.tokenizer import Tokenizer

logger = logging.getLogger("benchmarks.speculative")

MESSAGES = [
    "Could not open '/etc/tserve/config.yaml': permission denied (errno 13)",
    "Cannot read file %s: %s",
    "Use --force to overwrite /var/lib/app/data.db, or --backup to keep a copy",
    "Downloaded 1024 of 4096 bytes from https://example.org/files/archive.tar.gz",
    "Invalid value '%(value)s' for option --max-size (expected 1-%(max)d)",
    "The directory /home/user/projects/demo does not exist",
    "Run 'make install PREFIX=/usr/local' to install version 2.4.1",
    "File %s is %d bytes; the limit is %d bytes",
    "Connection to db.example.com:5432 failed after 3 retries",
    "Set TSERVE_API_KEYS to enable authentication on port 8000",
    "Error in line 42 of main.py: unexpected token ')'",
    "Copied 15 files from /mnt/usb to /home/user/backup in 2.5 s",
    "Package libfoo-dev (>= 1.2.3) is required by bar 0.9",
    "Press Ctrl+C to stop the server at http://127.0.0.1:8080/",
    "Could not resolve host: mirrors.example.net",
    "The option --output %s conflicts with --stdout",
]


@dataclass
class Workload:
    name: str
    model: str
    prompts: list[str]
    force_length: bool  # min_new_tokens = max_new_tokens (code); a translation ends at its EOS
    method: str = "ngram"
    plain_s: float = 0.0
    speculative_s: float = 0.0
    tokens: int = 0
    steps: int = 0  # model steps of the speculative runs (each verifies a draft or decodes one token)
    drafted: float = 0.0
    accepted: float = 0.0


def code_prompts(tokenizer: Tokenizer, count: int, max_tokens: int, seed: int) -> list[str]:
    """Windows of stdlib source ending at a line break, each within ``max_tokens`` tokens."""
    rng, texts, prompts = random.Random(seed), [t for t in stdlib_texts() if len(t) > 4000], []
    while len(prompts) < count:
        text = rng.choice(texts)
        start = text.find("\n", rng.randrange(len(text) - 3000)) + 1
        window = text[start:start + 2000]
        ids = tokenizer.encode(window)[:max_tokens]
        prompt = tokenizer.decode(ids)
        prompt = prompt[: prompt.rfind("\n") + 1] or prompt
        if prompt.strip():
            prompts.append(prompt)
    return prompts


def build_tiny(directory: Path) -> None:
    """A random-weight causal LM ("code") with a BPE over some stdlib source, and a smaller one ("code-draft")."""
    tokenizer = Tokenizer.train(stdlib_texts(200_000), vocab_size=1000)
    torch.manual_seed(0)
    for name, width, layers in (("code", 64, 2), ("code-draft", 32, 1)):
        model = CausalLM(CausalLMConfig(vocab_size=tokenizer.vocab_size, d_model=width, n_heads=4, d_ff=2 * width,
                                        n_layers=layers, max_len=256, dropout=0.0)).eval()
        save_checkpoint(directory / name, model, tokenizer)


async def run_workload(engine, workload: Workload, new_tokens: int, num_tokens: int) -> None:
    from service.api.convert import generation_request
    from service.api.schemas import GenerateRequest

    worker = engine.get(workload.model)
    metric = engine.metrics.registry.get_sample_value
    labels = {"model": workload.model}
    for i, prompt in enumerate(workload.prompts):
        room = min(new_tokens, worker.max_new_tokens)
        fields = dict(inputs=[prompt], max_new_tokens=room, min_new_tokens=room if workload.force_length else 0)
        plain = generation_request(GenerateRequest(**fields))
        fast = generation_request(GenerateRequest(**fields, speculative={"method": workload.method,
                                                                          "num_tokens": num_tokens}))
        outputs = {}
        for kind in (("plain", "fast") if i % 2 == 0 else ("fast", "plain")):
            before = (metric("tserve_spec_decode_draft_tokens_total", labels) or 0.0,
                      metric("tserve_spec_decode_accepted_tokens_total", labels) or 0.0,
                      metric("tserve_batch_size_count", labels) or 0.0)
            start = time.perf_counter()
            request = plain if kind == "plain" else fast
            outputs[kind] = (await worker.generate(request, f"{workload.name}-{i}-{kind}"))[0]
            seconds = time.perf_counter() - start
            if kind == "plain":
                workload.plain_s += seconds
            else:
                workload.speculative_s += seconds
                workload.drafted += (metric("tserve_spec_decode_draft_tokens_total", labels) or 0.0) - before[0]
                workload.accepted += (metric("tserve_spec_decode_accepted_tokens_total", labels) or 0.0) - before[1]
                workload.steps += int((metric("tserve_batch_size_count", labels) or 0.0) - before[2])
        if outputs["plain"].tokens != outputs["fast"].tokens:
            raise RuntimeError(f"{workload.name} prompt {i}: speculative tokens differ from plain greedy")
        workload.tokens += len(outputs["plain"].tokens)


def run(args: argparse.Namespace) -> str:
    from model.checkpoint import load_checkpoint
    from service.engine.engine import Engine
    from service.engine.threads import keep_serial
    from service.engine.types import EngineSettings

    keep_serial()  # as python -m service: the engine's worker thread alone has an OpenMP pool (service.engine.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-speculative-")) if args.tiny else None
    try:
        models = Path(args.models) if work is None else work
        if work is not None:
            build_tiny(work)
        if not (models / args.code).is_dir():
            raise SystemExit(f"no model {args.code!r} in {models}: run `make train-quick` or pass --models DIR")
        code = load_checkpoint(models / args.code, device="cpu")
        max_prompt = code.config.max_len - min(args.new_tokens, code.config.max_len // 2) - 2
        workloads = [Workload("code", args.code, code_prompts(code.tokenizer, args.prompts, max_prompt, args.seed),
                              force_length=True, method="draft_model" if args.draft_model else "ngram")]
        if not args.tiny and (models / args.translation).is_dir():
            workloads.append(Workload("translation", args.translation, MESSAGES[: args.prompts], force_length=False))
        loop = asyncio.new_event_loop()
        settings = EngineSettings(device="cpu", dtype="float32", prefix_cache_mb=0, threads=args.threads,
                                  draft_model=f"{args.code}={args.draft_model}" if args.draft_model else "",
                                  quantize=args.quantize)
        engine = Engine(settings, models, None)
        loop.run_until_complete(engine.start())
        try:
            for workload in workloads:
                loop.run_until_complete(run_workload(engine, workload, args.new_tokens, args.num_tokens))
        finally:
            loop.run_until_complete(engine.stop(5.0))
            loop.close()
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return report(args, workloads)


def report(args: argparse.Namespace, workloads: list[Workload]) -> str:
    rows = []
    for w in workloads:
        plain, fast = w.tokens / w.plain_s, w.tokens / w.speculative_s
        rows.append([w.name, w.model, w.method, len(w.prompts), w.tokens, f"{plain:,.0f}", f"{fast:,.0f}",
                     f"{fast / plain:.2f}x",
                     f"{w.accepted / w.drafted:.0%}" if w.drafted else "-", f"{w.tokens / max(w.steps, 1):.2f}"])
    table = markdown_table(["workload", "model", "drafts", "requests", "tokens", "plain tok/s", "speculative tok/s",
                            "speed-up", "acceptance", "tokens / step"], rows)
    return "\n".join([
        f"Machine: {machine_line()}",
        f"Engine in this process, batch 1, greedy, code: exactly {args.new_tokens} new tokens (or the model's room), "
        f"translation: up to {args.new_tokens} (its EOS ends it); drafts of {args.num_tokens} tokens"
        f"{f' (code: by the draft model {args.draft_model!r})' if args.draft_model else ''}; "
        f"intra-op threads per model worker: {args.threads or 'the default (cores / models)'}, the main thread "
        "serial as in python -m service; prefix cache off; plain and speculative "
        "alternate per request and give equal tokens",
        "",
        table,
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="checkpoints/models", help="models directory (default: make's)")
    parser.add_argument("--code", default="code", help="the causal LM to complete code with")
    parser.add_argument("--translation", default="translation", help="the seq2seq model (skipped if absent)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16, help="requests per workload")
    parser.add_argument("--num-tokens", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads per model worker (default: the cores divided among the models)")
    parser.add_argument("--draft-model", default=None,
                        help="a smaller causal LM of the models directory (same tokenizer) drafting for --code")
    parser.add_argument("--quantize", default="none",
                        help="the engine's quantize setting, e.g. none,code-int8=int8 (a model's int8 copy as a draft)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a random toy causal LM, code only, few requests")
    args = parser.parse_args(argv)
    if args.tiny:
        args.prompts, args.new_tokens = min(args.prompts, 3), min(args.new_tokens, 16)
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    text = run(args)
    print(text)
    return text


if __name__ == "__main__":
    main()
