"""Training killed with SIGKILL in the middle of a save, at each dangerous point in turn: the previous
best checkpoint and resume state stay intact and loadable, and resuming after every kill ends with the
losses of an uninterrupted run (bit for bit, to 1e-6)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint, old_sibling
from tests.reliability.kill_points import __name__ as KILL_POINTS
from tests.service.conftest import CLS, LM, ask, running_engine
from tests.training.conftest import log_rows, run_cli, train_args, write_text
from training.state import StateStore, state_dir_for

REPO = Path(__file__).resolve().parents[2]
STEPS = 14
FLAGS = ("--max-steps", str(STEPS), "--save-every", "1", "--eval-every", "1", "--dropout", "0.1")
# In order, each run resuming from the state the previous kill left; @N: the N-th time in that run.
POINTS = ["checkpoint-swap@2", "state-files@3", "state-pointer@3", "checkpoint-cleanup@3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("kill-data")
    return {"lm_train": write_text(d / "train.txt", 300, 5), "lm_valid": write_text(d / "valid.txt", 30, 6)}


def _kill_at(point: str, argv: list[str], marker: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", KILL_POINTS, point, str(marker), "--", "--log-level", "WARNING", *argv]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"{point}: the run ended ({proc.returncode}) before the kill point: "
                f"{proc.stderr.read().decode()[-2000:]}"
            )
        assert time.monotonic() < deadline, f"{point} not reached"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sigkill_mid_save_keeps_the_previous_checkpoint_and_resume_continues(data, tmp_path):
    reference = tmp_path / "reference"
    run_cli(*train_args("causal_lm", data, reference, *FLAGS))
    expected = [float(r["loss"]) for r in log_rows(state_dir_for(reference))]

    out = tmp_path / "killed"
    argv = train_args("causal_lm", data, out, *FLAGS)
    for i, point in enumerate(POINTS):
        _kill_at(point, argv + (["--resume"] if i else []), tmp_path / f"{i}.reached")
        state = StateStore(state_dir_for(out)).load()  # the resume state: complete and loadable
        assert state is not None and 0 < state.meta["step"] < STEPS, point
        checkpoint = load_checkpoint(out, device="cpu")  # the best checkpoint: complete and loadable
        best = checkpoint.metrics["best_step"]
        assert best <= state.meta["step"] + 1, (point, best, state.meta["step"])
        if point.startswith("checkpoint-swap"):  # caught between the renames: the previous checkpoint is the .old one
            assert not out.exists() and old_sibling(out).is_dir()
        print(f"FIGURE kill_{point}=state step {state.meta['step']}, checkpoint best_step {best}")
    run_cli(*argv, "--resume")
    got = [float(r["loss"]) for r in log_rows(state_dir_for(out))]
    assert got == pytest.approx(expected, abs=1e-6, rel=0)
    final, uninterrupted = load_checkpoint(out, device="cpu"), load_checkpoint(reference, device="cpu")
    assert final.metrics["best_step"] == uninterrupted.metrics["best_step"]
    for name, tensor in _weights(uninterrupted.model).items():
        torch.testing.assert_close(_weights(final.model)[name], tensor, atol=1e-6, rtol=0)
    assert not old_sibling(out).exists()


def test_the_service_serves_a_checkpoint_caught_between_renames(models_dir, tmp_path):
    """A models directory where training was killed mid-swap still serves that model, under its name."""
    root = tmp_path / "models"
    shutil.copytree(models_dir / LM, old_sibling(root / LM))  # what the checkpoint-swap kill leaves
    shutil.copytree(models_dir / CLS, root / CLS)

    async def main() -> list:
        async with running_engine(root, None) as engine:
            assert [m.name for m in engine.models()] == [CLS, LM] and not engine.load_errors
            return await engine.get(LM).generate(ask("hello", max_new_tokens=4), "after-kill")

    assert len(asyncio.run(main())) == 1
