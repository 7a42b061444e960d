"""scripts/gpu-check and its wheel list: in step with the pins, and a report written on a machine without a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# The GPU image's interpreter: markers of the dependencies are read as there.
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "extra": ""}  # fmt: skip


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> list[str]:
    """Non-comment, non-blank lines."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-r")]


def pins(*files: str) -> dict[str, str]:
    """name -> version of every ``name==version`` line."""
    return {normalize(name): version for f in files for name, version in
            (line.split("==", 1) for line in read_list(ROOT / f) if "==" in line)}  # fmt: skip


WHEELS = pins("scripts/gpu-wheels.txt")
IMAGE = {normalize(name) for name in read_list(SCRIPTS / "gpu-image-packages.txt")}


def needs(name: str) -> list[str]:
    """The installed distribution's requirements that apply on the GPU image (no extras)."""
    out = []
    for text in metadata.distribution(name).requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(GPU_PYTHON):
            out.append(normalize(req.name))
    return out


def test_every_carried_wheel_is_pinned_at_the_same_version():
    pinned = pins("requirements.txt", "requirements-dev.txt", "constraints.txt")
    assert WHEELS, "scripts/gpu-wheels.txt lists no wheel"
    assert {n: v for n, v in WHEELS.items() if pinned.get(n) != v} == {}, "not as pinned in requirements/constraints"


def test_every_runtime_dependency_the_gpu_image_lacks_is_carried():
    """From requirements.txt down through each need: a package not on the image is carried (and its needs
    followed); one on the image stops the walk. Every carried wheel is one of those or a carried one's need."""
    runtime = [normalize(line.split("==", 1)[0]) for line in read_list(ROOT / "requirements.txt")]
    missing, needed_by_carried, seen, todo = set(), set(), set(), list(runtime)
    while todo:
        name = todo.pop()
        if name in seen or name in IMAGE:
            continue
        seen.add(name)
        missing.add(name)
        for need in needs(name):
            needed_by_carried.add(need)
            todo.append(need)
    assert missing - set(WHEELS) == set(), "missing on the GPU image and not in scripts/gpu-wheels.txt"
    assert set(WHEELS) - missing - needed_by_carried == set(), "carried but not needed"


def test_cuda_tests_live_where_gpu_check_runs_them():
    """scripts/gpu-check runs ``pytest -m cuda tests/cuda``: a cuda test elsewhere would never run."""
    elsewhere = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                 if "mark.cuda" in p.read_text() and p.parent.name != "cuda" and p != Path(__file__)]  # fmt: skip
    assert elsewhere == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a GPU")
def test_gpu_check_without_a_gpu_reports_no_cuda_device(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),  # nothing installed, nothing downloaded
           "GPU_CHECK_PYTEST_ARGS": "tests/cuda/test_lora.py", "GPU_CHECK_BUDGET_S": "240"}  # fmt: skip
    run = subprocess.run([str(SCRIPTS / "gpu-check")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = tmp_path / "out" / "report"
    files = sorted(p.name for p in report.iterdir())
    assert {"summary.md", "env.txt", "pytest-cuda.log", "pytest-cuda.xml"} <= set(files)
    # what the device tool brings back from $OUT: at most 8 files, named in letters, digits, '.', '_', '-'
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    summary = (report / "summary.md").read_text()
    assert "no CUDA device" in summary and "**PASS**" in summary
    assert "| wheels | skipped |" in summary  # (another Python than the image's 3.12, or no wheels)
    assert re.search(r"\| cuda tests \| ok \| \d+ skipped; pytest exit 0", summary)
    assert "| benchmarks | skipped | no CUDA device here" in summary
    assert "## nvidia-smi" in (report / "env.txt").read_text()
    assert summary in run.stdout  # the device tool's output tail shows it
