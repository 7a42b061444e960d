"""The FastAPI application: :func:`create_app` wires settings, engine, middleware, errors and routers."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import Scope

from service.api.http_errors import install_error_handlers
from service.api.middleware import (
    BodyLimitMiddleware,
    DisconnectMiddleware,
    KeyFirstMiddleware,
    MetricsMiddleware,
    RequestIdMiddleware,
    TracingMiddleware,
)
from service.api.routes import ROUTERS
from service.api.routes.adapters import is_upload
from service.engine import tracing
from service.engine.engine import Engine
from service.engine.vllm_metrics import VllmCompatCollector
from service.model_sources import model_sources
from service.settings import Settings

logger = logging.getLogger(__name__)


DESCRIPTION = """Serves from-scratch Transformer models: translation (seq2seq), classification and
embeddings (classifier), text generation (causal_lm), with continuous batching and LoRA adapters; an
OpenAI-compatible surface (`/v1/completions`, `/v1/embeddings`) and vLLM's `/v1/tokenize` / `/v1/detokenize`.

Every error has one shape: `{"error": {"code", "message", "field", "request_id"}}`; every response
carries `X-Request-ID`. When API keys are configured, every `/v1` route needs
`Authorization: Bearer <key>` (model and adapter load/unload an admin key); `/health`, `/ready`, `/metrics`
and `/` stay open for probes and scrapers."""


def _body_limit(settings: Settings) -> Callable[[Scope], int]:
    def limit_for(scope: Scope) -> int:
        if is_upload(scope):
            return settings.max_adapter_upload_bytes
        return settings.max_body_bytes

    return limit_for


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """The app for ``settings``; ``engine`` (tests) replaces the one built from the settings' directories."""
    if engine is None:
        if settings.models is None:
            raise ValueError("settings.models (TSERVE_MODELS / --models) is required")
        sources = model_sources(settings.models)
        engine = Engine(settings.engine_settings(), sources.directory, settings.adapters, sources.snapshots)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()  # NoModelsLoaded fails start-up: uvicorn logs it, python -m service exits 3
        if engine.load_errors:
            logger.warning("models that failed to load: %s", engine.load_errors)
        logger.info("ready: %s", ", ".join(m.name for m in engine.models()))
        try:
            yield
        finally:
            await engine.stop(settings.drain_timeout_s)
            tracing.shutdown()

    if settings.metrics_compat == "vllm":
        engine.metrics.registry.register(VllmCompatCollector(engine))
    # /docs and /redoc are routes/ui.py's: FastAPI's own load Swagger UI and ReDoc from a CDN (blank when air-gapped)
    app = FastAPI(title="tserve", version="0.1.0", description=DESCRIPTION, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.settings = settings
    app.state.engine = engine
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    # Added last = outermost: the request id is set before anything can answer; metrics see the
    # final status of every /v1 request, 401s and 413s included; a request without a valid key is refused before
    # its body is read; the body limit answers before routing; a client that hangs up cancels its handler
    # (innermost, so the metrics see it as 499).
    app.add_middleware(DisconnectMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit_for=_body_limit(settings))
    app.add_middleware(KeyFirstMiddleware, settings=settings)
    app.add_middleware(MetricsMiddleware)
    app.add_middleware(RequestIdMiddleware)
    if tracing.configure(settings.otlp_traces_endpoint):
        app.add_middleware(TracingMiddleware)  # outermost: the request's span covers every answer
    return app
