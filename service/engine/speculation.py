"""Speculative decoding in the running batch (model.speculative): which jobs draft this step, the tokens a
verification step feeds, and what each row keeps of it.

A job speculates when its request asked for it (or the model's default applies): one input, greedy or one sample,
so its search holds one row. When any running job has a draft, the step feeds every row its token plus up to the
longest draft (a row with a shorter or no draft repeats its token: those positions are computed and forgotten);
otherwise it is a plain decode step. After the searches walked the logits, every row forgets the positions past
what it kept (``excess``).
"""

from __future__ import annotations

import torch

from model.causal_lm import CausalLM
from model.speculative import make_drafter, next_draft
from service.engine.batch import RunningBatch
from service.engine.jobs import GenerationJob


def start_drafter(job: GenerationJob, source: list[int], draft_model: CausalLM | None) -> None:
    """Give a speculating job its drafter over ``source`` (the runner's draft_source of its input); method
    draft_model drafts with ``draft_model`` (the worker refused such requests when there is none)."""
    if job.speculative is not None and job.search.num_rows == 1:
        job.drafter = make_drafter(job.speculative, source, draft_model)


def drafts_for(jobs: list[GenerationJob]) -> list[list[int] | None] | None:
    """Each job's draft for this step (None: the job does not speculate), or None when nobody drafted anything."""
    drafts, drafted = [], False
    for job in jobs:
        draft = None
        if job.drafter is not None:
            draft = next_draft(job.drafter, job.search)
            drafted = drafted or bool(draft)
        drafts.append(draft)
    return drafts if drafted else None


def fed_tokens(batch: RunningBatch, drafts: list[list[int] | None]) -> torch.Tensor:
    """(rows, 1 + longest draft): each row's token, then its job's draft (rows without one repeat their token)."""
    width = 1 + max(len(d) for d in drafts if d)
    rows: list[list[int]] = []
    tokens = iter(batch.tokens.tolist())
    for job, draft in zip(batch.jobs, drafts, strict=True):
        draft = draft or []
        for _ in range(job.search.num_rows):
            token = next(tokens)
            rows.append([token, *draft, *[token] * (width - 1 - len(draft))])
    return torch.tensor(rows, dtype=batch.tokens.dtype).to(batch.tokens.device, non_blocking=True)
