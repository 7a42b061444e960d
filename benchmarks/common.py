"""Helpers shared by the benchmarks: timing, machine description, markdown tables."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from model.cpu import this_cpu


def run_times(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall times of ``repeats`` runs of ``fn`` after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` untimed runs."""
    return statistics.median(run_times(fn, repeats, warmup))


def machine_line() -> str:
    """One line naming the date, CPU, core count, torch version and thread count."""
    return (
        f"{time.strftime('%Y-%m-%d')} · {this_cpu().model_name} · {os.cpu_count()} cores · torch {torch.__version__} · "
        f"{torch.get_num_threads()} intra-op threads · python {platform.python_version()}"
    )


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
