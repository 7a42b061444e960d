"""Progress without a terminal: a training run whose stderr is a pipe logs progress lines (no bar)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.conftest import train_args
from training.progress import ProgressDisplay, clock_text

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"ckpt: step (\d+)/4 \(\d+%\), loss \d+\.\d{4}, \d+ tokens/s, ETA \d+:\d\d$")


def test_a_run_with_stderr_in_a_pipe_logs_progress_lines(data, tmp_path):
    argv = [a for a in train_args("causal_lm", data, tmp_path / "ckpt", "--max-steps", "4") if a != "--quiet"]
    result = subprocess.run([sys.executable, "-m", "training", *argv], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [int(m[1]) for line in result.stderr.splitlines() if (m := LINE.search(line))]
    assert steps[0] == 1 and steps[-1] == 4  # the first and the last step at least, in order
    assert steps == sorted(set(steps))
    assert "\r" not in result.stderr  # no bar


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "training.progress"]


def test_lines_come_at_the_first_and_last_step_and_every_interval(caplog):
    now = [0.0]
    with caplog.at_level(logging.INFO, logger="training.progress"):
        display = ProgressDisplay(0, 10, bar=False, lines=True, name="run", interval_s=30, clock=lambda: now[0])
        for step in range(1, 11):
            now[0] = 10.0 * step  # 10 s a step
            display.update(step, loss=2.0, tokens_per_s=100.0, last=step == 10)
    lines = _lines(caplog)
    assert [int(line.split()[2].split("/")[0]) for line in lines] == [1, 4, 7, 10]
    assert lines[1] == "run: step 4/10 (40%), loss 2.0000, 100 tokens/s, ETA 1:00"  # 6 steps at 10 s


def test_a_recipe_phase_shows_its_fixed_total_and_an_eta_from_the_measured_pace(caplog):
    now = [0.0]
    with caplog.at_level(logging.INFO, logger="training.progress"):
        display = ProgressDisplay(0, 1100, bar=False, lines=True, name="translation", clock=lambda: now[0])
        now[0] = 55.0  # 55 steps in 55 s: 1,045 left at 1 s each
        display.update(55, loss=3.5, tokens_per_s=6000.0)
    assert _lines(caplog) == ["translation: step 55/1100 (5%), loss 3.5000, 6000 tokens/s, ETA 17:25"]


def test_the_eta_is_capped_by_the_deadline_and_resumed_runs_count_their_own_pace(caplog):
    now = [100.0]
    with caplog.at_level(logging.INFO, logger="training.progress"):
        display = ProgressDisplay(50, 100, bar=False, lines=True, deadline=210.0, clock=lambda: now[0])
        now[0] = 102.0  # the first step of this invocation (51) took 2 s: 49 steps left at that pace
        display.update(51, loss=1.0, tokens_per_s=10.0)
        assert _lines(caplog)[-1].endswith("ETA 1:38")
        now[0] = 200.0  # 25 steps in 100 s: 25 left would take 100 s, but the deadline comes in 10
        display.update(75, loss=1.0, tokens_per_s=10.0, last=True)
        assert _lines(caplog)[-1].endswith("ETA 0:10")


def test_no_lines_with_the_bar_or_off_rank_zero(caplog):
    with caplog.at_level(logging.INFO, logger="training.progress"):
        for bar, lines in ((True, True), (False, False)):
            with ProgressDisplay(0, 2, bar=bar, lines=lines) as display:
                display.update(1, 1.0, 1.0)
                display.update(2, 1.0, 1.0, last=True)
    assert _lines(caplog) == []


def test_clock_text():
    assert [clock_text(s) for s in (0, 59.9, 61, 3599, 3600, 3725)] == ["0:00", "0:59", "1:01", "59:59", "1:00:00",
                                                                         "1:02:05"]
