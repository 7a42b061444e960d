"""Intra-op threads: each model's worker thread has its own OpenMP pool, and all pools together fit the cores.

PyTorch's OpenMP runtime (libgomp) keeps a pool of threads per thread that ran a parallel region, for the life of
that thread. Once the pools hold more threads than there are cores, idle pool threads stop spinning almost at once
(libgomp throttles its busy-wait), so every parallel region pays a futex wake-up: on a 2-core machine a decoding
step of a small model took 4-5x longer in a worker thread with 2 intra-op threads than with 1, whenever another
pool existed (the main thread's from loading, or another model's worker). So the service keeps the main thread
serial (no pool) and gives each model worker its share of the cores.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")  # in a container: the container's own cgroup (cgroup namespace)


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2's ``cpu.max``, else v1's ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``): what a Kubernetes CPU limit sets; None when there is none or it cannot be read."""
    try:
        if (root / "cpu.max").is_file():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = root / "cpu"
        if (v1 / "cpu.cfs_quota_us").is_file():
            quota = int((v1 / "cpu.cfs_quota_us").read_text())
            return None if quota <= 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return None


def available_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on: its affinity, capped by its cgroup's CPU quota (rounded up), which a
    container sees as a limit although every core of the node is in its affinity."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root)
    return max(1, min(cores, math.ceil(limit))) if limit is not None else cores


def worker_threads(configured: int | None, workers: int, cgroup_root: Path = CGROUP_ROOT) -> int:
    """Intra-op threads per model worker: ``configured``, else the cores divided among ``workers`` (at least 1)."""
    return configured if configured is not None else max(1, available_cores(cgroup_root) // max(workers, 1))


def keep_serial() -> None:
    """Run this thread's torch ops without an OpenMP pool (the main thread of ``python -m service``: it loads the
    models, then only serves HTTP)."""
    torch.set_num_threads(1)


def use_threads(count: int) -> None:
    """Set the calling thread's intra-op threads (a model worker, before its first step)."""
    torch.set_num_threads(count)
