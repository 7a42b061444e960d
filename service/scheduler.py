"""Batching on one worker thread per model; continuous batching of generation.

Every model call happens on the worker thread (adapter loads and unloads too, between steps), under
``torch.inference_mode``; the event loop only enqueues jobs and awaits their futures.

Generation (``GenerationScheduler``) is iteration-level batching in vLLM's ``schedule()`` /
``update_from_output()`` shape over a TGI-style ``RunningBatch`` (``filter`` / ``concatenate``):

1. drop running jobs that were cancelled or passed their deadline (``filter``: their rows leave);
2. admit waiting jobs FIFO while their *maximum* rows (beams expand after the first step) fit in
   ``max_batch_size`` (a job larger than that runs when the batch is empty, alone);
3. one decode step for all running rows, with per-row LoRA adapters;
4. prefill the admitted jobs together (the family's ``GenerationRunner``, service/runners.py) and
   ``KVCache.concat`` their rows after the running ones;
5. each job's Search advances on its slice of the logits; parent rows become one global index and
   ``cache.select`` applies it, so finished jobs' rows leave at once and their futures resolve.

Failures stay with their job: logits are checked for non-finite values per job (a poisoned adapter
fails only its jobs); a model call that raises is retried job by job on copies of the pre-step cache
(``_decode_alone``), so only the culprit fails with EngineFailure and the others carry on.
Classification and embedding use dynamic batching instead (``PoolingScheduler``, service/pooling.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from model.decoding import make_search
from model.generation import stop_strings
from model.lora import set_adapters
from model.speculative import verify
from model.tokenizer import Tokenizer
from service.adapters import AdapterRegistry
from service.batch import RunningBatch, compact, internal_name
from service.errors import EngineFailure, NotReady, QueueFull, ServiceError
from service.jobs import CallJob, GenerationJob, Job, final_stream_event, generate_outputs, logprob_entries
from service.metrics import Metrics, adapter_label
from service.runners import GenerationRunner
from service.speculation import drafts_for, fed_tokens, start_drafter
from service.threads import use_threads
from service.types import EngineSettings

logger = logging.getLogger(__name__)

FaultHook = Callable[[list[str]], None]  # called with the job ids of every model call (tests inject faults)
# A model call's share for one job: its logits ((rows, V), or (rows, t, V) after a verification step), whether they
# are finite, and the draft it verified (None: none).
Output = tuple[GenerationJob, torch.Tensor, bool, list[int] | None]


class Scheduler:
    """A model's worker thread: a bounded FIFO of jobs, control calls between steps, and the step loop."""

    def __init__(self, name: str, model: nn.Module, settings: EngineSettings, metrics: Metrics,
                 registry: AdapterRegistry) -> None:
        self.name = name
        self.model = model
        self.settings = settings
        self.metrics = metrics
        self.registry = registry
        self.fault_hook: FaultHook | None = None
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._controls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._accepting = True
        self._stopping: ServiceError | None = None
        self._latency = 1.0  # moving average of job latency (s), for retry_after
        self._outbox: list[tuple[Job, Any, BaseException | None]] = []  # delivered after the step's bookkeeping
        self._taken: list[Job] = []  # jobs taken off the queue by the current iteration
        self._stepping = False  # an iteration is under way (its jobs may be neither waiting nor running)
        self._routing: tuple | None = None  # (registry.changes, per-row adapters) of the last set_adapters
        self._thread = threading.Thread(target=self._loop, name=f"tserve-{name}", daemon=True)
        self._threads: int | None = None  # intra-op threads of the worker thread (start)

    # ---- event loop side ------------------------------------------------------------------------

    def start(self, threads: int | None = None) -> None:
        """Start the worker thread; ``threads``: its intra-op threads (None: leave torch's setting)."""
        self._threads = threads
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Enqueue ``job``; raises NotReady when closed, QueueFull (at once) when max_queue jobs wait."""
        with self._cond:
            if not self._accepting:
                raise NotReady(f"model {self.name!r} is not accepting requests (shutting down)")
            retry = round(min(30.0, max(0.1, self._latency * len(self._waiting) / self.settings.max_batch_size)), 2)
            if len(self._waiting) >= self.settings.max_queue:
                raise QueueFull(f"model {self.name!r}: {len(self._waiting)} requests are waiting "
                                f"(max_queue={self.settings.max_queue}); retry later", retry_after=retry)
            cap, client = self.settings.max_queue_per_key, job.queue.client
            if cap is not None and client is not None and sum(j.queue.client == client for j in self._waiting) >= cap:
                raise QueueFull(f"model {self.name!r}: {cap} requests of this API key are waiting "
                                f"(max_queue_per_key={cap}); retry later", retry_after=retry)
            self._waiting.append(job)
            self.metrics.waiting.labels(self.name).set(len(self._waiting))
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the worker thread before its next step (adapter loads, test hooks)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping is not None:
                raise NotReady(f"model {self.name!r} is shutting down")
            self._controls.append((fn, future))
            self._cond.notify()
        return future

    @property
    def num_waiting(self) -> int:
        """Jobs queued and not yet taken by the worker thread."""
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Jobs waiting or running."""
        with self._cond:
            return bool(self._waiting) or self._stepping or self.num_running > 0

    @property
    def num_running(self) -> int:
        return sum(not job.done for job in self._taken)

    def close(self) -> None:
        """Refuse new jobs (NotReady); queued and running ones carry on."""
        with self._cond:
            self._accepting = False
            self._cond.notify()

    def stop(self, reason: ServiceError, timeout: float | None = None) -> None:
        """Fail whatever is left with ``reason`` and end the thread (blocking: call off the event loop)."""
        with self._cond:
            self._accepting = False
            self._stopping = reason
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- worker thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        if self._threads is not None:
            use_threads(self._threads)
        while True:
            with self._cond:
                while not self._controls and self._stopping is None:
                    ready, timeout = self._ready(time.monotonic())
                    if ready:
                        break
                    self._cond.wait(timeout)
                controls = list(self._controls)
                self._controls.clear()
                stopping = self._stopping
                self._stepping = stopping is None
            for fn, future in controls:
                self._run_control(fn, future)
            if stopping is not None:
                self._abort(stopping)
                self._deliver()
                return
            try:
                with torch.inference_mode():
                    self._iteration()
            except Exception as exc:  # never let the thread die: fail what was running, keep serving
                logger.exception("model %r: step failed outside any single request", self.name)
                self._abort_running(exc)
            try:
                self.registry.collect()  # versions replaced or unloaded whose last job just left
            except Exception:
                logger.exception("model %r: removing retired adapters failed", self.name)
            self._deliver()
            with self._cond:
                self._stepping = False

    def _run_control(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with torch.no_grad():
                future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    def _ready(self, now: float) -> tuple[bool, float | None]:
        """Whether to step now; else how long to wait for more jobs (deadline-based collate)."""
        if self.num_running:
            return True, None
        if not self._waiting:
            return False, None
        waited = now - self._waiting[0].arrival
        max_wait = self.settings.max_wait_ms / 1000
        if waited >= max_wait or not self._accepting or sum(j.rows for j in self._waiting) >= \
                self.settings.max_batch_size:
            return True, None
        return False, max_wait - waited

    def _take(self, budget: int, alone_ok: bool) -> list[Job]:
        """Take waiting jobs, lowest priority value first and FIFO within one, while their rows fit ``budget``
        (the first that does not fit stops the taking); dead ones are failed or dropped."""
        now = time.monotonic()
        taken: list[Job] = []
        with self._cond:
            alive = []
            for job in self._waiting:  # purge the whole queue: a waiting job's deadline also counts
                if job.cancelled or job.expired(now):
                    self._finish(job, exc=job.timeout_error())
                else:
                    alive.append(job)
            order = sorted(alive, key=lambda j: j.queue.priority)  # stable: arrival order within a priority
            for job in order:
                if job.rows > budget and not (alone_ok and not taken):
                    break
                taken.append(job)
                budget -= job.rows
                alone_ok = False
            chosen = {id(j) for j in taken}
            self._waiting = deque(j for j in alive if id(j) not in chosen)
            self.metrics.waiting.labels(self.name).set(len(self._waiting))
        self._taken = taken
        return taken

    def _admit(self, job: Job) -> bool:
        """Make the job's adapter resident; False (job failed) when that is impossible."""
        job.admitted_at = time.monotonic()
        self.metrics.queue_time.labels(self.name, job.endpoint).observe(job.admitted_at - job.arrival)
        if job.adapter is not None:
            try:
                self.registry.ensure_resident(job.adapter)
            except ServiceError as exc:
                self._finish(job, exc=exc)
                return False
        return True

    def _run_call(self, job: CallJob) -> None:
        if not self._admit(job):
            return
        try:
            set_adapters(self.model, None)
            self._routing = None
            if self.fault_hook is not None:
                self.fault_hook([job.id])
            value = job.fn()
        except ServiceError as exc:
            self._finish(job, exc=exc)
        except Exception as exc:
            logger.exception("model %r: request %r failed", self.name, job.id)
            self._finish(job, exc=self._failure(job, exc))
        else:
            self._finish(job, value)

    def _call_model(self, jobs: list[Job], adapter_rows: list[str | None], fn: Callable, *args: Any) -> Any:
        """One model call for ``jobs``; rows select their adapters (None = base)."""
        if self.fault_hook is not None:
            self.fault_hook([j.id for j in jobs])
        # set_adapters walks every module (~50-200 us): skip it when neither the rows nor the model changed.
        key = (self.registry.changes, tuple(adapter_rows) if any(a is not None for a in adapter_rows) else None)
        if key != self._routing:
            set_adapters(self.model, list(key[1]) if key[1] is not None else None)
            self._routing = key
        return fn(*args)

    def _finish(self, job: Job, value: Any = None, exc: BaseException | None = None) -> None:
        """Unpin ``job``'s adapter and queue its result for delivery at the end of the step (exactly once)."""
        if job.done:
            return
        job.done = True
        if job.adapter is not None:
            self.registry.release(job.adapter)
        self._outbox.append((job, value, exc))
        if exc is None:
            latency = time.monotonic() - job.arrival
            self._latency = 0.9 * self._latency + 0.1 * latency
            self.metrics.e2e_latency.labels(self.name, job.endpoint).observe(latency)

    def _deliver(self) -> None:
        """Hand results to the event loop once the step's rows are freed (so they are when a caller wakes)."""
        outbox, self._outbox = self._outbox, []
        for job, value, exc in outbox:
            if exc is not None:
                job.fail(exc)
            else:
                job.resolve(value)

    @staticmethod
    def _failure(job: Job, exc: BaseException | str) -> EngineFailure:
        return EngineFailure(f"request {job.id!r} failed in the engine: {exc}", request_id=job.id)

    def _abort(self, reason: ServiceError) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            controls, self._controls = list(self._controls), deque()
        for job in waiting:
            self._finish(job, exc=reason)
        for _, future in controls:
            future.set_exception(reason)
        self._abort_running(reason)
        self.metrics.waiting.labels(self.name).set(0)

    def _abort_running(self, exc: BaseException) -> None:
        """Fail every running job (each with its own EngineFailure when ``exc`` is not a ServiceError)."""
        for job in self._running_jobs():
            self._finish(job, exc=exc if isinstance(exc, ServiceError) else self._failure(job, exc))
        self._taken = []
        self.metrics.running.labels(self.name).set(0)

    def _running_jobs(self) -> list[Job]:
        return [job for job in self._taken if not job.done]

    def _iteration(self) -> None:
        raise NotImplementedError


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
        self._generated: dict[str | None, Any] = {}  # adapter -> tserve_generation_tokens_total child
        self._prefix_seen = (0, 0)  # the prefix cache's (queried, hit) tokens already counted in metrics

    @property
    def num_running(self) -> int:
        batch = self.batch
        return len(batch.jobs) if batch is not None else 0

    def _running_jobs(self) -> list[Job]:
        batch, self.batch = self.batch, None
        running = batch.jobs if batch is not None else []
        return running + [job for job in self._taken if not job.done and job not in running]

    @property
    def num_rows(self) -> int:
        batch = self.batch
        return batch.rows if batch is not None else 0

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
        start_drafter(job, self.runner.draft_source(job.prompts[0], job.targets[0]))
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
        try:
            if drafts is None:
                logits = self._call_model(batch.jobs, batch.adapter_rows(), self.runner.decode, batch.tokens, cache)
            else:
                fed = fed_tokens(batch, drafts)
                logits = self._call_model(batch.jobs, batch.adapter_rows(), self.runner.verify, fed, cache)
        except Exception as exc:
            # Nothing was committed (lengths advance last), so the rows can be replayed job by job.
            cache.rollback(snapshot)
            logger.warning("model %r: decode step of %d jobs failed (%s); retrying one by one",
                           self.name, len(batch.jobs), exc)
            return self._decode_alone(batch)
        self.metrics.batch_size.labels(self.name).observe(batch.rows)
        return self._split(batch.jobs, logits, drafts)

    def _decode_alone(self, batch: RunningBatch) -> list[Output]:
        survivors, outputs = [], []
        for job in batch.jobs:
            sub = batch.sub(job)
            try:
                logits = self._call_model([job], sub.adapter_rows(), self.runner.decode, sub.tokens, sub.cache)
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
        try:
            logits, cache = self._call_model(jobs, rows, self.runner.prefill, prompts, rows, targets)
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
        return RunningBatch(jobs, cache), self._split(jobs, logits)

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
               drafts: list[list[int] | None] | None = None) -> list[Output]:
        """Per-job logits slices ((rows, V), or (rows, t, V) after a verification step), whether they are all
        finite (one device sync per model call), and the job's draft."""
        # A row's sum is finite exactly when all its logits are (a NaN or an infinity carries through a sum; finite
        # logits cannot overflow it): one reduction instead of a (rows, V) mask.
        finite = torch.isfinite(logits.reshape(logits.shape[0], -1).sum(dim=-1)).tolist()
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
        index, tokens, keep, offset = [], [], [], 0
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
                    if job.matchers is not None:
                        step_logits = job.matchers.mask(step_logits)
                    next_tokens, parents = job.search.advance(step_logits)
                    if job.matchers is not None and not job.search.done:
                        job.matchers.advance(next_tokens, parents)
                    picked, accepted = next_tokens[:1].tolist(), 0
            except Exception as exc:
                logger.error("model %r: request %r failed: %s", self.name, job.id, exc)
                self._finish(job, exc=self._failure(job, exc))
                offset += rows
                excess += [0] * rows
                continue
            excess += [logits.shape[1] - 1 - accepted if verified else 0] * rows
            self._token_metrics(job, rows * (job.search.step - step), now)
            if job.stream is not None and job.config.strategy != "beam":
                for i, token in enumerate(picked):  # a finishing token comes with the final event
                    job.emit(job.stream.feed(token, self._stream_logprobs(job, token, step + i)))
            if job.search.done:
                self._complete(job)
            else:
                if job.drafter is not None:
                    for token in picked:
                        job.drafter.append(token)
                index.append(parents + offset)
                tokens.append(next_tokens)
                keep.append(job)
            offset += rows
        if not keep:
            self.batch = None
            return
        if any(excess):  # forget the rejected draft positions (before select reorders the rows)
            batch.cache.truncate(batch.cache.lengths - torch.tensor(excess, device=batch.cache.lengths.device))
        index, rows = torch.cat(index), batch.rows  # rows before select: select shrinks the cache
        if index.numel() != rows or not torch.equal(index, torch.arange(rows, device=index.device)):
            batch.cache.select(index)
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
        self.metrics.spec_draft_tokens.labels(self.name).inc(drafted)
        self.metrics.spec_accepted_tokens.labels(self.name).inc(accepted)

    def _token_metrics(self, job: GenerationJob, rows: int, now: float) -> None:
        counter = self._generated.get(job.adapter_name)
        if counter is None:
            counter = self._generated[job.adapter_name] = self.metrics.generation_tokens.labels(
                self.name, adapter_label(job.adapter_name))
        counter.inc(rows)
        if job.last_token_at is None:
            self._ttft.observe(now - job.arrival)
        else:
            self._itl.observe(now - job.last_token_at)
        job.last_token_at = now

    def _complete(self, job: GenerationJob) -> None:
        results = job.search.results()
        if job.stream is not None:
            job.emit(final_stream_event(results, job.stream, job.config.strategy == "beam"))
        self._finish(job, generate_outputs(results, self.tokenizer.decode, job.stops,
                                           many=job.config.num_return_sequences > 1, targets=job.targets))
