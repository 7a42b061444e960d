"""Resume state without pickle: optimizer and RNG round trips, atomic step directories, crash leftovers."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from training.state import (
    LATEST,
    StateError,
    StateStore,
    capture_rng,
    load_trainable,
    optimizer_state,
    restore_optimizer,
    restore_rng,
    trainable_tensors,
)


def _model_and_adam(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-9)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = model(torch.randn(5, 4, generator=g)).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_optimizer_and_weights_round_trip_through_the_store(tmp_path):
    model, opt = _model_and_adam()
    _steps(model, opt, 3, seed=1)
    tensors, meta = optimizer_state(opt)
    store = StateStore(tmp_path / "state")
    json.dumps(meta)  # JSON-able
    store.save(3, trainable=trainable_tensors(model), optimizer=tensors, meta={"optimizer": meta}, files={})

    state = store.load()
    fresh, fresh_opt = _model_and_adam(seed=99)
    load_trainable(fresh, state.trainable, state.directory)
    restore_optimizer(fresh_opt, state.optimizer, state.meta["optimizer"], state.directory)
    assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.98)
    _steps(model, opt, 2, seed=2)
    _steps(fresh, fresh_opt, 2, seed=2)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert sorted(p.name for p in state.directory.iterdir()) == [
        "optimizer.safetensors",
        "state.json",
        "trainable.safetensors",
    ]


def test_rng_round_trip():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    state = json.loads(json.dumps(capture_rng()))
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    restore_rng(state)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def _save(store: StateStore, step: int) -> None:
    store.save(step, trainable={"w": torch.full((2,), float(step))}, optimizer={}, meta={}, files={"x.json": b"{}"})


def test_only_the_latest_step_is_kept(tmp_path):
    store = StateStore(tmp_path)
    _save(store, 10)
    _save(store, 20)
    assert (tmp_path / LATEST).read_text().strip() == "step-00000020"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000020"]
    state = store.load()
    assert state.meta["step"] == 20 and state.file("x.json").read_bytes() == b"{}"


def test_crash_leftovers_are_ignored(tmp_path):
    """A kill mid-save leaves a temp dir, or a renamed step dir that LATEST does not name yet."""
    store = StateStore(tmp_path)
    _save(store, 10)
    (tmp_path / ".step-00000020.abc").mkdir()
    (tmp_path / ".step-00000020.abc" / "trainable.safetensors").write_bytes(b"partial")
    (tmp_path / "step-00000020").mkdir()  # renamed, pointer not yet updated
    assert store.load().meta["step"] == 10
    _save(store, 20)  # the next save replaces both leftovers
    assert store.load().meta["step"] == 20
    assert not list(tmp_path.glob(".step-*"))


def test_pointer_to_a_missing_directory_is_an_error(tmp_path):
    store = StateStore(tmp_path)
    assert store.load() is None
    (tmp_path / LATEST).write_text("step-00000005\n")
    with pytest.raises(StateError, match="missing or incomplete"):
        store.load()


def test_mismatched_parameters_are_rejected(tmp_path):
    model, _ = _model_and_adam()
    with pytest.raises(StateError, match="do not match"):
        load_trainable(model, {"0.weight": torch.zeros(8, 4)}, tmp_path)
