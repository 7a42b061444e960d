"""Continuous batching of causal_lm / seq2seq generation: the ``GenerationScheduler``.

Iteration-level batching in vLLM's ``schedule()`` / ``update_from_output()`` shape over a TGI-style
``RunningBatch`` (``filter`` / ``concatenate``):

1. drop running jobs that were cancelled or passed their deadline (``filter``: their rows leave);
2. admit waiting jobs (by priority; within one, API keys take turns: ``fair_order``) while their *maximum* rows
   (beams expand after the first step) fit in ``max_batch_size`` (a job larger than that runs when the batch is
   empty, alone);
3. one step for all running rows, with per-row LoRA adapters: a decode step, or a verification step when a job
   drafted tokens (service/engine/speculation.py);
4. prefill the admitted jobs together (the family's ``GenerationRunner``, service/engine/runners.py, reusing cached
   prefixes) and ``KVCache.concat`` their rows after the running ones;
5. each job's Search advances on its slice of the logits (masked by its constraint's matchers, if any); parent
   rows become one global index and ``cache.select`` applies it, so finished jobs' rows leave at once and their
   futures resolve.

Failures stay with their job: logits are checked for non-finite values per job (a poisoned adapter fails only its
jobs); a model call that raises is retried job by job on copies of the pre-step cache (``_decode_alone``), so only
the culprit fails with EngineFailure and the others carry on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from model.decoding import Strategy, make_search
from model.generation import stop_strings
from model.restricted_vocab import VocabularyRestriction
from model.search import force_first_tokens
from model.speculative import verify
from model.tokenizer import Tokenizer
from service.engine.adapters import AdapterRegistry
from service.engine.batch import RunningBatch, compact, internal_name
from service.engine.jobs import CallJob, GenerationJob, Job, final_stream_event, generate_outputs, logprob_entries
from service.engine.metrics import Metrics, adapter_label
from service.engine.runners import GenerationRunner
from service.engine.scheduler import Scheduler
from service.engine.speculation import drafts_for, fed_tokens, start_drafter
from service.engine.static_decoding import StaticDecoding
from service.engine.types import EngineSettings

logger = logging.getLogger(__name__)

# A model call's share for one job: its logits ((rows, V), or (rows, t, V) after a verification step), whether they
# are finite, and the draft it verified (None: none).
Output = tuple[GenerationJob, torch.Tensor, bool, list[int] | None]


class GenerationScheduler(Scheduler):
    """Continuous batching of causal_lm / seq2seq generation; see the module docstring."""

    def __init__(self, name: str, runner: GenerationRunner, tokenizer: Tokenizer, settings: EngineSettings,
                 metrics: Metrics, registry: AdapterRegistry) -> None:
        super().__init__(name, runner.model, settings, metrics, registry)
        self.runner = runner
        self.tokenizer = tokenizer  # target side: decodes generated ids
        self.batch: RunningBatch | None = None
        self.device = runner.device
        self._ttft, self._itl = metrics.ttft.labels(name), metrics.itl.labels(name)  # children resolved once
        self._drafted = metrics.spec_draft_tokens.labels(name)
        self._accepted = metrics.spec_accepted_tokens.labels(name)
        self._generated: dict[str | None, Any] = {}  # adapter -> tserve_generation_tokens_total child
        self._prefix_seen = (0, 0)  # the prefix cache's (queried, hit) tokens already counted in metrics
        self.static = StaticDecoding.of(name, runner, settings, metrics, registry)  # TSERVE_CUDA_GRAPHS (None: off)

    @property
    def num_running(self) -> int:
        batch = self.batch
        return len(batch.jobs) if batch is not None else 0

    def _drop_running(self) -> None:
        self.batch = None

    def running_jobs(self) -> list[Job]:
        """The running batch's jobs, then those taken this iteration (being prefilled)."""
        batch = self.batch
        running = list(batch.jobs) if batch is not None else []
        return running + [job for job in list(self._taken) if not job.done and job not in running]

    @property
    def num_rows(self) -> int:
        batch = self.batch
        return batch.rows if batch is not None else 0

    def _ready(self, now: float) -> tuple[bool, float | None]:
        """Step whenever a job runs or waits: an idle model starts a lone request at once (``max_wait_ms`` is for
        the pooled families), because jobs that arrive meanwhile join the running batch at the next step."""
        return bool(self.num_running or self._waiting), None

    def _iteration(self) -> None:
        self._drop_dead(time.monotonic())
        reserved = self.batch.reserved if self.batch is not None else 0
        admitted = []
        for job in self._take(self.settings.max_batch_size - reserved, alone_ok=self.batch is None):
            if isinstance(job, CallJob):
                self._run_call(job)
            elif self._admit(job) and self._start_search(job):
                admitted.append(job)
        self._step(admitted)
        self._taken = []
        self.metrics.running.labels(self.name).set(self.num_running)
        self.metrics.kv_cache_bytes.labels(self.name).set(self.batch.cache.nbytes if self.batch is not None else 0)
        if self.device.type == "cuda":
            self.metrics.gpu_memory(str(self.device), torch.cuda.memory_allocated(self.device))

    def _drop_dead(self, now: float) -> None:
        if self.batch is None:
            return
        keep = []
        for job in self.batch.jobs:
            if job.cancelled or job.expired(now):
                self._finish(job, exc=job.timeout_error())
            else:
                keep.append(job)
        if len(keep) < len(self.batch.jobs):
            self.batch = self.batch.filter(keep)

    def _start_search(self, job: GenerationJob) -> bool:
        try:
            stop_fn = stop_strings(self.tokenizer, job.stops)
            job.search = make_search(job.config, len(job.prompts), stop_fn,
                                     prefixes=self.runner.prefixes(job.prompts, job.targets))
        except Exception as exc:
            self._finish(job, exc=self._failure(job, exc))
            return False
        try:
            if job.constraint is not None:
                job.matchers = job.constraint.rows(len(job.prompts))
        except Exception as exc:
            self._finish(job, exc=self._failure(job, exc))
            return False
        start_drafter(job, self.runner.draft_source(job.prompts[0], job.targets[0]), self.runner.draft_model)
        self.metrics.prompt_tokens.labels(self.name, adapter_label(job.adapter_name)).inc(job.prompt_tokens)
        return True

    def _step(self, admitted: list[GenerationJob]) -> None:
        outputs = self._decode(self.batch) if self.batch is not None else []
        if admitted:
            new_batch, new_outputs = self._prefill(admitted)
            self.batch = RunningBatch.concatenate([self.batch, new_batch])
            outputs += new_outputs
        if self.batch is not None:
            self._update_from_output(outputs)

    # -- model calls, each isolating failures per job ------------------------------------------------

    def _decode(self, batch: RunningBatch) -> list[Output]:
        """One step of the running rows: a plain decode step, or a verification step when a job drafted."""
        cache = batch.cache
        snapshot = cache.snapshot()
        drafts = drafts_for(batch.jobs)
        vocabulary = _searched_vocabulary(batch, drafts is None)
        if drafts is None:  # the beams' shared positions read once (a verification step: every row its own)
            batch.share_beam_prefixes()
        else:
            cache.share_beam_prefix(None, 0)
        try:
            if drafts is None:
                logits = self._call_model(batch.jobs, batch.adapter_rows(), self._step_fn(batch, vocabulary, 1),
                                          batch.tokens, cache, vocabulary)
            else:
                fed = fed_tokens(batch, drafts)
                logits = self._call_model(batch.jobs, batch.adapter_rows(),
                                          self._step_fn(batch, batch.vocabulary, fed.shape[1]), fed, cache,
                                          batch.vocabulary)
        except Exception as exc:
            # Nothing was committed (lengths advance last), so the rows can be replayed job by job.
            cache.rollback(snapshot)
            logger.warning("model %r: decode step of %d jobs failed (%s); retrying one by one",
                           self.name, len(batch.jobs), exc)
            return self._decode_alone(batch)
        self.metrics.batch_size.labels(self.name).observe(batch.rows)
        return self._split(batch.jobs, logits, drafts)

    def _step_fn(self, batch: RunningBatch, vocabulary: VocabularyRestriction | None, tokens: int) -> Callable:
        """The runner's decode (``tokens`` 1) or verify, or the static step's when it holds this step (counted by
        path in the metrics)."""
        static = self.static
        eager = self.runner.decode if tokens == 1 else self.runner.verify
        if static is None:
            return eager
        fallback = static.fallback(batch.cache, vocabulary, tokens)
        static.count(fallback or "static")
        if fallback:
            return eager
        return partial(static.decode if tokens == 1 else static.verify, adapters=batch.adapter_rows())

    def _decode_alone(self, batch: RunningBatch) -> list[Output]:
        survivors, outputs = [], []
        for job in batch.jobs:
            sub = batch.sub(job)
            job.search.vocabulary = None  # full-width logits alone
            try:
                logits = self._call_model([job], sub.adapter_rows(), self.runner.decode, sub.tokens, sub.cache,
                                          sub.vocabulary)
            except Exception as exc:
                logger.exception("model %r: request %r failed in a decode step", self.name, job.id)
                self._finish(job, exc=self._failure(job, exc))
                continue
            self.metrics.batch_size.labels(self.name).observe(sub.rows)
            survivors.append(sub)
            outputs += self._split([job], logits)
        self.batch = RunningBatch.concatenate(survivors)
        return outputs

    def _prefill(self, jobs: list[GenerationJob]) -> tuple[RunningBatch | None, list]:
        prompts = [p for job in jobs for p in job.prompts]
        targets = [t for job in jobs for t in job.targets]
        rows = [a for job in jobs for a in [internal_name(job)] * len(job.prompts)]
        restricted = [job.use_vmap for job in jobs for _ in job.prompts]
        forced = [token for job in jobs for token in job.forced]  # a target language's token, BART's <s>
        try:
            vocabulary = self.runner.vocabulary(prompts, restricted, targets, forced)
            logits, cache = self._call_model(jobs, rows, self.runner.prefill, prompts, rows, targets, vocabulary)
        except Exception as exc:
            if len(jobs) == 1:
                logger.exception("model %r: request %r failed in prefill", self.name, jobs[0].id)
                self._finish(jobs[0], exc=self._failure(jobs[0], exc))
                return None, []
            logger.warning("model %r: prefill of %d jobs failed (%s); retrying one by one", self.name, len(jobs), exc)
            parts = [self._prefill([job]) for job in jobs]
            return RunningBatch.concatenate([b for b, _ in parts]), [o for _, out in parts for o in out]
        self.metrics.batch_size.labels(self.name).observe(len(prompts))
        self._prefix_cache_metrics()
        return RunningBatch(jobs, cache, vocabulary=vocabulary), self._split(jobs, logits, forced=forced)

    def _prefix_cache_metrics(self) -> None:
        store = self.runner.prefix_cache
        if store is None:
            return
        seen = self._prefix_seen
        self._prefix_seen = (store.stats.queried_tokens, store.stats.hit_tokens)
        self.metrics.prefix_cache_queries.labels(self.name).inc(self._prefix_seen[0] - seen[0])
        self.metrics.prefix_cache_hits.labels(self.name).inc(self._prefix_seen[1] - seen[1])
        self.metrics.prefix_cache_bytes.labels(self.name).set(store.nbytes)

    def _split(self, jobs: list[GenerationJob], logits: torch.Tensor,
               drafts: list[list[int] | None] | None = None, forced: list[int | None] | None = None) -> list[Output]:
        """Per-job logits slices ((rows, V), or (rows, t, V) after a verification step), whether they are all
        finite (one device sync per model call), and the job's draft. ``forced``: a prefill's forced first token per
        row (model.search.force_first_tokens), applied after the model's own logits are checked."""
        # A position's largest logit is finite exactly when it has no NaN (max propagates it), no +inf and at least
        # one token allowed: -inf is a token ruled out (a vocabulary map, a bias), not a fault. One reduction.
        finite = torch.isfinite(logits.amax(dim=-1)).reshape(logits.shape[0], -1).all(dim=-1).tolist()
        if forced is not None and any(token is not None for token in forced):
            logits = force_first_tokens(logits, forced)
        out, offset = [], 0
        for i, job in enumerate(jobs):
            rows = job.search.num_rows
            draft = drafts[i] if drafts is not None else None
            out.append((job, logits[offset: offset + rows], all(finite[offset: offset + rows]), draft))
            offset += rows
        return out

    # -- advancing the searches ----------------------------------------------------------------------

    def _update_from_output(self, outputs: list[Output]) -> None:
        batch, now = self.batch, time.monotonic()
        index, tails, tokens, keep, offset = [], [], [], [], 0
        excess: list[int] = []  # per row, verified positions it does not keep (a verification step's rows)
        for job, logits, finite, draft in outputs:
            rows, step = logits.shape[0], job.search.step
            verified = logits.dim() == 3
            try:
                if not finite:
                    adapter = f" (adapter {job.adapter_name!r})" if job.adapter is not None else ""
                    raise FloatingPointError(f"the model produced non-finite logits{adapter}")
                if draft is not None and verified:
                    verdict = verify(job.search, logits[0, : 1 + len(draft)], draft)
                    picked, accepted, next_tokens = verdict.tokens, verdict.accepted, verdict.next_token
                    parents = torch.zeros(1, dtype=torch.long, device=logits.device)
                    self._speculation_metrics(len(draft), accepted)
                else:
                    step_logits = logits[:, 0] if verified else logits
                    # A translation's forced first token (prefill forced it) is not text: its rows' grammars wait.
                    held = [t is not None for t in job.forced] if step == 0 else None
                    if job.matchers is not None:
                        step_logits = job.matchers.mask(step_logits, held)
                    next_tokens, parents = job.search.advance(step_logits)
                    if job.matchers is not None and not job.search.done:
                        job.matchers.advance(next_tokens, parents, held)
                    accepted = 0
                    # Read back (a device sync) only for a stream or a drafter: one input, one row.
                    picked = next_tokens[:1].tolist() if job.stream is not None or job.drafter is not None else []
            except Exception as exc:
                logger.error("model %r: request %r failed: %s", self.name, job.id, exc)
                self._finish(job, exc=self._failure(job, exc))
                offset += rows
                excess += [0] * rows
                continue
            excess += [logits.shape[1] - 1 - accepted if verified else 0] * rows
            self._token_metrics(job, rows * (job.search.step - step), now)
            if job.stream is not None and job.config.strategy != Strategy.BEAM:
                for i, token in enumerate(picked):  # a finishing token comes with the final event
                    job.emit(job.stream.feed(token, self._stream_logprobs(job, token, step + i)))
            if job.search.done:
                self._complete(job)
            else:
                if job.drafter is not None:
                    for token in picked:
                        job.drafter.append(token)
                index.append(parents + offset)
                tails.append(job.search.tails)
                tokens.append(next_tokens)
                keep.append(job)
            offset += rows
        if not keep:
            self.batch = None
            return
        if any(excess):  # forget the rejected draft positions (before select reorders the rows)
            batch.cache.truncate(batch.cache.lengths - torch.tensor(excess, device=batch.cache.lengths.device))
        parts, index, rows = index, torch.cat(index), batch.rows  # rows before select: select shrinks the cache
        if index.numel() != rows or not torch.equal(index, torch.arange(rows, device=index.device)):
            in_place = (index.numel() < rows and self.static is not None and batch.vocabulary is None
                        and self.static.decoder.keep_rows(batch.cache, index))  # rows left the static buffers
            if not in_place:
                batch.select(index, _tails(tails, parts, batch.cache.max_length) if index.numel() == rows else None)
                if index.numel() < rows:
                    compact(batch.cache)
        batch.jobs, batch.tokens = keep, torch.cat(tokens)

    def _stream_logprobs(self, job: GenerationJob, token: int, position: int) -> list | None:
        """The log-prob entry of a streamed sequence's token at ``position`` (one input, one sequence: slot 0)."""
        if job.config.logprobs is None:
            return None
        token_lp, top = job.search.alternatives(0, position, position + 1)
        return logprob_entries([token], token_lp, top, self.tokenizer.decode)

    def _speculation_metrics(self, drafted: int, accepted: int) -> None:
        self._drafted.inc(drafted)
        self._accepted.inc(accepted)

    def _token_metrics(self, job: GenerationJob, rows: int, now: float) -> None:
        counter = self._generated.get(job.adapter_name)
        if counter is None:
            counter = self._generated[job.adapter_name] = self.metrics.generation_tokens.labels(
                self.name, adapter_label(job.adapter_name))
        counter.inc(rows)
        job.generated_tokens += rows
        if job.last_token_at is None:
            job.first_token_at = now
            self._ttft.observe(now - job.arrival)
        else:
            self._itl.observe(now - job.last_token_at)
        job.last_token_at = now

    def _complete(self, job: GenerationJob) -> None:
        results = job.search.results()
        if job.stream is not None:
            job.emit(final_stream_event(results, job.stream, job.config.strategy == Strategy.BEAM, job.constraint,
                                        job.forced[0]))
        self._finish(job, generate_outputs(results, self.tokenizer.decode, job.stops,
                                           many=job.config.num_return_sequences > 1, targets=job.targets,
                                           protected=job.protected, constraint=job.constraint, forced=job.forced))


