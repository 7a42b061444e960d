"""Classifier pre-training: masked LM plus sentence order over consecutive lines of a text file.

Each example is a pair of consecutive non-blank lines. At batch time (from the batch's own
generator, so a resumed run draws the same) the pair is swapped half the time (sentence-order
label 1) and 15% of its tokens are chosen for MLM (80% [MASK], 10% random, 10% unchanged).
The loss per row is the batch's mean MLM loss plus that row's sentence-order loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from model.tokenizer import SPECIAL_TOKENS, Tokenizer
from training.data import DataError, read_lines
from training.objectives import IGNORE_INDEX, cross_entropy_sum, mlm_mask, sentence_order
from training.tasks.base import pad


@dataclass(frozen=True)
class SegmentPair:
    first: list[int]
    second: list[int]

    @property
    def length(self) -> int:
        return len(self.first) + len(self.second) + 3  # [CLS] a [SEP] b [SEP]


@dataclass
class PretrainBatch:
    inputs: torch.Tensor  # (B, T) masked ids
    segments: torch.Tensor  # (B, T)
    mlm_labels: torch.Tensor  # (B, T) original ids at chosen positions, IGNORE_INDEX elsewhere
    order_labels: torch.Tensor  # (B,) 1 = swapped
    count: int  # rows
    num_tokens: int

    def to(self, device: torch.device) -> PretrainBatch:
        return replace(
            self,
            inputs=self.inputs.to(device),
            segments=self.segments.to(device),
            mlm_labels=self.mlm_labels.to(device),
            order_labels=self.order_labels.to(device),
        )


def read_segments(path: Path, skip_malformed: bool) -> list[str]:
    """Non-blank lines of the pre-training text; at least two are needed for a pair."""
    lines = read_lines(path, skip_malformed).records
    if len(lines) < 2:
        raise DataError(f"{path}: sentence-order pre-training needs at least two non-blank lines")
    return lines


def segment_pairs(lines: Sequence[str], tokenizer: Tokenizer, max_len: int) -> list[SegmentPair]:
    """Each line paired with the next, each side truncated so the pair fits ``max_len``."""
    half = max(1, (max_len - 3) // 2)
    ids = [t[:half] for t in tokenizer.encode_batch(list(lines))]
    return [SegmentPair(a, b) for a, b in zip(ids[:-1], ids[1:], strict=True) if a and b]


class Pretraining:
    """The MLM + sentence-order objective for a classifier with ``vocab_size`` tokens."""

    def __init__(self, vocab_size: int, mask_prob: float = 0.15) -> None:
        self.vocab_size = vocab_size
        self.mask_prob = mask_prob

    def collate(self, examples: Sequence[SegmentPair], generator: torch.Generator) -> PretrainBatch:
        rows, segment_rows, order = [], [], []
        for e in examples:
            first, second, swapped = sentence_order(e.first, e.second, generator)
            rows.append([Tokenizer.cls_id, *first, Tokenizer.sep_id, *second, Tokenizer.sep_id])
            segment_rows.append([0] * (len(first) + 2) + [1] * (len(second) + 1))
            order.append(swapped)
        ids = pad(rows, Tokenizer.pad_id)
        maskable = (ids != Tokenizer.pad_id) & (ids != Tokenizer.cls_id) & (ids != Tokenizer.sep_id)
        inputs, labels = mlm_mask(
            ids,
            maskable,
            mask_id=Tokenizer.mask_id,
            random_ids=(len(SPECIAL_TOKENS), self.vocab_size),
            generator=generator,
            prob=self.mask_prob,
        )
        return PretrainBatch(
            inputs,
            pad(segment_rows, 0),
            labels,
            torch.tensor(order, dtype=torch.long),
            len(examples),
            int(maskable.sum()) + 3 * len(examples),
        )

    def loss(self, model: nn.Module, batch: PretrainBatch) -> torch.Tensor:
        mlm_logits, order_logits = model.pretraining_logits(batch.inputs, batch.segments)
        masked = int((batch.mlm_labels != IGNORE_INDEX).sum())
        mlm = cross_entropy_sum(mlm_logits, batch.mlm_labels) / max(masked, 1)
        return mlm * batch.count + cross_entropy_sum(order_logits, batch.order_labels)
