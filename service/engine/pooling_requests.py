"""A classifier's classify, entities, embed and rerank requests made into pooling jobs, and their results into the
answers: every check and the encoding (on the model's tokenizer pool) happen before anything is queued, as
GenerationPlanner does for generate requests; the worker (service/engine/worker.py) pins the adapter last, queues
the job and hands its result to the request's ``answer``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from model.calibration import Calibration
from model.checkpoint import Checkpoint
from model.classifier import POOLINGS
from model.hf.sentence import EmbeddingDefaults
from model.token_entities import IGNORE_LABELS
from service.engine.entities import check_request, found, windows_of
from service.engine.errors import InvalidRequest
from service.engine.inputs import InputChecks
from service.engine.jobs import PoolingJob
from service.engine.limits import check_cost
from service.engine.rerank import (
    CROSS_ENCODER,
    DEFAULT_ACTIVATION,
    EMBEDDING_COSINE,
    check_counts,
    cosines,
    cut_to_bytes,
    encode_request,
    pair_scores,
)
from service.engine.types import ClassifyOutput, EngineSettings, RerankOutput

T = TypeVar("T")


@dataclass
class PooledRequest(Generic[T]):
    """A pooling job ready to queue (its adapter still unpinned) and how its result becomes the answer."""

    job: PoolingJob
    answer: Callable[[Any], Awaitable[T]]


async def _as_is(result: Any) -> Any:
    return result


def has_token_head(checkpoint: Checkpoint) -> bool:
    """Whether the model has a token classification head (ClassifierConfig.head "token")."""
    return checkpoint.family == "classifier" and checkpoint.config.head == "token"


def tasks_of(checkpoint: Checkpoint) -> list[str]:
    """What a model serves: generate (causal_lm, seq2seq); classify (a sequence classification head) or entities
    (a token classification head); embed and rerank (every classifier: a one-label head scores pairs, the others by
    embeddings' cosine)."""
    if checkpoint.family != "classifier":
        return ["generate"]
    head = ["entities"] if has_token_head(checkpoint) else ["classify"] if checkpoint.config.num_labels else []
    return [*head, "embed", "rerank"]


class PoolingPlanner:
    """One classifier's requests into pooling jobs (the adapter is the caller's to pin)."""

    def __init__(self, name: str, checkpoint: Checkpoint, settings: EngineSettings, inputs: InputChecks) -> None:
        self.name = name
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.settings = settings
        self.inputs = inputs

    def embedding_defaults(self) -> EmbeddingDefaults:
        """What embed uses when a request leaves pooling or normalize unset."""
        return self.checkpoint.embedding or EmbeddingDefaults()

    def _job(self, request_id: str, endpoint: str, rows: list, **options: Any) -> PoolingJob:
        return PoolingJob(request_id, self.settings.request_timeout_s, endpoint, rows, **options)

    async def classify(self, inputs: list[str | tuple[str, str]], top_k: int | None, request_id: str,
                       min_confidence: float | None) -> PooledRequest[list[ClassifyOutput]]:
        """Labels of ``inputs``; below ``min_confidence`` (None: the model's calibrated default, else 0) a text's
        label is "unknown"."""
        if not self.config.num_labels:
            raise InvalidRequest(None, f"model {self.name!r} has no classification head (an embedding model); "
                                       "use /embed")
        if has_token_head(self.checkpoint):
            raise InvalidRequest(None, f"model {self.name!r} has a token classification head: use /entities "
                                       f"(it serves entities, {', '.join(tasks_of(self.checkpoint))})")
        self.inputs.count(inputs)
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
                self.inputs.size(f"inputs[{i}]", text, tok, self.inputs.max_input_tokens)
            pairs.append(pair)
        encoded = await self.inputs.run(lambda: [self.inputs.length(i, tok.encode_pair(*pair))
                                                for i, pair in enumerate(pairs)])
        if min_confidence is None:
            min_confidence = (self.checkpoint.calibration or Calibration()).min_confidence
        return PooledRequest(self._job(request_id, "classify", encoded, top_k=top_k, min_confidence=min_confidence),
                             _as_is)

    async def entities(self, inputs: list[str], strategy: str, ignore_labels: list[str] | None, stride: int | None,
                       request_id: str) -> PooledRequest[list[list[dict]]]:
        """Each text's entities as transformers' token-classification pipeline finds them (model.token_entities):
        without ``stride`` the text must fit max_input_tokens; with it, windows of max_input_tokens tokens, each
        repeating the last ``stride`` tokens of the one before."""
        if not has_token_head(self.checkpoint):
            raise InvalidRequest(None, f"model {self.name!r} has no token classification head: it serves "
                                       f"{', '.join(tasks_of(self.checkpoint))}")
        check_request(strategy, stride)
        self.inputs.count(inputs)
        tok, limit = self.checkpoint.tokenizer, self.inputs.max_input_tokens
        cap, cap_name = (limit, "max_input_tokens") if stride is None else (
            self.settings.max_tokens_per_request, "max_tokens_per_request")
        texts = [self.inputs.size(f"inputs[{i}]", self.inputs.text(i, t), tok, cap, cap_name)
                 for i, t in enumerate(inputs)]
        windows = await self.inputs.run(lambda: windows_of(tok, self.inputs, texts, limit, stride))
        rows = [(list(s.ids), [0] * len(s.ids)) for spans in windows for s in spans]
        check_cost(self.settings.max_tokens_per_request, {"window tokens": sum(len(ids) for ids, _ in rows)}, None)
        id2label = dict(enumerate(self.checkpoint.labels or []))
        ignore = IGNORE_LABELS if ignore_labels is None else ignore_labels

        async def answer(result: list) -> list[list[dict]]:  # per window (T, num_labels), in the rows' order
            logits = iter(result)
            return await self.inputs.run(lambda: found(tok, texts, windows, logits, id2label, strategy, ignore))

        return PooledRequest(self._job(request_id, "tokens", rows), answer)

    async def embed(self, inputs: list[str], pooling: str | None, normalize: bool | None,
                    request_id: str) -> PooledRequest[list[list[float]]]:
        """One vector per input; ``pooling`` and ``normalize`` default to the model's (a sentence-transformers
        save's modules), else mean pooling, not normalized."""
        self.inputs.count(inputs)
        defaults = self.embedding_defaults()
        pooling = defaults.pooling if pooling is None else pooling
        normalize = defaults.normalize if normalize is None else normalize
        if pooling not in POOLINGS:
            raise InvalidRequest("pooling", f"must be one of {list(POOLINGS)}, got {pooling!r}")
        tok = self.checkpoint.tokenizer
        texts = [self.inputs.size(f"inputs[{i}]", self.inputs.text(i, t), tok, self.inputs.max_input_tokens)
                 for i, t in enumerate(inputs)]
        encoded = await self.inputs.run(lambda: [self.inputs.length(i, tok.encode_pair(t))
                                                 for i, t in enumerate(texts)])
        return PooledRequest(self._job(request_id, "embed", encoded, pooling=pooling, normalize=normalize), _as_is)

    async def rerank(self, queries: list[str], documents: list[str], truncate: bool, request_id: str,
                     fields: tuple[str, str]) -> PooledRequest[RerankOutput]:
        """Each document's relevance to its query (one query for all, or one per document): a one-label head's score
        of the pair (a cross-encoder), else the cosine of their embeddings (service.engine.rerank); ``truncate`` cuts
        a document over max_input_tokens to fit instead of refusing it. Errors name ``fields`` (the queries' and the
        documents' request fields)."""
        check_counts(len(queries), len(documents), self.settings.max_rerank_documents, fields[1])
        tok, limit = self.checkpoint.tokenizer, self.inputs.max_input_tokens
        queries = [self.inputs.size(fields[0], q, tok, limit) for q in queries]
        documents = [cut_to_bytes(d, limit * tok.max_token_bytes) if truncate
                     else self.inputs.size(f"{fields[1]}[{i}]", d, tok, limit) for i, d in enumerate(documents)]
        cross = self.config.num_labels == 1
        encoded = await self.inputs.run(lambda: encode_request(tok, queries, documents, limit, truncate, cross, fields))
        tokens = sum(len(ids) for ids, _ in encoded)
        if cross:  # the pairs' logits, batched with other requests' rows
            activation = self.checkpoint.score_activation or DEFAULT_ACTIVATION

            async def scores(result: list) -> RerankOutput:
                return RerankOutput(pair_scores(result, activation), tokens, CROSS_ENCODER)

            return PooledRequest(self._job(request_id, "logits", encoded), scores)

        async def similarities(result: list) -> RerankOutput:  # the queries' vectors first, then each document's
            return RerankOutput(cosines(result, len(queries)), tokens, EMBEDDING_COSINE)

        job = self._job(request_id, "embed", encoded, pooling=self.embedding_defaults().pooling)
        return PooledRequest(job, similarities)
