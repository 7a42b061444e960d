"""Token-count batching with length bucketing, a deterministic per-epoch order, and rank sharding.

An epoch's batch list is a pure function of (lengths, batch_tokens, seed, epoch): examples are
sorted by length (ties in a seeded random order), cut into batches whose padded size
``len(batch) * max_length`` stays within ``batch_tokens``, and the batches shuffled. Rank ``r`` of
``w`` reads batches ``r, r + w, ...`` of that list, cut to a multiple of ``w`` so every rank takes
the same number of steps. The data position is therefore just (epoch, index into the rank's
shard); a resumed run rebuilds the same lists and continues from there.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from training.errors import UserError

logger = logging.getLogger(__name__)

E = TypeVar("E")
B = TypeVar("B", bound="Batch")


class Batch(Protocol):
    """What the trainer needs from a collated batch."""

    count: int  # units the loss is a sum over (target tokens, rows): the step normaliser
    num_tokens: int  # non-pad tokens processed, for tokens/s

    def to(self, device: torch.device) -> Batch: ...


Collate = Callable[[Sequence[E], torch.Generator], B]


def _chunk(order: list[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Cut length-sorted ``order`` into batches of at most ``batch_tokens`` padded tokens (at least one example)."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so lengths[i] is the longest in the batch if i joins it.
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def bucket_batches(lengths: Sequence[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped into batches of similar length, each within ``batch_tokens`` padded tokens."""
    order = list(range(len(lengths)))
    rng.shuffle(order)  # random order among equal lengths
    order.sort(key=lambda i: lengths[i])
    return _chunk(order, lengths, batch_tokens)


def epoch_batches(lengths: Sequence[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The shuffled batch list of ``epoch`` (the same for a given seed on every run and rank)."""
    rng = random.Random(f"batches-{seed}-{epoch}")
    batches = bucket_batches(lengths, batch_tokens, rng)
    rng.shuffle(batches)
    return batches


def shard(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """Rank ``rank``'s disjoint share; every rank gets ``len(batches) // world_size`` batches."""
    usable = len(batches) - len(batches) % world_size
    return batches[rank:usable:world_size]


def sorted_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Unshuffled length-sorted batches, for evaluation."""
    return _chunk(sorted(range(len(lengths)), key=lambda i: lengths[i]), lengths, batch_tokens)


def batch_generator(seed: int, epoch: int, index: int, rank: int) -> torch.Generator:
    """The generator a batch's collate draws from (MLM masks, pair swaps): a pure function of its position."""
    state = np.random.SeedSequence([seed, epoch, index, rank]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@dataclass
class Position:
    """Where the next batch comes from: the epoch and the index into this rank's shard of it."""

    epoch: int = 0
    index: int = 0


class BatchStream(Generic[E, B]):
    """An endless stream of collated batches over epochs, resumable from a :class:`Position`."""

    def __init__(
        self,
        examples: Sequence[E],
        lengths: Sequence[int],
        collate: Collate,
        batch_tokens: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        position: Position | None = None,
    ) -> None:
        if len(examples) != len(lengths):
            raise ValueError("examples and lengths differ in length")
        self.examples = examples
        self.lengths = lengths
        self.collate = collate
        self.batch_tokens = batch_tokens
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = position or Position()
        self._epoch_batches: tuple[int, list[list[int]]] | None = None
        if not self._shard(self.position.epoch):
            raise UserError(
                f"the training data makes {len(epoch_batches(lengths, batch_tokens, seed, 0))} batch(es) of "
                f"--batch-tokens {batch_tokens}, fewer than the {world_size} process(es); use more data or "
                "a smaller --batch-tokens"
            )

    def _shard(self, epoch: int) -> list[list[int]]:
        if self._epoch_batches is None or self._epoch_batches[0] != epoch:
            batches = epoch_batches(self.lengths, self.batch_tokens, self.seed, epoch)
            self._epoch_batches = (epoch, shard(batches, self.rank, self.world_size))
        return self._epoch_batches[1]

    def batches_per_epoch(self) -> int:
        return len(self._shard(self.position.epoch))

    def __iter__(self) -> BatchStream[E, B]:
        return self

    def __next__(self) -> B:
        batches = self._shard(self.position.epoch)
        if self.position.index >= len(batches):
            self.position = Position(self.position.epoch + 1, 0)
            logger.debug("starting epoch %d", self.position.epoch)
            batches = self._shard(self.position.epoch)
        epoch, index = self.position.epoch, self.position.index
        generator = batch_generator(self.seed, epoch, index, self.rank)
        batch = self.collate([self.examples[i] for i in batches[index]], generator)
        self.position = Position(epoch, index + 1)
        return batch
