"""/v1/models: the list, and per model generate, classify, entities, embed and attention."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.api import convert
from service.api.auth import Caller, caller, require_key
from service.api.deps import get_engine, get_worker, request_id
from service.api.http_errors import errors
from service.api.routes.json_body import json_response
from service.api.routes.sse import SSE_RESPONSE, sse_response
from service.api.schemas import (
    AttentionRequest,
    AttentionResponse,
    Classification,
    ClassifyRequest,
    ClassifyResponse,
    EmbedRequest,
    EmbedResponse,
    GenerateRequest,
    GenerateResponse,
    ModelInfoSchema,
    ModelList,
    ModelLoadFailure,
)
from service.api.schemas.encoders import EntitiesRequest, EntitiesResponse
from service.engine.attention import MapSelection
from service.engine.engine import Engine
from service.engine.types import ModelInfo, StreamEvent
from service.engine.worker import ModelWorker

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=[Depends(require_key)])

Worker = Annotated[ModelWorker, Depends(get_worker)]
RequestId = Annotated[str, Depends(request_id)]
Client = Annotated[Caller, Depends(caller)]
_COMMON = (400, 401, 404, 413, 422, 429, 500, 503, 504)


def model_schema(info: ModelInfo, created: int) -> ModelInfoSchema:
    """A model's entry, as GET /v1/models lists it and PUT /v1/models/NAME answers it."""
    return ModelInfoSchema.model_validate({**dataclasses.asdict(info), "id": info.name, "created": created})


@router.get("", name="list_models", response_model=ModelList, responses=errors(401, 503))
async def list_models(request: Request, engine: Annotated[Engine, Depends(get_engine)]) -> ModelList:
    """Every loaded model with its family, device, dtype, size, limits and resident adapters; under `failed`,
    the configured models that did not load, and why."""
    created = request.app.state.started_at
    return ModelList(
        data=[model_schema(m, created) for m in engine.models()],
        failed=[ModelLoadFailure(name=name, error=error) for name, error in engine.load_errors.items()],
    )


def stream_event(e: StreamEvent) -> dict[str, Any]:
    event = {"text": e.text, "token": e.token, "finish_reason": e.finish_reason}
    if e.logprobs is not None:
        event["logprobs"] = [{k: v for k, v in dataclasses.asdict(entry).items() if v is not None}
                             for entry in e.logprobs]
    if e.placeholders_ok is not None:
        event["placeholders_ok"] = e.placeholders_ok
    if e.constraint_satisfied is not None:
        event["constraint_satisfied"] = e.constraint_satisfied
    return event


@router.post(
    "/{model}/generate",
    name="generate",
    response_model=GenerateResponse,
    response_model_exclude_unset=True,
    responses={200: SSE_RESPONSE, **errors(*_COMMON)},
)
async def generate(
    req: GenerateRequest, request: Request, worker: Worker, rid: RequestId, client: Client
) -> Response:
    """Translate (seq2seq) or continue (causal_lm) each input: greedy, beam or sampling.

    With `"stream": true` (one input), tokens arrive as server-sent events `data: {"text", "token",
    "finish_reason"}` (and `"logprobs"`, the entries of the tokens the event adds, when asked for), the last one
    with a finish_reason (and `"placeholders_ok"` where placeholders are protected, `"constraint_satisfied"` with a
    constraint), then `data: [DONE]`.
    """
    request.state.adapter = req.adapter
    queue = client.queue(req.priority)
    if req.stream:
        return await sse_response(await worker.stream(convert.generation_request(req), rid, queue), stream_event, rid)
    outputs = await worker.generate(convert.generation_request(req), rid, queue)
    return await json_response(lambda: GenerateResponse(outputs=[convert.generate_output(o) for o in outputs]),
                               exclude_unset=True)


@router.post("/{model}/classify", name="classify", response_model=ClassifyResponse, responses=errors(*_COMMON))
async def classify(req: ClassifyRequest, request: Request, worker: Worker, rid: RequestId,
                   client: Client) -> ClassifyResponse:
    """Label each text or [text, text] pair, with every label's probability (top_k: the k likeliest)."""
    request.state.adapter = req.adapter
    outputs = await worker.classify(list(req.inputs), req.adapter, req.top_k, rid, client.queue(req.priority),
                                    min_confidence=req.min_confidence)
    return ClassifyResponse(outputs=[Classification(label=o.label, score=o.score, probabilities=dict(o.probabilities),
                                                    abstained=o.abstained) for o in outputs])


@router.post("/{model}/entities", name="entities", response_model=EntitiesResponse,
             response_model_exclude_none=True, responses=errors(*_COMMON))
async def entities(req: EntitiesRequest, request: Request, worker: Worker, rid: RequestId,
                   client: Client) -> EntitiesResponse:
    """Named entities (token classification) of each text, as transformers' token-classification pipeline finds
    them with the same aggregation_strategy, ignore_labels and stride; a model without a token classification head
    is a 422."""
    request.state.adapter = req.adapter
    texts = [req.inputs] if isinstance(req.inputs, str) else list(req.inputs)
    outputs = await worker.entities(texts, req.aggregation_strategy, req.ignore_labels, req.stride,
                                    req.adapter, rid, client.queue(req.priority))
    return EntitiesResponse.model_validate({"outputs": outputs})


@router.post("/{model}/embed", name="embed", response_model=EmbedResponse, responses=errors(*_COMMON))
async def embed(req: EmbedRequest, worker: Worker, rid: RequestId, client: Client) -> EmbedResponse:
    """One vector per input: the encoder's [CLS] state, or the mean or max over its tokens."""
    vectors = await worker.embed(req.inputs, req.pooling, rid, req.normalize, client.queue(req.priority))
    return EmbedResponse(embeddings=vectors, dimensions=len(vectors[0]) if vectors else 0)


@router.post("/{model}/attention", name="attention", response_model=AttentionResponse, responses=errors(*_COMMON))
async def attention(req: AttentionRequest, worker: Worker, rid: RequestId) -> AttentionResponse:
    """Tokens and attention weights per layer and head, for introspection (not batched for speed)."""
    selection = MapSelection(tuple(req.layers) if req.layers else None, tuple(req.heads) if req.heads else None)
    out = await worker.attention(req.input, req.target, rid, selection)
    return AttentionResponse(source_tokens=out.source_tokens, target_tokens=out.target_tokens, maps=out.maps)
