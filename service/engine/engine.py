"""The serving engine: every model under the models directory loaded into a ``ModelWorker`` (service/engine/worker.py),
served under its directory name, and the named ones (Hugging Face cache snapshots, service/model_sources.py);
start-up, lookup, loading and unloading at run time, and draining. Torch only, no HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TypeVar

import torch

from model.checkpoint import Checkpoint, load_checkpoint
from model.generation_config import ConfigError
from model.lora_config import NAME_RULE, is_valid_name, quote
from model.quantize import mode_for, prepare_for_inference
from model.speculative import check_draft_model, draft_model_for
from service.engine.errors import Conflict, InvalidRequest, NotFound, NotReady
from service.engine.metrics import Metrics
from service.engine.threads import available_cores, worker_threads
from service.engine.types import EngineSettings, ModelInfo
from service.engine.worker import ModelWorker

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoadTimeout(TimeoutError):
    """A model's load did not finish within its deadline (its thread is left behind, a daemon)."""


class NoModelsLoaded(RuntimeError):
    """Start-up found nothing to serve: no model directory, or none that loaded (the message says why)."""


class Engine:
    """Every model under ``models_dir``, served under its directory name, and each of ``named`` (served name ->
    model directory) under its name."""

    def __init__(self, settings: EngineSettings, models_dir: Path | None, adapters_dir: Path | None,
                 named: dict[str, Path] | None = None) -> None:
        self.settings = settings
        self.models_dir = Path(models_dir) if models_dir is not None else None
        self.named = dict(named or {})
        self.adapters_dir = Path(adapters_dir) if adapters_dir is not None else None
        self.metrics = Metrics()
        self.ready = False
        self.load_errors: dict[str, str] = {}  # start-up failures only (a run-time load's failure is its answer)
        self._workers: dict[str, ModelWorker] = {}
        self._changes = asyncio.Lock()  # run-time loads and unloads, one at a time

    async def start(self) -> None:
        """Load every checkpoint and warm it up; a failing one is logged, skipped and reported in load_errors.

        Raises NoModelsLoaded, naming each model and its reason, when none loads (the models directory is
        missing, holds no model directories, or every one failed): a server with nothing to serve never reports
        ready.
        """
        dirs = {**self._listed(), **self.named}
        if not dirs:
            raise NoModelsLoaded(f"models directory {self.models_dir} holds no model directories")
        threads = worker_threads(self.settings.threads, len(dirs))
        if threads > 1 and threads * len(dirs) > available_cores():
            logger.warning("%d model workers x %d intra-op threads exceed the %d CPU cores: every parallel region "
                           "will wait for a sleeping thread (engine/threads.py); leave TSERVE_THREADS unset to share "
                           "the cores", len(dirs), threads, available_cores())
        for name, directory in sorted(dirs.items()):
            try:
                self._workers[name] = await self._open(name, directory, threads)
            except Exception as exc:
                logger.exception("model %r (%s) failed to load; skipped", name, directory)
                self.load_errors[name] = self._public(f"{type(exc).__name__}: {exc}")
        if not self._workers:
            reasons = "".join(f"\n  {name}: {error}" for name, error in self.load_errors.items())
            raise NoModelsLoaded(f"no model in {self.models_dir or 'the Hugging Face cache'} loaded:{reasons}")
        self.ready = True

    def _listed(self) -> dict[str, Path]:
        """The model directories under the models directory, by name (none without one); NoModelsLoaded when it
        is missing or one of its names is also a named model's."""
        if self.models_dir is None:
            return {}
        if not self.models_dir.is_dir():
            raise NoModelsLoaded(f"models directory {self.models_dir} not found")
        dirs = [p for p in self.models_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
        # A checkpoint whose save was killed between its two renames is only at .<name>.old: load_checkpoint
        # reads it from there, so list it under its name.
        interrupted = [self.models_dir / p.name[1:-4] for p in self.models_dir.glob(".?*.old") if p.is_dir()]
        listed = {d.name: d for d in (*dirs, *(d for d in interrupted if not d.exists()))}
        twice = sorted(set(listed) & set(self.named))
        if twice:
            raise NoModelsLoaded(f"model {twice[0]!r} is both a directory of {self.models_dir} and "
                                 f"{self.named[twice[0]]}: serve the repo under another name (--models NAME=ORG/REPO)")
        return listed

    async def _open(self, name: str, directory: Path, threads: int) -> ModelWorker:
        """Model ``name`` loaded from ``directory`` (within model_load_timeout_s), its worker started (``threads``
        intra-op threads) and warmed up per settings; on failure whatever started is stopped and the error raised."""
        start = time.perf_counter()
        worker = None
        try:
            checkpoint, draft = await _within(self.settings.model_load_timeout_s,
                                              functools.partial(self._load, name, directory))
            worker = ModelWorker(name, checkpoint, self.settings, self.metrics, self.adapters_dir, draft)
            await worker.start(threads)
            self.metrics.model_load_seconds.labels(name).set(time.perf_counter() - start)
            if self.settings.warmup:
                await worker.warmup()
        except BaseException:
            if worker is not None:  # started, then failed (its warm-up): its threads stop too
                await _drain([worker], 0.0, NotReady(f"model {name!r} failed to load"))
            self.metrics.remove_model(name)
            raise
        logger.info("model %r (%s, quantize %s) ready in %.2fs: %s", name, checkpoint.family,
                    mode_for(self.settings.quantize, name), time.perf_counter() - start, worker.info)
        return worker

    def _load(self, name: str, directory: Path) -> tuple[Checkpoint, Checkpoint | None]:
        """The checkpoint in ``directory``, prepared for inference as model ``name``, and its draft model
        (blocking: files, torch)."""
        checkpoint = load_checkpoint(directory, self.settings.device, self.settings.dtype)
        prepare_for_inference(checkpoint.model, mode_for(self.settings.quantize, name))
        # The tokens a stream holds (a cached scan of the vocabulary, ~2 s for 250k tokens with clean-up): found here,
        # not by the first streamed request on the event loop.
        getattr(checkpoint.tokenizer, "held_ids", None)
        return checkpoint, self._draft_for(name, checkpoint)

    def _draft_for(self, name: str, checkpoint: Checkpoint) -> Checkpoint | None:
        """The draft model (settings.draft_model) of model ``name``, loaded for it alone; raises when it cannot
        draft for it (not found, another family or tokenizer), which fails the model's load with that reason."""
        draft_name = draft_model_for(self.settings.draft_model, name, checkpoint.family)
        if draft_name is None:
            return None
        directory = self.named.get(draft_name) or (self.models_dir / draft_name if self.models_dir else None)
        if directory is None or not directory.is_dir():
            raise ConfigError("draft_model", f"draft model {draft_name!r} for {name!r} is not a model directory")
        draft = load_checkpoint(directory, self.settings.device, self.settings.dtype)
        prepare_for_inference(draft.model, mode_for(self.settings.quantize, draft_name))
        check_draft_model(checkpoint.model, checkpoint.tokenizer.backend.get_vocab(), draft.model,
                          draft.tokenizer.backend.get_vocab())
        return draft

    def _public(self, message: str) -> str:
        """``message`` with the models directory's paths made relative to it, and a named model's directory
        replaced by its name (no server paths in answers)."""
        roots = {os.path.join(d, ""): os.path.join(n, "") for n, d in self.named.items()}
        if self.models_dir is not None:
            roots.update({os.path.join(r, ""): "" for r in (self.models_dir, os.path.abspath(self.models_dir),
                                                           os.path.realpath(self.models_dir))})
        for root in sorted(roots, key=len, reverse=True):
            message = message.replace(root, roots[root])
        return message

    def get(self, model: str) -> ModelWorker:
        worker = self._workers.get(model)
        if worker is None:
            raise NotFound(f"model {model!r} not found; available: {sorted(self._workers)}")
        return worker

    def models(self) -> list[ModelInfo]:
        return [w.info for _, w in sorted(self._workers.items())]

    def workers(self) -> list[ModelWorker]:
        """The loaded models' workers, by name."""
        return [w for _, w in sorted(self._workers.items())]

    def model_directory(self, path: str) -> Path:
        """``path``, relative to the models directory, as a model directory there; InvalidRequest for an absolute
        path, a hidden or ".." part, or one whose parents lead out of the models directory through a link (the
        directory itself may be a link, as the start-up listing follows the models directory's entries)."""
        relative = PurePosixPath(path) if isinstance(path, str) and "\x00" not in path else PurePosixPath("/")
        parts = relative.parts
        if self.models_dir is None:
            raise InvalidRequest("path", "no models directory is configured (--models names only repo ids)")
        if not parts or relative.is_absolute() or any(part.startswith(".") for part in parts):
            raise InvalidRequest("path", f"{quote(path)} is not a directory name relative to the models directory "
                                         "(no absolute path, no hidden or '..' part)")
        try:
            root = self.models_dir.resolve()
            directory = root.joinpath(*parts)
            inside = directory.parent.resolve().is_relative_to(root)
        except (OSError, RuntimeError, ValueError) as exc:  # a link loop, a name too long
            raise InvalidRequest("path", f"{quote(path)}: {type(exc).__name__}") from None
        if not inside:
            raise InvalidRequest("path", f"{quote(path)} leads out of the models directory")
        return directory

    async def load_model(self, name: str, path: str) -> ModelInfo:
        """Load the model directory ``path`` (relative to the models directory) and serve it as ``name``, as
        start-up loads a model (load deadline, warm-up). InvalidRequest for a bad name or path, or a load that
        failed (the message says why; load_errors is left alone: the other models serve on), Conflict when a
        model ``name`` is served, NotReady while the engine is not running."""
        if not is_valid_name(name):
            raise InvalidRequest(None, f"model name {quote(name)} is invalid: use {NAME_RULE}")
        directory = self.model_directory(path)
        async with self._changes:
            if not self.ready:
                raise NotReady("the models are not loaded yet (or the server is shutting down)")
            if name in self._workers:
                raise Conflict(f"model {name!r} is already loaded; unload it first (DELETE /v1/models/{name})")
            try:
                worker = await self._open(name, directory, worker_threads(self.settings.threads,
                                                                           len(self._workers) + 1))
            except Exception as exc:
                logger.exception("model %r (%s) failed to load at run time", name, directory)
                raise InvalidRequest("path", f"model {name!r} did not load: "
                                             f"{self._public(f'{type(exc).__name__}: {exc}')}") from None
            if not self.ready:  # the engine stopped while it loaded: it would never be stopped
                await _drain([worker], 0.0, NotReady("the engine stopped"))
                raise NotReady("the server is shutting down")
            self._workers[name] = worker
            self.load_errors.pop(name, None)  # a start-up failure fixed and loaded
            return worker.info

    async def unload_model(self, name: str, drain_timeout_s: float) -> None:
        """Stop serving model ``name``: new requests for it are NotFound at once, in-flight ones finish within
        ``drain_timeout_s`` (then NotReady, as at shutdown), its threads stop, its metric series are removed and its
        memory is released. NotFound for a model not served, NotReady while the engine is not running."""
        async with self._changes:
            if not self.ready:
                raise NotReady("the models are not loaded yet (or the server is shutting down)")
            worker = self.get(name)
            del self._workers[name]
            await _drain([worker], drain_timeout_s,
                         NotReady(f"model {name!r} was unloaded before this request finished (drain timeout)"))
            self.metrics.remove_model(name)  # after its thread stopped: nothing sets them again
            device = str(next(worker.model.parameters()).device)
            del worker
            gc.collect()  # the model's tensors may sit in reference cycles
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            logger.info("model %r unloaded", name)

    async def stop(self, drain_timeout_s: float) -> None:
        """Refuse new requests (NotReady), let in-flight ones finish until the deadline, then stop threads."""
        self.ready = False
        await _drain(list(self._workers.values()), drain_timeout_s,
                     NotReady("the engine stopped before this request finished (drain timeout)"))


async def _drain(workers: list[ModelWorker], drain_timeout_s: float, reason: NotReady) -> None:
    """Refuse new requests to ``workers`` (NotReady), let in-flight ones finish until the deadline, fail what is
    left with ``reason`` and stop their threads."""
    for worker in workers:
        worker.scheduler.close()
    deadline = time.monotonic() + drain_timeout_s
    while any(w.scheduler.busy for w in workers) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.gather(*(asyncio.to_thread(w.scheduler.stop, reason, 10.0) for w in workers))
    for worker in workers:
        worker.close()


async def _within(timeout_s: float, fn: Callable[[], T]) -> T:
    """``fn()`` run in a daemon thread, awaited at most ``timeout_s`` (LoadTimeout after it). A load that never
    returns (a read that blocks) fails its model instead of the start-up, and its thread, left behind, holds up
    neither the event loop nor the process's exit (asyncio.to_thread's pool would be joined at exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # timed out meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the awaiting coroutine
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed while this load hung: nobody waits for it
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="model-load", daemon=True).start()
    try:
        return await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        raise LoadTimeout(f"did not load within {timeout_s:g} s") from None


__all__ = ["Engine", "LoadTimeout", "NoModelsLoaded"]
