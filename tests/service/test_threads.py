"""The cores a server counts (service/engine/threads.py): its affinity capped by its cgroup's CPU quota, read from files
laid out as cgroup v2 and v1 lay them out."""

from __future__ import annotations

import os

import pytest

from service.engine.threads import available_cores, cgroup_cpu_limit, worker_threads

AFFINITY = len(os.sched_getaffinity(0))


def write(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(("files", "limit"), [
    ({"cpu.max": "150000 100000\n"}, 1.5),  # v2: a Kubernetes limit of 1500m
    ({"cpu.max": "max 100000\n"}, None),  # v2: no limit
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1: no limit
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_the_cgroup_quota_is_read_in_cores(tmp_path, files, limit):
    assert cgroup_cpu_limit(write(tmp_path, files)) == limit


def test_a_quota_caps_the_cores_and_the_workers_threads(tmp_path):
    limited = write(tmp_path / "limited", {"cpu.max": "50000 100000\n"})  # half a core: one thread
    assert available_cores(limited) == 1 and worker_threads(None, 1, cgroup_root=limited) == 1
    unlimited = write(tmp_path / "unlimited", {"cpu.max": "max 100000\n"})
    assert available_cores(unlimited) == AFFINITY
    generous = write(tmp_path / "generous", {"cpu.max": f"{100000 * (AFFINITY + 8)} 100000\n"})
    assert available_cores(generous) == AFFINITY  # a quota above the affinity does not add cores
    assert worker_threads(3, 1, cgroup_root=limited) == 3  # a configured count wins
