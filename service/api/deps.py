"""FastAPI dependencies shared by the routers: settings, engine, the worker of a path's model."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from service.api.schemas import NAME_PATTERN
from service.engine.engine import Engine
from service.engine.errors import NotReady
from service.engine.worker import ModelWorker
from service.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def worker_for(engine: Engine, model: str) -> ModelWorker:
    """The model's worker: 503 before the engine is ready, 404 for an unknown model."""
    if not engine.ready:
        raise NotReady("the models are not loaded yet (or the server is shutting down)")
    return engine.get(model)


def get_worker(
    model: Annotated[str, Path(pattern=NAME_PATTERN, description="A model name from GET /v1/models.")],
    engine: Annotated[Engine, Depends(get_engine)],
) -> ModelWorker:
    return worker_for(engine, model)


def request_id(request: Request) -> str:
    return request.state.request_id
