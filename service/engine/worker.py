"""One loaded model behind the engine: ``ModelWorker`` validates, encodes, schedules and answers its requests.

A ModelWorker takes the engine's own request types (service/engine/requests.py; the HTTP layer converts its bodies),
checks and encodes their text on its tokenizer pool (service/engine/inputs.py: ``InputChecks``; generate requests
through ``GenerationPlanner``, service/engine/generation_requests.py; a classifier's through ``PoolingPlanner``,
service/engine/pooling_requests.py), raising InvalidRequest / NotFound /
QueueFull before anything is queued, hands them to its scheduler's worker thread (scheduler.py; generation:
continuous_batching.py), which also decodes, and awaits the result.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from model.calibration import Calibration
from model.checkpoint import Checkpoint, checkpoint_vocabulary_map, parameter_count
from model.decoding import GenerationConfig
from model.generation import prompt_logprobs
from model.lora import adapter_parameter_count, use_adapters
from model.prefix_cache import PrefixCache, prefix_cache_serves
from model.quantize import model_mode
from model.speculative import speculative_for
from service.engine import adapter_store, tracing
from service.engine.adapters import AdapterRegistry, check_name
from service.engine.attention import ALL_MAPS, MapSelection, prepare_maps
from service.engine.chat import chat_template_for, load_chat
from service.engine.continuous_batching import GenerationScheduler
from service.engine.errors import Conflict, InvalidRequest, NotFound, ServiceError
from service.engine.generation_requests import GenerationPlanner
from service.engine.inputs import InputChecks
from service.engine.jobs import DEADLINE_GRACE_S, CallJob, GenerationJob, Job
from service.engine.limits import check_cost
from service.engine.metrics import Metrics
from service.engine.pooling import PoolingScheduler
from service.engine.pooling_requests import PooledRequest, PoolingPlanner, has_token_head, tasks_of
from service.engine.requests import DecodingOptions, GenerationRequest
from service.engine.runners import RUNNERS
from service.engine.scheduler import Scheduler
from service.engine.types import (
    DEFAULT_QUEUE,
    AdapterInfo,
    AttentionOutput,
    ClassifyOutput,
    EngineSettings,
    GenerationOutput,
    ModelInfo,
    QueueTag,
    RerankOutput,
    StreamEvent,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ModelWorker:
    """One loaded model: its scheduler thread, its adapters, its metrics labels."""

    def __init__(self, name: str, checkpoint: Checkpoint, settings: EngineSettings, metrics: Metrics,
                 adapters_dir: Path | None, draft: Checkpoint | None = None) -> None:
        self.name = name
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        self.config = checkpoint.config
        self.family = checkpoint.family
        self.settings = settings
        self.metrics = metrics
        self._adapter_changes = asyncio.Lock()  # loads, uploads and unloads one at a time (uploads swap directories)
        self.registry = AdapterRegistry(self.model, name, adapters_dir, settings.max_resident_adapters, metrics,
                                        checkpoint.adapter_layout)
        self.runner = None  # generative families only
        if self.family in RUNNERS:
            prefix_cache = (PrefixCache(settings.prefix_cache_bytes)
                            if settings.prefix_cache_bytes > 0 and prefix_cache_serves(self.config) else None)
            self.runner = RUNNERS[self.family](self.model, prefix_cache, draft.model if draft is not None else None,
                                               checkpoint_vocabulary_map(checkpoint))
        draft_name = draft.path.name if draft is not None and draft.path is not None else None
        model_limit = self.runner.max_input_tokens if self.runner is not None else self.config.max_len
        self.max_input_tokens = min(model_limit, settings.max_input_tokens or model_limit)
        self.chat = load_chat(checkpoint, chat_template_for(settings.chat_template, name))
        self.inputs = InputChecks(name, checkpoint, self.max_input_tokens, settings.max_inputs, self.chat.encoder)
        self.planner: GenerationPlanner | None = None
        if self.runner is not None:
            max_new_tokens = min(settings.max_new_tokens, self.runner.room(1))
            self.planner = GenerationPlanner(name, checkpoint, settings, self.runner, self.inputs, max_new_tokens,
                                             draft_name, speculative_for(settings.speculative, name))
        self.pooling = PoolingPlanner(name, checkpoint, settings, self.inputs) if self.runner is None else None
        self.scheduler: Scheduler
        if self.runner is not None:
            self.scheduler = GenerationScheduler(name, self.runner, checkpoint.tokenizer, settings, metrics,
                                                 self.registry)
        else:
            calibration = checkpoint.calibration or Calibration()
            self.scheduler = PoolingScheduler(name, self.model, list(checkpoint.labels or []), settings, metrics,
                                              self.registry, temperature=calibration.temperature)

    @property
    def max_new_tokens(self) -> int:
        """Cap on a generate request's new tokens (0 for classifiers)."""
        return self.planner.max_new_tokens if self.planner is not None else 0

    def capped_new_tokens(self, wanted: int) -> int:
        """A default of ``wanted`` new tokens within this model's cap (GenerationPlanner.capped_new_tokens)."""
        return self.planner.capped_new_tokens(wanted)

    @property
    def info(self) -> ModelInfo:
        p = next(self.model.parameters())
        adapters = adapter_parameter_count(self.model)
        return ModelInfo(
            name=self.name,
            family=self.family,
            device=str(p.device),
            dtype=str(p.dtype).removeprefix("torch."),
            parameters=parameter_count(self.model) - adapters,
            adapter_parameters=adapters,
            vocab_size=self.config.vocab_size,
            max_input_tokens=self.max_input_tokens,
            max_new_tokens=self.max_new_tokens,
            labels=list(self.checkpoint.labels) if self.checkpoint.labels else None,
            adapters=self.registry.names(),
            format=self.checkpoint.format,
            generation_defaults=self.planner.generation_defaults if self.planner is not None else {},
            draft_model=self.planner.draft_name if self.planner is not None else None,
            calibration=({"temperature": c.temperature, "min_confidence": c.min_confidence}
                         if (c := self.checkpoint.calibration) is not None else None),
            embedding_defaults=asdict(self.pooling.embedding_defaults()) if self.pooling is not None else None,
            chat_template=self.chat.encoder is not None,
            tool_call_format=self.chat.tool_call_format,
            tasks=self.tasks(),
            languages=list(languages.ids) if (languages := self.checkpoint.languages) is not None else None,
            source_language=languages.source if languages is not None else None,
            quantize=model_mode(self.model),
            static_step=asdict(static.info()) if (static := self.scheduler.static) is not None else None,
        )

    def tasks(self) -> list[str]:
        """What this model serves (pooling_requests.tasks_of)."""
        return tasks_of(self.checkpoint)

    @property
    def token_head(self) -> bool:
        """Whether this model has a token classification head."""
        return has_token_head(self.checkpoint)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self, threads: int | None = None) -> None:
        """Start the worker thread (with ``threads`` intra-op threads: threads.py) and load the adapters found
        on disk, up to the resident limit."""
        self.scheduler.start(threads)
        for name in self.registry.discover()[: self.settings.max_resident_adapters]:
            try:
                await self._on_worker(lambda n=name: self.registry.preload(n))
            except ServiceError as exc:
                logger.error("model %r: adapter %r not loaded: %s", self.name, name, exc)

    async def warmup(self) -> None:
        """One tiny request through the real path (fills caches, catches a broken model early)."""
        request_id = f"warmup-{self.name}"
        if self.runner is not None:
            warm = GenerationRequest(["warm up"], DecodingOptions(max_new_tokens=min(2, self.max_new_tokens)))
            await self.generate(warm, request_id)
        else:
            if self.token_head:
                await self.entities(["warm up"], "simple", None, None, None, request_id)
            elif self.config.num_labels:
                await self.classify(["warm up"], None, None, request_id)
            await self.embed(["warm up"], None, request_id)

    # ---- requests ---------------------------------------------------------------------------------

    async def generate(self, req: GenerationRequest, request_id: str, queue: QueueTag = DEFAULT_QUEUE
                       ) -> list[GenerationOutput]:
        """One output per input of ``req`` (streamed: :meth:`stream`)."""
        job = await self._generation_job(req, request_id, stream=False)
        self._submit(job, queue)
        return await self._result(job)

    async def stream(self, req: GenerationRequest, request_id: str, queue: QueueTag = DEFAULT_QUEUE
                     ) -> AsyncIterator[StreamEvent]:
        """Events as tokens come for ``req``'s one input (validation errors raise here, before any event).

        Greedy and sample (num_return_sequences 1) stream token by token; beam search streams its
        best sequence as a single final event (beams only settle at the end).
        """
        if len(req.inputs) != 1:
            raise InvalidRequest("inputs", f"streaming takes exactly one input, got {len(req.inputs)}")
        job = await self._generation_job(req, request_id, stream=True)
        self._submit(job, queue)
        return self._events(job)

    async def _generation_job(self, req: GenerationRequest, request_id: str, stream: bool) -> GenerationJob:
        self._require("generate", tuple(RUNNERS))
        job = await self.planner.job(req, request_id, stream)
        job.adapter = self._acquire(req.adapter)  # pinned last: nothing after it can refuse the request
        return job

    async def _events(self, job: GenerationJob) -> AsyncIterator[StreamEvent]:
        finished, error, last = False, None, None
        try:
            while True:
                remaining = job.deadline - time.monotonic() + DEADLINE_GRACE_S
                try:
                    event = await asyncio.wait_for(job.events.get(), max(remaining, 0.0))
                except TimeoutError:
                    raise job.timeout_error() from None
                if isinstance(event, BaseException):
                    finished = True
                    raise event
                finished, last = event.finish_reason is not None, event
                yield event
                if finished:
                    return
        except BaseException as exc:
            error = exc
            raise
        finally:
            if not finished:
                job.cancel()  # client gone or timed out: the worker frees its rows at the next step
            tracing.record_job(job, self.name, [last] if last is not None and finished else None, error)

    async def classify(self, inputs: list[str | tuple[str, str]], adapter: str | None, top_k: int | None,
                       request_id: str, queue: QueueTag = DEFAULT_QUEUE, min_confidence: float | None = None
                       ) -> list[ClassifyOutput]:
        """Labels of ``inputs`` (PoolingPlanner.classify)."""
        self._require("classify", ("classifier",))
        return await self._pooled(await self.pooling.classify(inputs, top_k, request_id, min_confidence), adapter,
                                  queue)

    async def entities(self, inputs: list[str], strategy: str, ignore_labels: list[str] | None, stride: int | None,
                       adapter: str | None, request_id: str, queue: QueueTag = DEFAULT_QUEUE) -> list[list[dict]]:
        """Each text's entities (PoolingPlanner.entities)."""
        self._require("entities", ("classifier",))
        request = await self.pooling.entities(inputs, strategy, ignore_labels, stride, request_id)
        return await self._pooled(request, adapter, queue)

    async def embed(self, inputs: list[str], pooling: str | None, request_id: str,
                    normalize: bool | None = None, queue: QueueTag = DEFAULT_QUEUE) -> list[list[float]]:
        """One vector per input (PoolingPlanner.embed)."""
        self._require("embed", ("classifier",))
        return await self._pooled(await self.pooling.embed(inputs, pooling, normalize, request_id), None, queue)

    async def rerank(self, queries: list[str], documents: list[str], adapter: str | None, truncate: bool,
                     request_id: str, queue: QueueTag = DEFAULT_QUEUE,
                     fields: tuple[str, str] = ("query", "documents")) -> RerankOutput:
        """Each document's relevance to its query, in one engine call (PoolingPlanner.rerank)."""
        self._require("rerank", ("classifier",))
        request = await self.pooling.rerank(queries, documents, truncate, request_id, fields)
        return await self._pooled(request, adapter, queue)

    async def _pooled(self, request: PooledRequest[T], adapter: str | None, queue: QueueTag) -> T:
        """``request``'s job with ``adapter`` pinned (last: nothing after it can refuse the request), queued, and its
        result made into the answer."""
        request.job.adapter = self._acquire(adapter)
        self._submit(request.job, queue)
        return await request.answer(await self._result(request.job))

    async def attention(self, text: str, target: str | None, request_id: str,
                        selection: MapSelection = ALL_MAPS) -> AttentionOutput:
        """Attention maps of one input (seq2seq without ``target``: of its greedy translation), of the layers
        and heads ``selection`` names (service.engine.attention caps their size).

        Kinds: classifier "encoder_self" (target, when given, is the pair's second text); seq2seq
        "encoder_self", "decoder_self", "cross" with decoder queries ``<s>`` + target; causal_lm
        "self" over prompt + target (source_tokens = prompt tokens incl. ``<s>``, target_tokens = target's).
        """
        tokenizer = self.checkpoint.prompt_tokenizer
        text = self.inputs.size("inputs[0]", self.inputs.text(0, text), tokenizer, self.max_input_tokens)
        if target is not None:
            if not isinstance(target, str):
                raise InvalidRequest("target", "expected a string")
            self.inputs.size("target", target, self.checkpoint.tokenizer, self.config.max_len, "the model's max_len")
        selection.check_heads(self.config.n_heads)
        greedy = None
        if self.planner is not None:
            greedy = GenerationConfig(max_new_tokens=self.max_new_tokens, eos_token_id=self.config.eos_id,
                                      **self.planner.rules)
        vocab_map = self.runner.vocab_map if self.runner is not None else None
        fn = await self.inputs.run(lambda: prepare_maps(self.checkpoint, self.inputs, text, target, selection, greedy,
                                                        vocab_map))
        job = CallJob(request_id, self.settings.request_timeout_s, fn, "attention")
        self._submit(job)
        return await self._result(job)

    # ---- adapters -----------------------------------------------------------------------------------

    def list_adapters(self) -> list[AdapterInfo]:
        return self.registry.infos()

    def adapter_directory(self, name: str) -> Path:
        """``<adapters>/<model>/<name>/``, where adapter ``name`` lives (Conflict: no adapters directory)."""
        base = self.registry.base
        if base is None:
            raise Conflict("this server has no adapter directory (setting adapters) to load adapters from")
        return base / check_name(name)

    async def load_adapter(self, name: str, directory: Path | None = None) -> AdapterInfo:
        """Load (or atomically replace) adapter ``name`` from ``directory`` inside the adapters directory (default:
        its own, ``<adapters>/<model>/<name>/``); one adapter change at a time."""
        check_name(name)
        base = self.registry.base
        async with self._adapter_changes:
            if directory is None:
                if base is None or not (base / name).is_dir():
                    raise NotFound(f"adapter {name!r}: no directory {self.name}/{name}/ in the adapter directory")
                directory = base / name
            self.registry.check_directory(directory)
            return await self._on_worker(lambda: self.registry.load(name, Path(directory)))

    async def install_adapter(self, name: str, upload: Path) -> AdapterInfo:
        """Adapter ``name`` from ``upload`` (a directory beside its own, which an upload was extracted into):
        checked in full first, then swapped in atomically and loaded (on failure the previous files go back)."""
        target = self.adapter_directory(name)
        await self._on_worker(lambda: self.registry.check(name, upload))
        async with self._adapter_changes:
            old = await asyncio.to_thread(adapter_store.swap_in, upload, target)
            try:
                info = await self._on_worker(lambda: self.registry.load(name, target))
            except BaseException:
                await asyncio.to_thread(adapter_store.restore, target, old)
                raise
        if old is not None:
            await asyncio.to_thread(shutil.rmtree, old, True)
        return info

    async def unload_adapter(self, name: str) -> None:
        check_name(name)
        async with self._adapter_changes:
            self.registry.info(name)  # NotFound before queueing
            await self._on_worker(lambda: self.registry.unload(name))

    # ---- helpers --------------------------------------------------------------------------------------

    async def _on_worker(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    def close(self) -> None:
        """Stop the tokenizer pool (after the scheduler has stopped)."""
        self.inputs.close()

    async def _result(self, job: Job) -> Any:
        """``job``'s result, its trace recorded however it ends (service.engine.tracing)."""
        try:
            value = await job.wait()
        except BaseException as exc:
            tracing.record_job(job, self.name, None, exc)
            raise
        tracing.record_job(job, self.name, value, None)
        return value

    def _submit(self, job: Job, queue: QueueTag = DEFAULT_QUEUE) -> None:
        job.queue = queue
        try:
            self.scheduler.submit(job)
        except ServiceError:
            if job.adapter is not None:
                self.registry.release(job.adapter)
            raise

    def _acquire(self, adapter: str | None):
        if adapter is None:
            return None
        if not isinstance(adapter, str):
            raise InvalidRequest("adapter", f"expected a name, got {adapter!r}")
        return self.registry.acquire(adapter)

    def _require(self, endpoint: str, families: tuple[str, ...]) -> None:
        if self.family not in families:
            needs = " or ".join(f"a {f}" for f in families)
            raise InvalidRequest(None, f"model {self.name!r} is a {self.family}; {endpoint} needs {needs}")

    async def echo(self, texts: list[str], adapter: str | None, top: int, request_id: str,
                   queue: QueueTag = DEFAULT_QUEUE) -> list[tuple[list[int], list[float | None], list | None]]:
        """Per text, its prompt tokens (a BOS the model adds left out), each one's log-prob given the tokens before
        it (None for a first token) and, with ``top`` > 0, the ``top`` likeliest (id, log-prob) at its position."""
        self._require("echo", ("causal_lm",))
        prompts = await self.inputs.input_ids(texts)
        check_cost(self.settings.max_tokens_per_request, {"prompt tokens": sum(map(len, prompts))}, top)
        version = self._acquire(adapter)

        def run() -> list[tuple[list[int], list[float | None], list | None]]:
            out = []
            with use_adapters(self.model, version.internal if version is not None else None):
                for prompt in prompts:
                    token_lp, tops = prompt_logprobs(self.model, prompt, top)
                    start = 1 if len(prompt) > 1 and prompt[0] == self.config.bos_id else 0
                    out.append((prompt[start:], token_lp[start:], tops[start:] if top else None))
            return out

        job = CallJob(request_id, self.settings.request_timeout_s, run, "echo")
        job.adapter = version
        self._submit(job, queue)
        return await self._result(job)

    async def prompt_tokens(self, texts: list[str]) -> int:
        """Input tokens of ``texts`` as generate counts them (prompts already accepted by it)."""
        return sum(map(len, await self.inputs.run(lambda: self.checkpoint.encode_prompts(texts))))
