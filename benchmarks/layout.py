"""A/B of the input-major weight layout (model.layout): `python -m benchmarks.layout`.

The same random models of the peers' shape (benchmarks/peers.py: d_model 512, 6 layers, 8 heads,
ffn 2048, vocab 8000) run once with nn.Linear's row-major weights and once with
:func:`model.layout.use_input_major_weights`, alternating in rotating order; medians and the ratio
from the same run. Every pair is checked to give the same tokens (classifier: logits within 1e-4).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.common import machine_line, markdown_table
from benchmarks.peers import decoding_config, random_ids, random_models
from model.generation import generate_causal, generate_seq2seq
from model.layout import use_input_major_weights

Cell = tuple[str, int, Callable[[nn.Module], object]]  # name, items per run, run(model)


def cells(new_tokens: int) -> list[tuple[str, Cell]]:
    out: list[tuple[str, Cell]] = []
    for batch, beams in ((1, 1), (8, 1), (32, 1), (1, 4), (8, 4)):
        prompts, config = random_ids(batch, 16).tolist(), decoding_config(beams, new_tokens)
        run = lambda m, p=prompts, c=config: generate_causal(m, p, c)  # noqa: E731
        name = f"causal_lm {'greedy' if beams == 1 else 'beam 4'} b{batch}"
        out.append(("causal_lm", (name, batch * new_tokens, run)))
    for batch, beams in ((1, 1), (16, 1), (1, 4), (16, 4)):
        sources, config = random_ids(batch, 32).tolist(), decoding_config(beams, new_tokens)
        run = lambda m, s=sources, c=config: generate_seq2seq(m, s, c)  # noqa: E731
        name = f"seq2seq {'greedy' if beams == 1 else 'beam 4'} b{batch}"
        out.append(("seq2seq", (name, batch * new_tokens, run)))
    for batch in (1, 64):
        ids = random_ids(batch, 64)
        out.append(("classifier", (f"classifier b{batch} (seq/s)", batch, lambda m, i=ids: m(i))))
    return out


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return bool((a - b).abs().max() < 1e-4)
    return [[h.tokens for h in hs] for hs in a] == [[h.tokens for h in hs] for hs in b]


def measure(pairs: dict[str, tuple[nn.Module, nn.Module]], rounds: int, new_tokens: int) -> list[list[object]]:
    """One table row per cell: tokens (or sequences) per second of each layout and their ratio."""
    rows = []
    for family, (name, items, run) in cells(new_tokens):
        plain, relaid = pairs[family]
        assert same(run(plain), run(relaid)), f"{name}: the layouts disagree"
        times: dict[str, list[float]] = {"row": [], "input": []}
        for i in range(rounds):
            for key in ("row", "input") if i % 2 == 0 else ("input", "row"):
                start = time.perf_counter()
                run(plain if key == "row" else relaid)
                times[key].append(time.perf_counter() - start)
        row, inp = statistics.median(times["row"]), statistics.median(times["input"])
        rows.append([name, f"{items / row:,.0f}", f"{items / inp:,.0f}", f"{row / inp:.2f}x"])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per layout and cell")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per input")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    families = dict(zip(("causal_lm", "seq2seq", "classifier"), random_models(), strict=True))
    pairs = {family: (model, copy.deepcopy(model)) for family, model in families.items()}
    for _, relaid in pairs.values():
        use_input_major_weights(relaid)
    print(machine_line())
    with torch.inference_mode():
        rows = measure(pairs, args.rounds, args.new_tokens)
    print()
    print(markdown_table(["cell", "row-major /s", "input-major /s", "ratio"], rows))


if __name__ == "__main__":
    main()
