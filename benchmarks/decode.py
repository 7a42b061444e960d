"""Decoding throughput of the model library: `python -m benchmarks.decode` (or `make bench-decode`).

Random weights on the issue's shape (d_model 512, 6 layers, 8 heads, ffn 2048, vocab 8000);
min_new_tokens = max_new_tokens so every run produces exactly the same number of tokens.
Prints a markdown table of tokens/s (new tokens over wall time, prefill included) and the
KV-cache speed-up ratio measured side by side in the same run.
"""

from __future__ import annotations

import argparse
import logging
from functools import partial

import torch

from benchmarks.common import machine_line, markdown_table, median_seconds
from model.causal_lm import CausalLM
from model.config import CausalLMConfig, Seq2SeqConfig
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.layout import use_input_major_weights
from model.seq2seq import Seq2SeqTransformer

SHAPE = dict(vocab_size=8000, d_model=512, n_heads=8, d_ff=2048, dropout=0.0, max_len=512)


def _inputs(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(7, SHAPE["vocab_size"], (batch, length), generator=g).tolist()


def _config(strategy: str, new_tokens: int, beams: int = 4) -> GenerationConfig:
    return GenerationConfig(
        strategy=strategy,
        num_beams=beams,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=SHAPE["vocab_size"] - 1,  # never reached: lengths stay fixed
    )


def run(args: argparse.Namespace) -> str:
    torch.manual_seed(0)
    lm = CausalLM(CausalLMConfig(**SHAPE, n_layers=6)).eval()
    s2s = Seq2SeqTransformer(Seq2SeqConfig(**SHAPE, n_encoder_layers=6, n_decoder_layers=6)).eval()
    for model in (lm, s2s):
        use_input_major_weights(model)  # the inference layout the service loads models in
    rows = []

    def measure(label: str, batch: int, fn, tokens: int, cache: str) -> float:
        seconds = median_seconds(fn, args.repeats)
        rate = batch * tokens / seconds
        rows.append([label, batch, tokens, cache, f"{seconds:.2f}", f"{rate:,.0f}"])
        logging.info("%s b%d %s: %.1f tok/s", label, batch, cache, rate)
        return rate

    n = args.new_tokens
    speedups = []
    greedy, beam, s2s_beam = _config("greedy", n), _config("beam", n), _config("beam", args.seq2seq_new_tokens)
    for batch in args.batches:
        prompts = _inputs(batch, args.prompt_len)
        cached = measure("causal_lm greedy", batch, partial(generate_causal, lm, prompts, greedy), n, "yes")
        if batch <= args.max_uncached_batch:
            uncached = partial(generate_causal, lm, prompts, greedy, use_cache=False)
            speedups.append((batch, cached / measure("causal_lm greedy", batch, uncached, n, "no")))
    for batch in args.beam_batches:
        prompts = _inputs(batch, args.prompt_len)
        measure("causal_lm beam 4", batch, partial(generate_causal, lm, prompts, beam), n, "yes")
        if batch <= args.max_uncached_batch:
            uncached = partial(generate_causal, lm, prompts, beam, use_cache=False)
            measure("causal_lm beam 4", batch, uncached, n, "no")
    for batch in args.seq2seq_batches:
        sources = _inputs(batch, args.source_len)
        run_s2s = partial(generate_seq2seq, s2s, sources, s2s_beam)
        measure("seq2seq beam 4", batch, run_s2s, args.seq2seq_new_tokens, "yes")

    lines = [
        f"Machine: {machine_line()}",
        f"Config: d_model 512, 6 layers, 8 heads, ffn 2048, vocab 8000, fp32, prompt {args.prompt_len} tokens, "
        f"source {args.source_len} tokens, median of {args.repeats} runs after 1 warm-up",
        "",
        markdown_table(["decode", "batch", "new tokens", "KV cache", "seconds", "tokens/s"], rows),
        "",
    ]
    lines += [f"KV cache speed-up, greedy batch {b}: {ratio:.1f}x" for b, ratio in speedups]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--source-len", type=int, default=32)
    parser.add_argument("--seq2seq-new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--beam-batches", type=int, nargs="+", default=[1])
    parser.add_argument("--seq2seq-batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-uncached-batch", type=int, default=8, help="skip recomputation above this batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(run(args))


if __name__ == "__main__":
    main()
