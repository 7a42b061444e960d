"""Helpers shared by test modules: waiting on the engine's worker thread by events, the error shape, and the
generate calls, output comparisons and adapter uploads of the HTTP tests.

Tests decide by events, not by the clock. A model's worker thread is held at a known point in two ways:

- ``block_worker(worker)`` parks it between iterations (a control call that waits on an Event), so
  requests queue up and the worker takes them together once released;
- ``StepGate(scheduler)`` is a fault hook that parks it before model calls, so a test holds a running
  batch, looks at it, and lets it go one model call at a time (``step``) or for good (``release``).

``wait_until`` polls state the worker thread changes; its timeout is a safety net that only fails a
test whose condition never comes true.
"""

from __future__ import annotations

import asyncio
import io
import tarfile
import threading
import time
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

T = TypeVar("T")

SAFETY_S = 30.0  # how long a wait may take before the test fails: never reached when the condition comes true


async def wait_until(predicate: Callable[[], object], timeout_s: float = SAFETY_S) -> None:
    """Return once ``predicate()`` is true, polling while the event loop runs."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


async def settle() -> None:
    """Let the event loop run what the worker thread handed it (results of jobs and controls) before it parked.

    A result reaches a task through a few chained callbacks, each one loop pass; ten passes are plenty."""
    for _ in range(10):
        await asyncio.sleep(0)


def block_worker(worker) -> threading.Event:
    """Park ``worker``'s thread between iterations until the returned event is set: requests only queue."""
    release = threading.Event()
    worker.scheduler.call(lambda: release.wait(SAFETY_S))
    return release


async def gather_queued(worker, requests: list[Awaitable[T]], return_exceptions: bool = False) -> list[T]:
    """Await ``requests`` (each one job for ``worker``) once all of them are queued, so that the worker takes
    them in one iteration (as many as max_batch_size lets in), whatever the machine's speed."""
    release = block_worker(worker)
    tasks = [asyncio.ensure_future(r) for r in requests]
    await wait_until(lambda: worker.scheduler.num_waiting == len(tasks) or any(t.done() for t in tasks))
    release.set()
    return await asyncio.gather(*tasks, return_exceptions=return_exceptions)


class StepGate:
    """A scheduler fault hook that parks the worker thread before model calls until the test lets it go.

    ``StepGate(scheduler, when)`` installs itself as ``scheduler.fault_hook``; the worker parks before every
    model call whose job ids satisfy ``when`` (default: every call) and ``parked`` turns true. ``step()`` lets
    that one call through (the worker parks at the next matching call), ``release()`` every call from then on.
    Controls (``scheduler.call``: adapter loads) run between iterations, so only while the worker is let go.
    A later gate replaces an earlier one: installed while the worker is parked, it holds the next call.
    """

    def __init__(self, scheduler, when: Callable[[list[str]], bool] | None = None) -> None:
        self._when = when or (lambda ids: True)
        self._cond = threading.Condition()
        self._parked = False
        self._tickets = 0
        self._open = False
        self.ids: list[str] = []  # the job ids of the call parked last
        scheduler.fault_hook = self

    def __call__(self, ids: list[str]) -> None:
        with self._cond:
            if self._open or not self._when(ids):
                return
            self.ids, self._parked = list(ids), True
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._open or self._tickets > 0, SAFETY_S):
                self._parked = False
                raise RuntimeError("StepGate: the test never let the worker go")
            self._tickets = max(0, self._tickets - 1)

    @property
    def parked(self) -> bool:
        with self._cond:
            return self._parked

    def step(self) -> bool:
        """Let the parked call through (False, and nothing done, when the worker is not parked)."""
        with self._cond:
            if not self._parked:
                return False
            self._parked = False
            self._tickets += 1
            self._cond.notify_all()
            return True

    def release(self) -> None:
        """Let every call through from now on."""
        with self._cond:
            self._open, self._parked = True, False
            self._cond.notify_all()

    def wait_parked(self, timeout_s: float = SAFETY_S) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._parked, timeout_s), "the worker never reached the gate"

    async def until_parked(self) -> None:
        """``wait_parked`` without stopping the event loop."""
        await asyncio.to_thread(self.wait_parked)


async def step_until(gate: StepGate, condition: Callable[[], bool]) -> None:
    """Let the worker through one model call at a time until ``condition()`` holds while it is parked."""
    await gate.until_parked()
    while not condition():
        gate.step()
        await gate.until_parked()


async def stepping(gate: StepGate, awaitable: Awaitable[T], timeout_s: float = SAFETY_S) -> T:
    """Await ``awaitable`` while letting the worker through one model call at a time, only as many as it needs."""
    task = asyncio.ensure_future(awaitable)
    await settle()  # it starts: what it queues for the worker is queued before the worker moves on
    deadline = time.monotonic() + timeout_s
    while not task.done():
        assert time.monotonic() < deadline, "the awaited request never finished"
        if gate.parked:
            await settle()  # a result handed over before the worker parked again is seen before stepping
            if not task.done():
                gate.step()
        await asyncio.wait([task], timeout=0.002)
    return task.result()


def on_stop(scheduler, fn: Callable[[], Any]) -> None:
    """Call ``fn`` once ``scheduler.stop`` has marked the scheduler stopping, before it waits for the thread: a
    gate opened by ``fn`` then lets a held step finish into the stop, never into more steps."""
    real_stop = scheduler.stop

    def stop(reason, timeout: float | None = None) -> None:
        real_stop(reason, 0)  # marks it stopping; joining the thread for 0 s returns at once
        fn()
        real_stop(reason, timeout)

    scheduler.stop = stop


def error_of(r: httpx.Response, status: int, code: str | None = None) -> dict:
    """The response's error, after checking the one shape every failure has."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "field", "request_id"}
    assert body["error"]["request_id"] == r.headers["x-request-id"] and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def generate(client: httpx.Client, model: str, **body) -> dict:
    r = client.post(f"/v1/models/{model}/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_outputs(got: list, expected: list) -> None:
    """Equal texts, tokens and finish reasons; scores equal up to float rounding (batching reorders sums)."""
    strip = [[{k: v for k, v in o.items() if k != "score"} for o in outs] for outs in got]
    assert strip == [[{k: v for k, v in o.items() if k != "score"} for o in outs] for outs in expected]
    scores = [o["score"] for outs in got for o in outs]
    assert scores == pytest.approx([o["score"] for outs in expected for o in outs], abs=1e-4)


def archive(directory: Path, kind: str) -> bytes:
    """The files of ``directory`` as an upload body: a zip (``kind`` "zip") or a tar.gz."""
    buf = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buf, "w") as z:
            for f in sorted(directory.iterdir()):
                z.write(f, f.name)
    else:
        with tarfile.open(fileobj=buf, mode="w:gz") as t:
            t.add(directory, arcname=".")
    return buf.getvalue()
