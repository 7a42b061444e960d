"""Losses and pre-training masks against hand-computed values and statistical bounds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.objectives import IGNORE_INDEX, cross_entropy_sum, mlm_mask, sentence_order


def test_label_smoothing_matches_hand_computed_value():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    targets = torch.tensor([0, 1])
    eps = 0.1
    expected = 0.0
    for row, gold in zip(logits.tolist(), targets.tolist(), strict=True):
        log_z = math.log(sum(math.exp(x) for x in row))
        logp = [x - log_z for x in row]
        # target distribution: 1 - eps + eps/V on the gold token, eps/V elsewhere
        expected += -sum(((1 - eps) * (v == gold) + eps / 3) * lp for v, lp in enumerate(logp))
    got = cross_entropy_sum(logits, targets, smoothing=eps)
    assert got.item() == pytest.approx(expected, abs=1e-6)
    assert got.item() == pytest.approx(F.cross_entropy(logits, targets, label_smoothing=eps, reduction="sum").item())


def test_cross_entropy_ignores_padding_and_is_a_sum():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[1, 2, IGNORE_INDEX], [3, IGNORE_INDEX, IGNORE_INDEX]])
    keep = targets != IGNORE_INDEX
    expected = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
    assert cross_entropy_sum(logits, targets).item() == pytest.approx(expected.item(), abs=1e-6)
    assert cross_entropy_sum(logits.bfloat16(), targets).dtype == torch.float32


def test_mlm_mask_proportions():
    g = torch.Generator().manual_seed(0)
    vocab, mask_id = 1000, 6
    ids = torch.randint(7, vocab, (512, 128), generator=g)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:, 0] = False  # e.g. [CLS]
    maskable[:, -10:] = False  # e.g. padding
    inputs, labels = mlm_mask(ids, maskable, mask_id=mask_id, random_ids=(7, vocab), generator=g)

    chosen = labels != IGNORE_INDEX
    n = int(chosen.sum())
    assert not chosen[~maskable].any()
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    # ~9,000 chosen tokens: binomial standard errors are ~0.004 or less; bounds are >= 4 of them.
    assert abs(n / int(maskable.sum()) - 0.15) < 0.005
    masked = (inputs == mask_id) & chosen
    replaced = (inputs != mask_id) & (inputs != ids) & chosen
    kept = (inputs == ids) & chosen
    assert abs(int(masked.sum()) / n - 0.8) < 0.02
    assert abs(int(replaced.sum()) / n - 0.1) < 0.015
    assert abs(int(kept.sum()) / n - 0.1) < 0.015
    assert int(inputs[replaced].min()) >= 7 and int(inputs[replaced].max()) < vocab


def test_mlm_mask_is_a_function_of_the_generator():
    ids = torch.randint(7, 50, (4, 20), generator=torch.Generator().manual_seed(1))
    maskable = torch.ones_like(ids, dtype=torch.bool)
    a = mlm_mask(ids, maskable, mask_id=6, random_ids=(7, 50), generator=torch.Generator().manual_seed(5))
    b = mlm_mask(ids, maskable, mask_id=6, random_ids=(7, 50), generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_sentence_order_swaps_half_the_time():
    g = torch.Generator().manual_seed(0)
    labels = []
    for _ in range(4000):
        first, second, label = sentence_order([1], [2], g)
        assert (first, second) == (([2], [1]) if label else ([1], [2]))
        labels.append(label)
    assert abs(sum(labels) / len(labels) - 0.5) < 0.03  # ~3.8 standard errors
