"""One loaded model behind the engine: ``ModelWorker`` validates, encodes, schedules and answers its requests.

A ModelWorker validates requests on the event loop, encodes their text on its tokenizer pool (raising
InvalidRequest / NotFound / QueueFull before anything is queued), hands them to its scheduler's worker thread
(service/scheduler.py; generation: service/continuous_batching.py), which also decodes, and awaits the result.
An input is first held to the bytes its token limit allows (``Tokenizer.max_token_bytes``), so no text costs
more to encode than one that fits, and encoding never runs on the event loop. Text encoding (generative
families: ``Checkpoint.encode_prompts``, shared with the Hugging Face export):

- causal_lm prompt: ``<s>`` + text (so an empty prompt is valid); stop strings end the text;
- seq2seq source: text + ``</s>``; the decoder starts from ``<s>``;
- classifier: ``[CLS] a [SEP] (b [SEP])`` with segment ids (``Tokenizer.encode_pair``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from model.calibration import Calibration
from model.checkpoint import Checkpoint, parameter_count
from model.classifier import POOLINGS
from model.decoding import ConfigError, GenerationConfig
from model.generation import generate_seq2seq, prompt_logprobs
from model.hf.sentence import EmbeddingDefaults
from model.lora import adapter_parameter_count, use_adapters
from model.prefix_cache import PrefixCache
from model.speculative import speculative_for
from model.tokenizer import Tokenizer
from model.vocab_map import checkpoint_vocabulary_map
from service import tracing
from service.adapters import AdapterRegistry, check_name
from service.attention import ALL_MAPS, MapSelection, causal_maps, classifier_maps, seq2seq_maps
from service.continuous_batching import GenerationScheduler
from service.errors import InvalidRequest, NotReady, ServiceError
from service.generation_requests import GenerationRequests
from service.jobs import DEADLINE_GRACE_S, CallJob, GenerationJob, Job, PoolingJob
from service.limits import check_cost
from service.metrics import Metrics
from service.pooling import PoolingScheduler
from service.runners import RUNNERS
from service.scheduler import Scheduler
from service.schemas import GenerateOutput, GenerateRequest
from service.types import (
    DEFAULT_QUEUE,
    AdapterInfo,
    AttentionOutput,
    ClassifyOutput,
    EngineSettings,
    ModelInfo,
    QueueTag,
    StreamEvent,
)

logger = logging.getLogger(__name__)


def input_ids(checkpoint: Checkpoint, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of ``texts``: as the model reads them as inputs (its special tokens included; the worker's
    encoding), or the texts' own tokens alone."""
    if not add_special_tokens:
        return checkpoint.prompt_tokenizer.encode_batch(texts)
    if checkpoint.family == "classifier":
        return [checkpoint.tokenizer.encode_pair(text)[0] for text in texts]
    return checkpoint.encode_prompts(texts)

TOKENIZER_THREADS = 2  # per model: encoding is bounded per input, so two threads keep requests from queueing
T = TypeVar("T")


