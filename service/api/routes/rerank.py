"""POST /v1/rerank (Cohere's, Jina's and vLLM's shape) and /v1/score (vLLM's) on classifier (encoder) models.

A model with a one-label head scores (query, document) pairs as a cross-encoder; any other classifier by the cosine
of embeddings (service.engine.rerank): ``scored_by`` says which. ``"model": "name:adapter"`` selects a LoRA adapter.
Also at vLLM's and Cohere's other paths (``ROOT_PATHS``: /rerank, /v2/rerank, /score): the same handlers under the
same key; the OpenAPI schema lists the /v1 paths only.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from service.api.auth import Caller, caller, require_key
from service.api.deps import get_engine, request_id, worker_for
from service.api.http_errors import errors
from service.api.schemas import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    Usage,
)
from service.engine.engine import Engine
from service.engine.worker import ModelWorker

router = APIRouter(prefix="/v1", tags=["rerank"], dependencies=[Depends(require_key)])
_ERRORS = errors(400, 401, 404, 413, 422, 429, 500, 503, 504)
Engines = Annotated[Engine, Depends(get_engine)]
RequestId = Annotated[str, Depends(request_id)]
Client = Annotated[Caller, Depends(caller)]


def model_and_adapter(request: Request, engine: Engine, model: str) -> tuple[ModelWorker, str | None]:
    """The worker of ``"name"`` or ``"name:adapter"``, and the adapter (recorded for the request's metrics)."""
    name, _, adapter = model.partition(":")
    request.state.model, request.state.adapter = name, adapter or None
    return worker_for(engine, name), adapter or None


@router.post("/rerank", name="rerank", response_model=RerankResponse, response_model_exclude_none=True,
             responses=_ERRORS)
async def rerank(req: RerankRequest, request: Request, engine: Engines, rid: RequestId,
                 client: Client) -> RerankResponse:
    """The documents ordered by relevance to the query, most relevant first (ties keep the request's order)."""
    worker, adapter = model_and_adapter(request, engine, req.model)
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    out = await worker.rerank([req.query], texts, adapter, req.truncate, rid, client.queue(req.priority))
    order = sorted(range(len(texts)), key=lambda i: -out.scores[i])  # sorted() is stable: ties keep their order
    results = [RerankResult(index=i, relevance_score=out.scores[i],
                            document=RerankDocument(text=texts[i]) if req.return_documents else None)
               for i in order[: req.top_n or None]]
    return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=req.model, usage=RerankUsage(total_tokens=out.tokens),
                          results=results, scored_by=out.scored_by)


@router.post("/score", name="score", response_model=ScoreResponse, responses=_ERRORS)
async def score(req: ScoreRequest, request: Request, engine: Engines, rid: RequestId, client: Client) -> ScoreResponse:
    """vLLM's scores: text_1 against each text_2 entry (one-to-many), or list against list pair by pair (one-to-one),
    in text_2's order."""
    worker, adapter = model_and_adapter(request, engine, req.model)
    queries = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    texts = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    out = await worker.rerank(queries, texts, adapter, req.truncate, rid, client.queue(req.priority),
                              fields=("text_1", "text_2"))
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=req.model,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(out.scores)],
                         usage=Usage(prompt_tokens=out.tokens, completion_tokens=0, total_tokens=out.tokens),
                         scored_by=out.scored_by)


# vLLM's and Cohere's other paths, for their clients: the /v1 handlers under the same key.
ROOT_PATHS = {"/rerank": rerank, "/v2/rerank": rerank, "/score": score}
root_router = APIRouter(tags=["rerank"], dependencies=[Depends(require_key)], include_in_schema=False)
for _path, _handler in ROOT_PATHS.items():
    root_router.add_api_route(_path, _handler, methods=["POST"], name=f"{_handler.__name__}{_path.replace('/', '_')}",
                              response_model=RerankResponse if _handler is rerank else ScoreResponse,
                              response_model_exclude_none=_handler is rerank)
