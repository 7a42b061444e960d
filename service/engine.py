"""The serving engine: every model under the models directory loaded into a ``ModelWorker`` (service/worker.py),
served under its directory name; start-up, lookup and draining. Torch only, no HTTP."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from model.checkpoint import Checkpoint, load_checkpoint
from model.generation_config import ConfigError
from model.quantize import mode_for, prepare_for_inference
from model.speculative import check_draft_model, draft_model_for
from service.errors import NotFound, NotReady
from service.metrics import Metrics
from service.threads import available_cores, worker_threads
from service.types import EngineSettings, ModelInfo
from service.worker import ModelWorker

logger = logging.getLogger(__name__)


class NoModelsLoaded(RuntimeError):
    """Start-up found nothing to serve: no model directory, or none that loaded (the message says why)."""


class Engine:
    """Every model under ``models_dir``, served under its directory name."""

    def __init__(self, settings: EngineSettings, models_dir: Path, adapters_dir: Path | None) -> None:
        self.settings = settings
        self.models_dir = Path(models_dir)
        self.adapters_dir = Path(adapters_dir) if adapters_dir is not None else None
        self.metrics = Metrics()
        self.ready = False
        self.load_errors: dict[str, str] = {}
        self._workers: dict[str, ModelWorker] = {}

    async def start(self) -> None:
        """Load every checkpoint and warm it up; a failing one is logged, skipped and reported in load_errors.

        Raises NoModelsLoaded, naming each model and its reason, when none loads (the models directory is
        missing, holds no model directories, or every one failed): a server with nothing to serve never reports
        ready.
        """
        if not self.models_dir.is_dir():
            raise NoModelsLoaded(f"models directory {self.models_dir} not found")
        dirs = sorted(p for p in self.models_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        # A checkpoint whose save was killed between its two renames is only at .<name>.old: load_checkpoint
        # reads it from there, so list it under its name.
        interrupted = [self.models_dir / p.name[1:-4] for p in self.models_dir.glob(".?*.old") if p.is_dir()]
        dirs = sorted({*dirs, *(d for d in interrupted if not d.exists())})
        if not dirs:
            raise NoModelsLoaded(f"models directory {self.models_dir} holds no model directories")
        threads = worker_threads(self.settings.threads, len(dirs))
        if threads > 1 and threads * len(dirs) > available_cores():
            logger.warning("%d model workers x %d intra-op threads exceed the %d CPU cores: every parallel region "
                           "will wait for a sleeping thread (service.threads); leave TSERVE_THREADS unset to share "
                           "the cores", len(dirs), threads, available_cores())
        for directory in dirs:
            name = directory.name
            start = time.perf_counter()
            worker = None
            try:
                checkpoint = await asyncio.to_thread(load_checkpoint, directory, self.settings.device,
                                                     self.settings.dtype)
                prepare_for_inference(checkpoint.model, mode_for(self.settings.quantize, name))
                draft = await self._draft_for(name, checkpoint)
                worker = ModelWorker(name, checkpoint, self.settings, self.metrics, self.adapters_dir, draft)
                await worker.start(threads)
                self.metrics.model_load_seconds.labels(name).set(time.perf_counter() - start)
                if self.settings.warmup:
                    await worker.warmup()
            except Exception as exc:
                logger.exception("model %r (%s) failed to load; skipped", name, directory)
                self.load_errors[name] = self._public(f"{type(exc).__name__}: {exc}")
                if worker is not None:  # started, then failed (its warm-up): its threads stop too
                    worker.scheduler.close()
                    await asyncio.to_thread(worker.scheduler.stop, NotReady(f"model {name!r} failed to load"), 10.0)
                    worker.close()
                continue
            self._workers[name] = worker
            logger.info("model %r (%s) ready in %.2fs: %s", name, checkpoint.family, time.perf_counter() - start,
                        worker.info)
        if not self._workers:
            reasons = "".join(f"\n  {name}: {error}" for name, error in self.load_errors.items())
            raise NoModelsLoaded(f"no model in {self.models_dir} loaded:{reasons}")
        self.ready = True

    async def _draft_for(self, name: str, checkpoint: Checkpoint) -> Checkpoint | None:
        """The draft model (settings.draft_model) of model ``name``, loaded for it alone; raises when it cannot
        draft for it (not found, another family or tokenizer), which fails the model's load with that reason."""
        draft_name = draft_model_for(self.settings.draft_model, name, checkpoint.family)
        if draft_name is None:
            return None
        if not (self.models_dir / draft_name).is_dir():
            raise ConfigError("draft_model", f"draft model {draft_name!r} for {name!r} is not a model directory")
        draft = await asyncio.to_thread(load_checkpoint, self.models_dir / draft_name, self.settings.device,
                                        self.settings.dtype)
        prepare_for_inference(draft.model, mode_for(self.settings.quantize, draft_name))
        check_draft_model(checkpoint.model, checkpoint.tokenizer.backend.get_vocab(), draft.model,
                          draft.tokenizer.backend.get_vocab())
        return draft

    def _public(self, message: str) -> str:
        """``message`` with the models directory's paths made relative to it (no server paths in answers)."""
        roots = {str(self.models_dir), os.path.abspath(self.models_dir), os.path.realpath(self.models_dir)}
        for root in sorted(roots, key=len, reverse=True):
            message = message.replace(f"{root}{os.sep}", "")
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

    async def stop(self, drain_timeout_s: float) -> None:
        """Refuse new requests (NotReady), let in-flight ones finish until the deadline, then stop threads."""
        self.ready = False
        workers = list(self._workers.values())
        for worker in workers:
            worker.scheduler.close()
        deadline = time.monotonic() + drain_timeout_s
        while any(w.scheduler.busy for w in workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        reason = NotReady("the engine stopped before this request finished (drain timeout)")
        await asyncio.gather(*(asyncio.to_thread(w.scheduler.stop, reason, 10.0) for w in workers))
        for worker in workers:
            worker.close()


__all__ = ["Engine", "NoModelsLoaded"]
