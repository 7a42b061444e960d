"""/v1/models/{name}: load and unload whole models at run time (admin key), as Triton's model control does.

A load reads a directory under the models directory (``--models``) as start-up does (its load deadline, warm-up);
a failing one is a 422 that says why, and the other models serve on (it is not listed under GET /v1/models'
``failed``, which keeps start-up failures). An unload takes the model off the list at once (new requests for it:
404), lets its in-flight requests finish within drain_timeout_s (then 503, as at shutdown), stops its threads,
removes its metric series and releases its memory. /v1/models, /ready, /metrics and the vLLM-compat gauges read
the engine's models, so they follow.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi import Path as PathParam

from service.api.auth import require_admin, require_key
from service.api.deps import get_engine, get_settings
from service.api.http_errors import answer_other_methods, errors
from service.api.routes.models import model_schema
from service.api.schemas import NAME_PATTERN, ModelInfoSchema, ModelLoadRequest
from service.engine.engine import Engine
from service.settings import Settings

router = APIRouter(prefix="/v1/models", tags=["model control"], dependencies=[Depends(require_key)])

ModelName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="The name the model is served under.")]
EngineDep = Annotated[Engine, Depends(get_engine)]


@router.put("/{name}", name="load_model", response_model=ModelInfoSchema, dependencies=[Depends(require_admin)],
            responses=errors(400, 401, 403, 409, 413, 422, 503))
async def load_model(name: ModelName, req: ModelLoadRequest, request: Request, engine: EngineDep) -> ModelInfoSchema:
    """Load the model directory `path` (relative to the models directory) and serve it as `name`. 409 while a model
    of that name is loaded (unload it first); 422 for a path outside the models directory or a model that did not
    load, saying why (the other models serve on)."""
    info = await engine.load_model(name, req.path)
    return model_schema(info, request.app.state.started_at)


@router.delete("/{name}", name="unload_model", status_code=204, dependencies=[Depends(require_admin)],
               responses=errors(401, 403, 404, 422, 503))
async def unload_model(name: ModelName, engine: EngineDep, settings: Annotated[Settings, Depends(get_settings)]
                       ) -> None:
    """Unload model `name`: new requests for it get 404 at once, in-flight ones finish within drain_timeout_s
    (then 503), and its memory is released. Its files stay: it is loaded again when the server next starts."""
    await engine.unload_model(name, settings.drain_timeout_s)


answer_other_methods(router, "/{name}")
