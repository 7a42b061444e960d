"""The recipe's promise: every phase trains its fixed steps however fast the clock runs (the same models on every
machine), and the end of its output says plainly whether each check against the baselines passed."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import checkpoint, lora_io
from tests.training.tiny_recipe import STEPS, tiny_tier, write_sources
from training.recipe_report import RULE, report_lines
from training.recipe_run import run_pipeline, run_stage
from training.recipe_stages import Paths, prepare_stages, trained_steps, training_stages

LINE = re.compile(r"^(\w+): step (\d+)/(\d+) \((\d+)%\), loss \d+\.\d{4}, \d+ tokens/s, ETA \d+:\d\d$")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> Paths:
    """The tiny tier's six corpora, prepared once (``out`` is set by each test)."""
    root = tmp_path_factory.mktemp("steps")
    paths = Paths(root / "out", root / "data", *write_sources(root / "sources"))
    run_pipeline("corpora", prepare_stages(tiny_tier(), paths), paths, force=False)
    return paths


def train_all(paths: Paths, speed: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every family's training stages while the clock runs ``speed`` times as fast as real time: 1000 is a machine
    1000 times slower (each step seems to take that much longer), 0.001 one 1000 times faster."""
    real = time.perf_counter
    with monkeypatch.context() as patch:
        patch.setattr(time, "perf_counter", lambda: real() * speed)
        for f in tiny_tier().families:
            for stage in training_stages(f, paths):
                assert run_stage(stage, paths, force=False)


def weights(paths: Paths) -> dict[str, dict[str, torch.Tensor]]:
    """Every model's and adapter's saved tensors."""
    found = {}
    for f in tiny_tier().families:
        found[f.model] = load_file(paths.model(f) / checkpoint.WEIGHTS_FILE)
        found[f"{f.model}/{f.adapter}"] = load_file(paths.adapter(f) / lora_io.WEIGHTS_FILE)
    return found


def test_every_phase_trains_its_fixed_steps_and_the_same_weights_however_fast_the_clock(
    corpora: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runs = {speed: replace(corpora, out=tmp_path / f"clock-x{speed}") for speed in (1000.0, 0.001)}
    lines = {}
    for speed, paths in runs.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="training.progress"):
            train_all(paths, speed, monkeypatch)
        lines[speed] = [m.groups() for r in caplog.records if (m := LINE.match(r.getMessage()))]
    slow, fast = runs.values()
    for f in tiny_tier().families:
        for directory in (slow.model(f), slow.adapter(f), fast.model(f), fast.adapter(f)):
            assert trained_steps(directory) == STEPS, directory
    slow_weights, fast_weights = weights(slow), weights(fast)
    assert slow_weights.keys() == fast_weights.keys()
    for name, tensors in slow_weights.items():
        assert tensors.keys() == fast_weights[name].keys()
        assert all(torch.equal(tensors[key], fast_weights[name][key]) for key in tensors), name
    # Progress lines: the fixed total and its percentage, from the first step to the last, for each of the 6 runs.
    names = [n for f in tiny_tier().families for n in (f.model, f.adapter)]
    for speed, found in lines.items():
        ends = {}
        for name, step, total, percent in found:
            assert int(total) == STEPS and int(percent) == 100 * int(step) // STEPS, (speed, name, step)
            ends.setdefault(name, []).append(int(step))
        assert {name: (steps[0], steps[-1]) for name, steps in ends.items()} == {n: (1, STEPS) for n in names}


def test_a_model_trained_for_other_steps_is_trained_again(corpora: Paths, tmp_path: Path) -> None:
    paths, f = replace(corpora, out=tmp_path / "out"), tiny_tier().langid
    base, adapter = training_stages(f, paths)
    assert run_stage(base, paths, force=False) and not run_stage(base, paths, force=False)
    # As a time-budgeted recipe left it: fewer steps than the tier's.
    metrics = paths.model(f) / "metrics.json"
    metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "steps_trained": STEPS - 1}))
    assert run_stage(base, paths, force=False)
    assert trained_steps(paths.model(f)) == STEPS


def summary(passed: list[bool]) -> dict:
    """A summary.json with one translation check per value of ``passed``."""
    train = {"steps_trained": STEPS, "fixed_steps": STEPS, "total_wall_time_s": 61.0}
    checks = [
        {"what": "translation bleu vs copy_source on the general test split", "against": "copy_source",
         "value": 35.8, "other": 17.7, "passed": passed[0]},
        {"what": "translation bleu vs copy_source on the package-held-out test split", "against": "copy_source",
         "value": 11.2, "other": 15.5, "passed": passed[1]},
    ]  # fmt: skip
    return {
        "tier": "quick",
        "models": {"translation": {"train": train, "adapter": {"name": "postgres", "train": train}}},
        "checks": checks,
        "all_checks_passed": all(passed),
    }


def test_the_end_of_the_output_names_each_failing_check_and_what_to_do() -> None:
    lines = report_lines(summary([True, False]), "checkpoints")
    assert "  translation 3/3 steps in 1:01; adapter postgres 3/3 steps in 1:01" in lines
    assert "  passed  translation bleu vs copy_source on the general test split: 35.8 vs 17.7" in lines
    assert "  FAILED  translation bleu vs copy_source on the package-held-out test split: 11.2 vs 15.5" in lines
    banner = lines[lines.index(RULE) :]
    assert banner[-1] == RULE
    assert banner[1].startswith("THE DEFAULT MODELS DID NOT BEAT THEIR TRIVIAL BASELINES: 1 of 2 checks FAILED")
    assert "  FAILED  translation bleu vs copy_source on the package-held-out test split" in banner
    text = "\n".join(banner)
    assert "English source left untranslated" in text and "make train-quality" in text
    assert "checkpoints/summary.json" in text


def test_the_end_of_the_output_says_when_every_check_passed() -> None:
    lines = report_lines(summary([True, True]), "checkpoints")
    assert lines[-1].startswith("recipe quick: all 2 checks passed")
    assert RULE not in lines and not any("FAILED" in line for line in lines)
