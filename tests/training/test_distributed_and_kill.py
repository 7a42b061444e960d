"""Subprocess runs: 2-process torchrun (gloo) stays in sync; a SIGKILLed run resumes with identical losses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.checkpoint import load_checkpoint
from tests.training.conftest import log_rows, run_cli, train_args
from training.state import LATEST, StateStore, state_dir_for

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def test_two_process_torchrun_stays_in_sync(data, tmp_path):
    out, digests = tmp_path / "ckpt", tmp_path / "digests"
    # `train` in each process; then each rank writes the digest of the parameters it trained.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "tests.training.digest_train", str(digests), *train_args("classifier", data, out, "--max-steps", "6"),
           "--eval-every", "3", "--save-every", "3"]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]

    hashes = {p.name: p.read_text() for p in digests.iterdir()}
    assert sorted(hashes) == ["rank0.sha256", "rank1.sha256"]
    assert hashes["rank0.sha256"] == hashes["rank1.sha256"]  # DDP kept the replicas identical
    state = StateStore(state_dir_for(out)).load()
    assert state.meta["world_size"] == 2 and len(state.meta["rng"]) == 2
    assert state.meta["rng"][0]["torch"] != state.meta["rng"][1]["torch"]  # per-rank dropout streams
    assert [int(r["step"]) for r in log_rows(state_dir_for(out))] == list(range(1, 7))  # rank 0 logs alone
    ckpt = load_checkpoint(out, device="cpu")
    assert ckpt.labels == ["animal", "thing"]


def test_sigkill_then_resume_matches_uninterrupted(data, tmp_path):
    steps, flags = 40, ("--save-every", "1", "--eval-every", "1000", "--dropout", "0.1")
    reference = tmp_path / "reference"
    run_cli(*train_args("causal_lm", data, reference, "--max-steps", str(steps), *flags))

    out = tmp_path / "killed"
    argv = train_args("causal_lm", data, out, "--max-steps", str(steps), *flags)
    proc = subprocess.Popen([sys.executable, "-m", "training", "--log-level", "WARNING", *argv], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    pointer = state_dir_for(out) / LATEST
    deadline = time.monotonic() + 120
    while not (pointer.exists() and pointer.read_text().strip() >= "step-00000005") and proc.poll() is None:
        assert time.monotonic() < deadline, "no state written"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # most likely mid-step or mid-save: it saves every step
    proc.wait()
    if proc.returncode == 0:
        pytest.skip("the run finished before it could be killed")
    killed_at = StateStore(state_dir_for(out)).load().meta["step"]
    assert killed_at < steps

    run_cli(*argv, "--resume")
    expected = [float(r["loss"]) for r in log_rows(state_dir_for(reference))]
    got = [float(r["loss"]) for r in log_rows(state_dir_for(out))]
    assert got == pytest.approx(expected, abs=1e-6, rel=0)