def _tails(tails: list[torch.Tensor | None], parts: list[torch.Tensor], everything: int) -> torch.Tensor:
    """The batch's rows' :attr:`model.decoding.Search.tails`, job by job (``parts``: each job's index), all of a
    job's positions where its search gives none."""
    return torch.cat([t if t is not None else torch.full_like(part, everything) for t, part in zip(tails, parts,
                                                                                                   strict=True)])


def _searched_vocabulary(batch: RunningBatch, plain: bool) -> VocabularyRestriction | None:
    """The restriction a decode step of ``batch`` computes (``plain``: no job drafted, so no verification step):
    compact (rows, U) logits over the batch's union (model.restricted_vocab; the union changes only as the batch
    does) where every job's search reads them (model.search.Search.reads_compact_logits: no history rule, no
    log-probs), no grammar masks them by token id and the union holds every finish token; else the full width. Each
    job's search is told which, so its logit_space maps columns back to token ids."""
    vocabulary, jobs = batch.vocabulary, batch.jobs
    if vocabulary is not None and plain and all(j.search.reads_compact_logits and j.matchers is None for j in jobs):
        vocabulary = vocabulary.compacted(sorted({t for job in jobs for t in job.search.config.finish_token_ids}))
    searched = vocabulary if vocabulary is not None and vocabulary.compact else None
    for job in jobs:
        job.search.vocabulary = searched
    return vocabulary
