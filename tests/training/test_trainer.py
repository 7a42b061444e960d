"""The family-agnostic trainer on a toy regression model: accumulation, clipping-free steps, deadlines."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from training.batching import BatchStream
from training.distributed import DistContext
from training.optim import InverseSqrtSchedule, build_optimizer
from training.trainer import Evaluation, Hooks, Trainer, TrainerConfig


@dataclass
class ToyBatch:
    x: torch.Tensor  # (B, 3)
    y: torch.Tensor  # (B,)
    count: int
    num_tokens: int

    def to(self, device: torch.device) -> ToyBatch:
        return replace(self, x=self.x.to(device), y=self.y.to(device))


def _collate(rows, generator) -> ToyBatch:
    x = torch.stack([r[0] for r in rows])
    y = torch.stack([r[1] for r in rows])
    return ToyBatch(x, y, len(rows), len(rows))


def _loss(model: nn.Module, batch: ToyBatch) -> torch.Tensor:
    return (model(batch.x).squeeze(-1) - batch.y).pow(2).sum()


@dataclass
class _Example:
    row: tuple[torch.Tensor, torch.Tensor]
    length: int


def _trainer(examples, batch_tokens: int, accum: int, **config) -> tuple[Trainer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    stream = BatchStream([e.row for e in examples], [e.length for e in examples], _collate, batch_tokens, seed=0)
    trainer = Trainer(
        model,
        _loss,
        build_optimizer(model.parameters(), 0.1),
        InverseSqrtSchedule(0.1, 1),
        stream,
        TrainerConfig(**{"max_steps": 1, "accum_steps": accum, "clip_norm": None, **config}),
        DistContext(),
    )
    return trainer, model


def _examples(n: int) -> list[_Example]:
    g = torch.Generator().manual_seed(1)
    return [_Example((torch.randn(3, generator=g), torch.randn((), generator=g)), 1) for _ in range(n)]


def test_accumulated_micro_batches_equal_one_batch():
    """2 micro-batches of 4 rows accumulate to the gradient of the mean over all 8 rows."""
    examples = _examples(8)
    small, small_model = _trainer(examples, batch_tokens=4, accum=2)
    big, big_model = _trainer(examples, batch_tokens=8, accum=1)
    small.run()
    big.run()
    assert small.progress.tokens == big.progress.tokens == 8
    for a, b in zip(small_model.parameters(), big_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_deadline_stops_after_the_current_step_and_evaluates():
    calls = []
    trainer, _ = _trainer(_examples(8), batch_tokens=2, accum=1, max_steps=100, eval_every=50)
    trainer.hooks = Hooks(evaluate=lambda: calls.append(1) or Evaluation(1.0, 2.0, "m", True))
    progress = trainer.run(deadline=time.perf_counter())
    assert trainer.timed_out and progress.step == 1
    assert calls == [1] and progress.best_step == 1 and progress.best_metrics == {"valid_loss": 1.0, "valid_m": 2.0}


def test_best_key_prefers_metric_then_loss():
    assert Evaluation(2.0, 10.0, "bleu", True).key() > Evaluation(1.0, 9.0, "bleu", True).key()
    assert Evaluation(1.0, 10.0, "bleu", True).key() > Evaluation(2.0, 10.0, "bleu", True).key()
    assert Evaluation(1.0, 5.0, "perplexity", False).key() > Evaluation(1.0, 6.0, "perplexity", False).key()
