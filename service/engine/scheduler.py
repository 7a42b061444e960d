"""Batching on one worker thread per model: the queue, the control calls and the step loop every family shares.

Every model call happens on the worker thread (adapter loads and unloads too, between steps), under
``torch.inference_mode``; the event loop only enqueues jobs and awaits their futures. Waiting jobs are taken
lowest ``priority`` first; within one, API keys take turns (``fair_order``: vLLM's fair scheduling), FIFO per key.
A queue holds at most ``max_queue`` waiting jobs, and one API key at most ``max_queue_per_key`` waiting or running
jobs. Generation is continuous batching (``GenerationScheduler``,
service/engine/continuous_batching.py); classification and embedding use dynamic batching (``PoolingScheduler``,
service/engine/pooling.py).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from model.constraints import ConstraintError
from model.lora import set_adapters
from service.engine.adapters import AdapterRegistry
from service.engine.errors import EngineFailure, InvalidRequest, NotReady, QueueFull, ServiceError
from service.engine.jobs import CallJob, Job
from service.engine.metrics import Metrics
from service.engine.threads import use_threads
from service.engine.types import EngineSettings

logger = logging.getLogger(__name__)

FaultHook = Callable[[list[str]], None]  # called with the job ids of every model call (tests inject faults)
FaultHookFactory = Callable[["Scheduler"], FaultHook | None]  # a new scheduler -> its first fault hook
_fault_hook_factory: FaultHookFactory | None = None


def install_fault_hooks(factory: FaultHookFactory | None) -> None:
    """Give every Scheduler built from now on ``factory(scheduler)`` as its ``fault_hook`` (None: no hook).

    For a process that wraps ``python -m service`` to hold or break its model calls (tests/reliability/
    gated_server.py, deploy/podman/gated_service.py): the engine builds its schedulers in the app's lifespan, out of
    the wrapper's reach. ``factory`` runs at the end of ``Scheduler.__init__`` (before a subclass sets its own
    fields). A test holding a scheduler sets its ``fault_hook`` directly."""
    global _fault_hook_factory
    _fault_hook_factory = factory


class Scheduler:
    """A model's worker thread: a bounded FIFO of jobs, control calls between steps, and the step loop."""

    static = None  # the generation scheduler's static decoding step (service.engine.static_decoding), if on

    def __init__(self, name: str, model: nn.Module, settings: EngineSettings, metrics: Metrics,
                 registry: AdapterRegistry) -> None:
        self.name = name
        self.model = model
        self.settings = settings
        self.metrics = metrics
        self.registry = registry
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._held: Counter[str] = Counter()  # per API key digest, its jobs waiting or running (max_queue_per_key)
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
        self.fault_hook: FaultHook | None = _fault_hook_factory(self) if _fault_hook_factory is not None else None

    # ---- event loop side ------------------------------------------------------------------------

    def start(self, threads: int | None = None) -> None:
        """Start the worker thread; ``threads``: its intra-op threads (None: leave torch's setting)."""
        self._threads = threads
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Enqueue ``job``; raises NotReady when closed, QueueFull (at once) when max_queue jobs wait or its API
        key already has max_queue_per_key jobs waiting or running."""
        with self._cond:
            if not self._accepting:
                raise NotReady(f"model {self.name!r} is not accepting requests (shutting down)")
            retry = round(min(30.0, max(0.1, self._latency * len(self._waiting) / self.settings.max_batch_size)), 2)
            if len(self._waiting) >= self.settings.max_queue:
                raise QueueFull(f"model {self.name!r}: {len(self._waiting)} requests are waiting "
                                f"(max_queue={self.settings.max_queue}); retry later", retry_after=retry)
            cap, client = self.settings.max_queue_per_key, job.queue.client
            if cap is not None and client is not None and self._held[client] >= cap:
                raise QueueFull(f"model {self.name!r}: {cap} requests of this API key are waiting or running "
                                f"(max_queue_per_key={cap}); retry later", retry_after=retry)
            self._waiting.append(job)
            if client is not None:
                self._held[client] += 1
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

    def waiting_jobs(self) -> list[Job]:
        """The queued jobs, oldest first (a copy: callable from any thread)."""
        with self._cond:
            return list(self._waiting)

    def running_jobs(self) -> list[Job]:
        """The jobs being computed (a copy: callable from any thread)."""
        return [job for job in list(self._taken) if not job.done]

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
        """Take waiting jobs in ``fair_order`` (by priority, API keys taking turns within one) while their rows fit
        ``budget`` (the first that does not fit stops the taking); dead ones are failed or dropped."""
        now = time.monotonic()
        running: Counter[str | None] = Counter()
        for job in self.running_jobs():
            running[job.queue.client] += job.rows
        taken: list[Job] = []
        with self._cond:
            alive = []
            for job in self._waiting:  # purge the whole queue: a waiting job's deadline also counts
                if job.cancelled or job.expired(now):
                    self._finish(job, exc=job.timeout_error())
                else:
                    alive.append(job)
            for job in fair_order(alive, running):
                if job.rows > budget and not (alone_ok and not taken):
                    break
                taken.append(job)
                budget -= job.rows
                alone_ok = False
            chosen = {id(j) for j in taken}
            self._waiting = deque(j for j in alive if id(j) not in chosen)
            self._taken = taken  # under the lock: a job is always waiting or taken for submit's count
            self.metrics.waiting.labels(self.name).set(len(self._waiting))
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
        job.finished_at = time.monotonic()
        if job.queue.client is not None:
            with self._cond:
                self._held[job.queue.client] -= 1
                if not self._held[job.queue.client]:
                    del self._held[job.queue.client]
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
    def _failure(job: Job, exc: BaseException | str) -> ServiceError:
        """What the client of a request that raised ``exc`` in the engine is told: a constraint the grammar library
        gave up on while decoding is the request's own fault (422), anything else a 500 naming the request."""
        if isinstance(exc, ConstraintError):
            return InvalidRequest("constraint", f"could not be followed while decoding: {exc}")
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
        for job in self.running_jobs():
            self._finish(job, exc=exc if isinstance(exc, ServiceError) else self._failure(job, exc))
        self._taken = []
        self._drop_running()
        self.metrics.running.labels(self.name).set(0)

    def _drop_running(self) -> None:
        """Forget the running work whose jobs were just failed (beyond the taken jobs: a family's own state)."""

    def _iteration(self) -> None:
        raise NotImplementedError


def fair_order(jobs: list[Job], running: Counter[str | None]) -> list[Job]:
    """``jobs`` (waiting, oldest first) in the order to take them: lowest priority value first; within a priority,
    API keys take turns, the key holding the fewest rows (``running``: rows per key already in the batch, plus those
    ordered before) next, ties to the older job. One key (or none: auth off) keeps FIFO."""
    held = Counter(running)
    levels: dict[int, dict[str | None, deque[tuple[int, Job]]]] = defaultdict(lambda: defaultdict(deque))
    for arrival, job in enumerate(jobs):
        levels[job.queue.priority][job.queue.client].append((arrival, job))
    order: list[Job] = []
    for priority in sorted(levels):
        keys = levels[priority]
        turns = [(held[key], queue[0][0], key) for key, queue in keys.items()]  # (rows held, head's arrival, key)
        heapq.heapify(turns)  # arrivals are unique: keys (None among strings) are never compared
        while turns:
            _, _, key = heapq.heappop(turns)
            _, job = keys[key].popleft()
            order.append(job)
            held[key] += job.rows
            if keys[key]:
                heapq.heappush(turns, (held[key], keys[key][0][0], key))
    return order
