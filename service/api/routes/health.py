"""Operations: liveness, readiness and Prometheus metrics (open even when API keys are set)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api.deps import get_engine
from service.api.http_errors import errors
from service.api.schemas import HealthResponse, ReadyResponse
from service.engine.engine import Engine
from service.engine.errors import NotReady

router = APIRouter(tags=["operations"])


@router.get("/health", name="health", response_model=HealthResponse)
async def health() -> HealthResponse:
    """Liveness: the process answers HTTP."""
    return HealthResponse()


@router.get("/ready", name="ready", response_model=ReadyResponse, responses=errors(503))
async def ready(engine: Annotated[Engine, Depends(get_engine)]) -> ReadyResponse:
    """Readiness: 200 once the models are loaded and warmed up, listing them (GET /v1/models lists any that failed,
    and why); 503 before, while shutting down, and once every model was unloaded. With none loaded the server does
    not start."""
    if not engine.ready:
        raise NotReady("models are not loaded yet (or the server is shutting down)")
    models = [m.name for m in engine.models()]
    if not models:
        raise NotReady("no model is loaded (every one was unloaded): load one with PUT /v1/models/{name}")
    return ReadyResponse(models=models)


@router.get(
    "/metrics",
    name="metrics",
    response_class=Response,
    responses={
        200: {
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition format.",
        }
    },
)
async def metrics(engine: Annotated[Engine, Depends(get_engine)]) -> Response:
    """Prometheus metrics: request counts and latencies, batch sizes, queue depth, tokens, adapters."""
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)
