"""The paper's Adam settings and the warm-up + inverse-square-root schedule."""

from __future__ import annotations

import math

import pytest
import torch

from training.optim import InverseSqrtSchedule, build_optimizer


def test_schedule_matches_formula():
    peak, warmup = 7e-4, 400
    s = InverseSqrtSchedule(peak, warmup)
    for step in (1, 2, 50, 399, 400, 401, 1000, 1600, 10_000):
        assert s.lr(step) == pytest.approx(peak * min(step / warmup, math.sqrt(warmup / step)), rel=1e-12)
    assert s.lr(1) == pytest.approx(peak / warmup)
    assert s.lr(warmup) == pytest.approx(peak)
    assert s.lr(4 * warmup) == pytest.approx(peak / 2)
    rising = [s.lr(i) for i in range(1, warmup + 1)]
    falling = [s.lr(i) for i in range(warmup, 3 * warmup)]
    assert rising == sorted(rising) and falling == sorted(falling, reverse=True)


def test_schedule_rejects_bad_values():
    with pytest.raises(ValueError):
        InverseSqrtSchedule(1e-3, 0)
    with pytest.raises(ValueError):
        InverseSqrtSchedule(0.0, 10)


def test_adam_settings_and_apply():
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimizer(params, lr=1.0)
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["weight_decay"] == 0
    assert InverseSqrtSchedule(1e-3, 10).apply(opt, 5) == pytest.approx(5e-4)
    assert group["lr"] == pytest.approx(5e-4)
