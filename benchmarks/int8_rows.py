"""The int8 GEMM at a few rows against its 1-row time: `python -m benchmarks.int8_rows [--threads 1 2]`.

Decoding at batch 1 (greedy: 1 row; beam 4: 4 rows) and small batches runs the int8 kernel (model/kernels/
int8_gemm.cpp) over every projection's weights once a step, read from memory: the floor (benchmarks/floor.py) counts
the same bytes whatever the row count, so a k-row product should take about its 1-row time. This times all the
decoder projections of a T5-base-sized model (12 layers: 6 x 768x768, gated 768 -> 2048 x 2, 2048 -> 768; ~99 MB of
int8, more than the L3 of most CPUs) at each row count, the row counts alternating round by round, and prints each
one's time against 1 row's and the read rate against a plain read of as many bytes (torch's sum, floor.py's probe).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import machine_line, markdown_table
from model.int8_kernel import available, huge_pages, pack

LAYER = [(768, 768)] * 6 + [(2048, 768)] * 2 + [(768, 2048)]  # (out, in): self q/k/v/o, cross q/o, wi_0/wi_1, wo
ROWS = [1, 2, 4, 8, 16]


def weights(layers: int) -> list[tuple[torch.Tensor, ...]]:
    """(packed, scales, sums, bias) of each projection, random int8, packed one after another in huge pages as a
    model's quantisation packs them (int8_kernel.huge_pages)."""
    g = torch.Generator().manual_seed(0)
    out = []
    with huge_pages():
        for n, k in LAYER * layers:
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            out.append((pack(q), torch.rand(n, generator=g) * 0.01 + 1e-3, q.sum(1, dtype=torch.int32), torch.randn(n)))
    return out


def measure(threads: int, rounds: int, layers: int) -> list[list[str]]:
    """Table rows: row count, min and median ms, x the 1-row min, GB/s against torch's sum of as many bytes."""
    kernel, why = available()
    if kernel is None:
        raise SystemExit(f"the int8 kernel does not run here: {why}")
    torch.set_num_threads(threads)
    ws = weights(layers)
    nbytes = sum(w[0].numel() for w in ws)
    xs = {r: {k: torch.randn(r, k) for k in (768, 2048)} for r in ROWS}

    def step(rows: int) -> float:
        start = time.perf_counter()
        for packed, scales, sums, bias in ws:
            kernel.int8_linear(xs[rows][packed.shape[1] * 4], packed, scales, sums, bias)
        return time.perf_counter() - start

    plain = torch.ones(nbytes // 4)
    times: dict[int, list[float]] = {r: [] for r in ROWS}
    reads = []
    for i in range(rounds):
        for r in ROWS[i % len(ROWS):] + ROWS[: i % len(ROWS)]:  # the order rotates each round
            times[r].append(step(r))
        start = time.perf_counter()
        plain.sum()
        reads.append(time.perf_counter() - start)
    one, read = min(times[1]), nbytes / min(reads) / 1e9
    table = []
    for r, t in times.items():
        rate = nbytes / min(t) / 1e9
        table.append([str(r), f"{min(t) * 1e3:.2f}", f"{statistics.median(t) * 1e3:.2f}", f"{min(t) / one:.2f}",
                      f"{rate:.1f} ({rate / read:.0%} of {read:.1f})"])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    for threads in args.threads:
        rows = measure(threads, args.rounds, args.layers)
        print(f"\n{machine_line()}; {args.layers} layers, {args.rounds} rounds")
        print(markdown_table(["rows", "min ms", "median ms", "x 1 row (min)", "GB/s (of torch.sum's)"], rows))


if __name__ == "__main__":
    main()