class ModelWorker(GenerationRequests):
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
        self.registry = AdapterRegistry(self.model, name, adapters_dir, settings.max_resident_adapters, metrics,
                                        checkpoint.adapter_layout)
        self.runner = None  # generative families only
        if self.family in RUNNERS:
            prefix_cache = PrefixCache(settings.prefix_cache_bytes) if settings.prefix_cache_bytes > 0 else None
            self.runner = RUNNERS[self.family](self.model, prefix_cache, draft.model if draft is not None else None,
                                               checkpoint_vocabulary_map(checkpoint))
        self.draft_name = draft.path.name if draft is not None and draft.path is not None else None
        model_limit = self.runner.max_input_tokens if self.runner is not None else self.config.max_len
        self.max_input_tokens = min(model_limit, settings.max_input_tokens or model_limit)
        self.max_new_tokens = min(settings.max_new_tokens, self.runner.room(1)) if self.runner is not None else 0
        self._default_speculative = speculative_for(settings.speculative, name)
        if self._default_speculative is not None and self._default_speculative.method == "draft_model" \
                and self.draft_name is None:
            raise ConfigError("speculative", f"model {name!r} defaults to draft_model drafting but has no draft "
                              "model (setting draft_model)")
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix=f"tokenize-{name}")
        self.scheduler: Scheduler
        if self.runner is not None:
            self.scheduler = GenerationScheduler(name, self.runner, checkpoint.tokenizer, settings, metrics,
                                                 self.registry)
        else:
            calibration = checkpoint.calibration or Calibration()
            self.scheduler = PoolingScheduler(name, self.model, list(checkpoint.labels or []), settings, metrics,
                                              self.registry, temperature=calibration.temperature)

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
            generation_defaults=self.generation_defaults,
            draft_model=self.draft_name,
            calibration=({"temperature": self.checkpoint.calibration.temperature,
                          "min_confidence": self.checkpoint.calibration.min_confidence}
                         if self.checkpoint.calibration is not None else None),
        )

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self, threads: int | None = None) -> None:
        """Start the worker thread (with ``threads`` intra-op threads: service.threads) and load the adapters found
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
            await self.generate(GenerateRequest(inputs=["warm up"], max_new_tokens=min(2, self.max_new_tokens)),
                                request_id)
        else:
            if self.config.num_labels:
                await self.classify(["warm up"], None, None, request_id)
            await self.embed(["warm up"], None, request_id)

    # ---- requests ---------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest, request_id: str, queue: QueueTag = DEFAULT_QUEUE
                       ) -> list[GenerateOutput]:
        """One output per input of ``req`` (``req.stream`` is the HTTP layer's: see :meth:`stream`)."""
        job = await self._generation_job(req, request_id, stream=False)
        self._submit(job, queue)
        return await self._result(job)

    async def stream(self, req: GenerateRequest, request_id: str, queue: QueueTag = DEFAULT_QUEUE
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
        """Labels of ``inputs``; below ``min_confidence`` (None: the model's calibrated default, else 0) a text's
        label is "unknown"."""
        self._require("classify", ("classifier",))
        if not self.config.num_labels:
            raise InvalidRequest(None, f"model {self.name!r} has no classification head (an embedding model); "
                                       "use /embed")
        self._check_count(inputs)
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise InvalidRequest("top_k", f"must be an integer >= 1, got {top_k!r}")
        tok = self.checkpoint.tokenizer
        pairs = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                pair = (item, None)
            elif isinstance(item, list | tuple) and len(item) == 2 and all(isinstance(t, str) for t in item):
                pair = (item[0], item[1])
            else:
                raise InvalidRequest(f"inputs[{i}]", "expected a string or a pair of strings")
            for text in filter(None, pair):
                self._check_size(f"inputs[{i}]", text, tok, self.max_input_tokens)
            pairs.append(pair)
        encoded = await self._tokenize(lambda: [self._check_length(i, tok.encode_pair(*pair))
                                                for i, pair in enumerate(pairs)])
        if min_confidence is None:
            min_confidence = (self.checkpoint.calibration or Calibration()).min_confidence
        job = PoolingJob(request_id, self.settings.request_timeout_s, "classify", encoded,
                         adapter=self._acquire(adapter), top_k=top_k, min_confidence=min_confidence)
        self._submit(job, queue)
        return await self._result(job)

    async def embed(self, inputs: list[str], pooling: str | None, request_id: str,
                    normalize: bool | None = None, queue: QueueTag = DEFAULT_QUEUE) -> list[list[float]]:
        """One vector per input; ``pooling`` and ``normalize`` default to the model's (a sentence-transformers
        save's modules), else mean pooling, not normalized."""
        self._require("embed", ("classifier",))
        self._check_count(inputs)
        defaults = self.checkpoint.embedding or EmbeddingDefaults()
        pooling = defaults.pooling if pooling is None else pooling
        normalize = defaults.normalize if normalize is None else normalize
        if pooling not in POOLINGS:
            raise InvalidRequest("pooling", f"must be one of {list(POOLINGS)}, got {pooling!r}")
        tok = self.checkpoint.tokenizer
        texts = [self._check_size(f"inputs[{i}]", self._text(i, t), tok, self.max_input_tokens)
                 for i, t in enumerate(inputs)]
        encoded = await self._tokenize(lambda: [self._check_length(i, tok.encode_pair(t)) for i, t in enumerate(texts)])
        job = PoolingJob(request_id, self.settings.request_timeout_s, "embed", encoded, pooling=pooling,
                         normalize=normalize)
        self._submit(job, queue)
        return await self._result(job)

    async def attention(self, text: str, target: str | None, request_id: str,
                        selection: MapSelection = ALL_MAPS) -> AttentionOutput:
        """Attention maps of one input (seq2seq without ``target``: of its greedy translation), of the layers
        and heads ``selection`` names (service.attention caps their size).

        Kinds: classifier "encoder_self" (target, when given, is the pair's second text); seq2seq
        "encoder_self", "decoder_self", "cross" with decoder queries ``<s>`` + target; causal_lm
        "self" over prompt + target (source_tokens = prompt tokens incl. ``<s>``, target_tokens = target's).
        """
        tokenizer = self.checkpoint.prompt_tokenizer
        text = self._check_size("inputs[0]", self._text(0, text), tokenizer, self.max_input_tokens)
        if target is not None:
            if not isinstance(target, str):
                raise InvalidRequest("target", "expected a string")
            self._check_size("target", target, self.checkpoint.tokenizer, self.config.max_len, "the model's max_len")
        selection.check_heads(self.config.n_heads)
        prepare = {"classifier": self._classifier_attention, "seq2seq": self._seq2seq_attention,
                   "causal_lm": self._causal_attention}[self.family]
        fn = await self._tokenize(lambda: prepare(text, target, selection))
        job = CallJob(request_id, self.settings.request_timeout_s, fn, "attention")
        self._submit(job)
        return await self._result(job)

    # ---- adapters -----------------------------------------------------------------------------------

    def list_adapters(self) -> list[AdapterInfo]:
        return self.registry.infos()

    async def load_adapter(self, name: str, directory: Path) -> AdapterInfo:
        """Load (or atomically replace) ``name`` from ``directory`` inside the adapters directory."""
        check_name(name)
        self.registry.check_directory(directory)
        return await self._on_worker(lambda: self.registry.load(name, Path(directory)))

    async def check_adapter(self, name: str, directory: Path) -> None:
        """Everything loading ``directory`` as ``name`` checks (InvalidRequest), without loading it."""
        await self._on_worker(lambda: self.registry.check(name, Path(directory)))

    async def unload_adapter(self, name: str) -> None:
        self.registry.info(name)  # NotFound before queueing
        await self._on_worker(lambda: self.registry.unload(name))

    # ---- helpers --------------------------------------------------------------------------------------

    async def _on_worker(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    async def _tokenize(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (encoding) on the tokenizer pool: no input stalls the event loop while it is encoded."""
        try:
            encoding = asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn)
        except RuntimeError:  # the pool is shut down: the engine has stopped
            raise NotReady(f"model {self.name!r} is not accepting requests (shut down)") from None
        return await encoding

    def close(self) -> None:
        """Stop the tokenizer pool (after the scheduler has stopped)."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def _result(self, job: Job) -> Any:
        """``job``'s result, its trace recorded however it ends (service.tracing)."""
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

    def _check_count(self, inputs: Any) -> None:
        if not isinstance(inputs, list | tuple) or not inputs:
            raise InvalidRequest("inputs", "expected a non-empty list")
        if len(inputs) > self.settings.max_inputs_per_request:
            raise InvalidRequest("inputs", f"{len(inputs)} inputs exceeds max_inputs_per_request="
                                 f"{self.settings.max_inputs_per_request}")

    @staticmethod
    def _text(i: int, text: Any) -> str:
        if not isinstance(text, str):
            raise InvalidRequest(f"inputs[{i}]", f"expected a string, got {type(text).__name__}")
        return text

    @staticmethod
    def _check_size(field: str, text: str, tokenizer: Tokenizer, max_tokens: int,
                    limit: str = "max_input_tokens") -> str:
        """``text`` if its bytes could fit ``max_tokens`` tokens (the setting or field ``limit``), checked before
        it is encoded."""
        size, allowed = len(text.encode("utf-8", "surrogatepass")), max_tokens * tokenizer.max_token_bytes
        if size > allowed:
            raise InvalidRequest(field, f"{size} bytes, over the {allowed} that {max_tokens} tokens ({limit}) "
                                 f"allow: one token of this model covers at most {tokenizer.max_token_bytes} bytes")
        return text

    def _check_length(self, i: int, encoded: Any, field: str = "inputs") -> Any:
        ids = encoded[0] if isinstance(encoded, tuple) else encoded
        if len(ids) > self.max_input_tokens:
            raise InvalidRequest(f"{field}[{i}]", f"{len(ids)} tokens exceeds max_input_tokens={self.max_input_tokens}")
        return encoded

    async def echo(self, texts: list[str], adapter: str | None, top: int, request_id: str,
                   queue: QueueTag = DEFAULT_QUEUE) -> list[tuple[list[int], list[float | None], list | None]]:
        """Per text, its prompt tokens (a BOS the model adds left out), each one's log-prob given the tokens before
        it (None for a first token) and, with ``top`` > 0, the ``top`` likeliest (id, log-prob) at its position."""
        self._require("echo", ("causal_lm",))
        prompts = await self.input_ids(texts)
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

    async def input_ids(self, texts: list[str], add_special_tokens: bool = True, field: str = "inputs"
                        ) -> list[list[int]]:
        """The ids of ``texts`` as the model reads them (:func:`input_ids`), each text held to the bytes its token
        limit allows before it is encoded and to max_input_tokens after: the input check of the routes that encode
        text without generating from it (echo, tokenize)."""
        tokenizer = self.checkpoint.prompt_tokenizer
        texts = [self._check_size(f"{field}[{i}]", self._text(i, text), tokenizer, self.max_input_tokens)
                 for i, text in enumerate(texts)]
        ids = await self._tokenize(lambda: input_ids(self.checkpoint, texts, add_special_tokens))
        return [self._check_length(i, one, field) for i, one in enumerate(ids)]

    async def prompt_tokens(self, texts: list[str]) -> int:
        """Input tokens of ``texts`` as generate counts them (prompts already accepted by it)."""
        return sum(map(len, await self._tokenize(lambda: self.checkpoint.encode_prompts(texts))))

    def _classifier_attention(self, text: str, target: str | None, selection: MapSelection):
        ids, segments = self._check_length(0, self.checkpoint.tokenizer.encode_pair(text, target))
        return lambda: classifier_maps(self.model, self.checkpoint.tokenizer, ids, segments, selection)

    def _seq2seq_attention(self, text: str, target: str | None, selection: MapSelection):
        src = self._check_length(0, self.checkpoint.encode_prompts([text])[0])
        tgt = self.checkpoint.tokenizer.encode(target) if target is not None else None
        if tgt is not None and len(tgt) + 1 > self.config.max_len:
            raise InvalidRequest("target", f"{len(tgt)} tokens exceeds the model's max_len={self.config.max_len} - 1")

        def run() -> AttentionOutput:
            out = tgt
            if out is None:  # attend over the model's own greedy translation
                config = GenerationConfig(max_new_tokens=self.max_new_tokens, eos_token_id=self.config.eos_id,
                                          **self._rules)
                out = generate_seq2seq(self.model, [src], config, vocab_map=self.runner.vocab_map)[0][0].tokens
            return seq2seq_maps(self.model, self.checkpoint, src, [self.config.bos_id, *out], selection)

        return run

    def _causal_attention(self, text: str, target: str | None, selection: MapSelection):
        prompt = self._check_length(0, self.checkpoint.encode_prompts([text])[0])
        tgt = self.checkpoint.tokenizer.encode(target) if target is not None else None
        if len(prompt) + len(tgt or []) > self.config.max_len:
            raise InvalidRequest("target", f"prompt + target ({len(prompt) + len(tgt or [])} tokens) exceeds the "
                                 f"model's max_len={self.config.max_len}")
        return lambda: causal_maps(self.model, self.checkpoint.tokenizer, prompt, tgt, selection)
