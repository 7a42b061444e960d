"""The paper's optimiser: Adam(0.9, 0.98, 1e-9) with linear warm-up then inverse-square-root decay."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

BETAS = (0.9, 0.98)
EPS = 1e-9


@dataclass(frozen=True)
class InverseSqrtSchedule:
    """lr(step) = peak * min(step / warmup, sqrt(warmup / step)); steps count from 1."""

    peak_lr: float
    warmup: int

    def __post_init__(self) -> None:
        if not (self.peak_lr > 0 and math.isfinite(self.peak_lr)):
            raise ValueError(f"peak_lr must be positive, got {self.peak_lr}")
        if self.warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {self.warmup}")

    def lr(self, step: int) -> float:
        if step < 1:
            return 0.0
        return self.peak_lr * min(step / self.warmup, math.sqrt(self.warmup / step))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every param group's lr for optimizer step ``step`` and return it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def build_optimizer(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Adam:
    """Adam with the paper's betas and epsilon and no weight decay."""
    return torch.optim.Adam(params, lr=lr, betas=BETAS, eps=EPS)
