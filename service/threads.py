"""Intra-op threads: each model's worker thread has its own OpenMP pool, and all pools together fit the cores.

PyTorch's OpenMP runtime (libgomp) keeps a pool of threads per thread that ran a parallel region, for the life of
that thread. Once the pools hold more threads than there are cores, idle pool threads stop spinning almost at once
(libgomp throttles its busy-wait), so every parallel region pays a futex wake-up: on a 2-core machine a decoding
step of a small model took 4-5x longer in a worker thread with 2 intra-op threads than with 1, whenever another
pool existed (the main thread's from loading, or another model's worker). So the service keeps the main thread
serial (no pool) and gives each model worker its share of the cores.
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_threads(configured: int | None, workers: int) -> int:
    """Intra-op threads per model worker: ``configured``, else the cores divided among ``workers`` (at least 1)."""
    return configured if configured is not None else max(1, available_cores() // max(workers, 1))


def keep_serial() -> None:
    """Run this thread's torch ops without an OpenMP pool (the main thread of ``python -m service``: it loads the
    models, then only serves HTTP)."""
    torch.set_num_threads(1)


def use_threads(count: int) -> None:
    """Set the calling thread's intra-op threads (a model worker, before its first step)."""
    torch.set_num_threads(count)
