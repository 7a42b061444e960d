"""The running batch of continuous batching: rows of many generation jobs in one KV cache (TGI's batch).

``filter`` drops jobs (cancelled, timed out, failed) by selecting the rows of the others;
``concatenate`` joins batches (jobs prefilled this step join the running ones) with
``KVCache.concat``. Rows are in job order; a job owns ``job.search.num_rows`` consecutive rows. A translator's
rows under a vocabulary map keep their target vocabularies (model.restricted_vocab) beside the cache.
"""

from __future__ import annotations

import dataclasses

import torch

from model.kv_cache import GROWTH, CrossAttentionMemory, KVCache
from model.restricted_vocab import VocabularyRestriction
from service.engine.jobs import GenerationJob, Job


@dataclasses.dataclass
class RunningBatch:
    """Rows of several generation jobs in one KV cache, in job order (TGI's batch: filter / concatenate)."""

    jobs: list[GenerationJob]
    cache: KVCache
    tokens: torch.Tensor | None = None  # (rows,) the token each row feeds next
    vocabulary: VocabularyRestriction | None = None  # the target ids each row may produce (a translator's)

    @property
    def rows(self) -> int:
        return self.cache.batch_size

    @property
    def reserved(self) -> int:
        return sum(job.rows for job in self.jobs)

    def adapter_rows(self) -> list[str | None]:
        return [a for job in self.jobs for a in [internal_name(job)] * job.search.num_rows]

    def row_index(self, keep: list[GenerationJob]) -> torch.Tensor:
        wanted, index, offset = {id(j) for j in keep}, [], 0
        for job in self.jobs:
            if id(job) in wanted:
                index.extend(range(offset, offset + job.search.num_rows))
            offset += job.search.num_rows
        return torch.tensor(index, dtype=torch.long, device=self.cache.lengths.device)

    def select(self, index: torch.Tensor, tails: torch.Tensor | None = None) -> None:
        """Keep, reorder or duplicate rows (:meth:`KVCache.select`), their vocabularies with them."""
        self.cache.select(index, tails)
        if self.vocabulary is not None:
            self.vocabulary = self.vocabulary.select(index)

    def share_beam_prefixes(self) -> None:
        """Tell the cache, for the next decoding step, which leading positions each row shares with its beam run's
        first row (every job's :meth:`model.search.Search.shared_history`, offset to its rows; a row alone leads
        itself), so that the C++ step reads them once (:meth:`KVCache.share_beam_prefix`)."""
        histories = [job.search.shared_history() for job in self.jobs]
        if all(shared is None for shared in histories):  # no beams running: nothing to build
            self.cache.share_beam_prefix(None, 0)
            return
        device, leads, tokens, generated, offset = self.cache.lengths.device, [], [], [], 0
        for job, shared in zip(self.jobs, histories, strict=True):
            rows = job.search.num_rows
            if shared is None:
                leads.append(torch.arange(offset, offset + rows, device=device))
                tokens.append(torch.zeros(rows, dtype=torch.long, device=device))
            else:
                leads.append(shared[0] + offset)
                tokens.append(shared[1])
            generated.append(torch.full((rows,), job.search.step, device=device))
            offset += rows
        self.cache.share_beam_prefix((torch.cat(leads), torch.cat(tokens)), torch.cat(generated))

    def filter(self, keep: list[GenerationJob]) -> RunningBatch | None:
        """This batch with only the rows of ``keep`` (None when empty)."""
        if not keep:
            return None
        index = self.row_index(keep)
        self.select(index)
        compact(self.cache)
        if self.tokens is not None:
            self.tokens = self.tokens.index_select(0, index)
        self.jobs = keep
        return self

    def sub(self, job: GenerationJob) -> RunningBatch:
        """A copy of one job's rows (the batch itself is untouched)."""
        index = self.row_index([job])
        cache = dataclasses.replace(self.cache)  # shares the buffers: safe, since an index over every
        cache.select(index)  # row is the identity (select copies nothing) and any other one allocates anew
        tokens = self.tokens.index_select(0, index) if self.tokens is not None else None
        vocabulary = self.vocabulary.select(index) if self.vocabulary is not None else None
        return RunningBatch([job], cache, tokens, vocabulary)

    @staticmethod
    def concatenate(batches: list[RunningBatch]) -> RunningBatch | None:
        batches = [b for b in batches if b is not None]
        if len(batches) <= 1:
            return batches[0] if batches else None
        cache = KVCache.concat([b.cache for b in batches])
        vocabulary = VocabularyRestriction.concat([b.vocabulary for b in batches], [b.rows for b in batches])
        return RunningBatch([j for b in batches for j in b.jobs], cache, vocabulary=vocabulary)


def internal_name(job: Job) -> str | None:
    return job.adapter.internal if job.adapter is not None else None


def compact(cache: KVCache) -> None:
    """Shrink the visible span and buffers after long rows left (``select`` keeps the old maximum).

    Positions at or beyond every row's length are masked for every query, so forgetting them is exact.
    """
    if cache.batch_size == 0:
        return
    longest = int(cache.lengths.max())
    cache.max_length = min(cache.max_length, longest)
    if cache.capacity > longest + 2 * GROWTH:
        cache.resize(longest + GROWTH)
    if cache.cross is not None:
        used = cache.cross.mask.reshape(cache.batch_size, -1).any(dim=0).nonzero()
        source_len = int(used.max()) + 1 if used.numel() else 1
        if source_len < cache.cross.mask.shape[-1]:
            cache.cross = CrossAttentionMemory(
                keys=[k[:, :, :source_len] for k in cache.cross.keys],
                values=[v[:, :, :source_len] for v in cache.cross.values],
                mask=cache.cross.mask[..., :source_len],
                sources=cache.cross.sources,
            )
