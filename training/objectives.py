"""Training objectives: (label-smoothed) cross-entropy, BERT's MLM masking, and sentence order.

Losses are returned as sums over their units (tokens or rows), so the trainer can normalise by
the unit count of a whole step, across gradient-accumulation micro-batches and processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label of positions that carry no loss (padding, unmasked MLM tokens)


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Sum over non-ignored positions of (1 - eps) * NLL + eps * mean_v(-log p_v).

    ``logits`` (..., V) and ``targets`` (...); computed in float32 whatever the logits' dtype. With
    ``smoothing`` eps the target distribution is (1 - eps) on the gold token plus eps / V on every token.
    """
    logp = F.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)  # (N, V)
    targets = targets.reshape(-1)
    keep = targets != ignore_index
    logp, targets = logp[keep], targets[keep]
    nll = -logp.gather(1, targets[:, None]).squeeze(1)  # (N,)
    if smoothing == 0.0:
        return nll.sum()
    uniform = -logp.mean(dim=-1)  # (N,)
    return ((1.0 - smoothing) * nll + smoothing * uniform).sum()


def mlm_mask(
    ids: torch.Tensor,
    maskable: torch.Tensor,
    *,
    mask_id: int,
    random_ids: tuple[int, int],
    generator: torch.Generator,
    prob: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of ``ids`` (B, T): returns (inputs, labels).

    Each ``maskable`` position is chosen with probability ``prob``; a chosen token becomes
    ``mask_id`` 80% of the time, a uniform random id in ``[random_ids[0], random_ids[1])`` 10%,
    and stays unchanged 10%. ``labels`` hold the original id at chosen positions, IGNORE_INDEX elsewhere.
    """
    chosen = (torch.rand(ids.shape, generator=generator) < prob) & maskable
    action = torch.rand(ids.shape, generator=generator)
    replacement = torch.randint(*random_ids, ids.shape, generator=generator)
    inputs = torch.where(chosen & (action < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), replacement, inputs)
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    return inputs, labels


def sentence_order(first: list[int], second: list[int], generator: torch.Generator) -> tuple[list[int], list[int], int]:
    """ALBERT's sentence-order task: swap two consecutive segments half the time; label 1 = swapped."""
    if torch.rand((), generator=generator).item() < 0.5:
        return second, first, 1
    return first, second, 0
