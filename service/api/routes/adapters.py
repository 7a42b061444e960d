"""/v1/models/{model}/adapters: list, load (from the adapter directory or an uploaded archive), unload.

An upload is parsed in a child process (service.api.archive_sandbox) into an upload directory beside its
target; the worker checks it against the model in full, and only then swaps it in atomically
(service.engine.adapter_store) and loads it (ModelWorker.install_adapter); parsing and checking happen outside the
worker's adapter lock, so a slow upload holds up no one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Scope

from service.api import archive_sandbox
from service.api.archive import ArchiveError
from service.api.auth import require_admin, require_key
from service.api.deps import get_settings, get_worker
from service.api.http_errors import answer_other_methods, errors
from service.api.schemas import NAME_PATTERN, AdapterInfoSchema, AdapterList
from service.engine import adapter_store
from service.engine.errors import InvalidRequest
from service.engine.types import AdapterInfo
from service.engine.worker import ModelWorker
from service.settings import Settings

router = APIRouter(prefix="/v1/models/{model}/adapters", tags=["adapters"], dependencies=[Depends(require_key)])

Worker = Annotated[ModelWorker, Depends(get_worker)]
AdapterName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="The adapter's name.")]
ARCHIVE_TYPES = (
    "application/gzip",
    "application/x-gzip",
    "application/zip",
    "application/x-zip-compressed",
    "application/octet-stream",
)
_UPLOAD_BODY = {
    "required": False,
    "description": "Optional PEFT-layout archive (.tar.gz or .zip) holding adapter_config.json and "
    "adapter_model.safetensors at its top level. Without a body the adapter is loaded from "
    "<adapters dir>/<model>/<name>/.",
    "content": {t: {"schema": {"type": "string", "format": "binary"}} for t in ARCHIVE_TYPES},
}


@router.get("", name="list_adapters", response_model=AdapterList, responses=errors(401, 404, 422, 503))
async def list_adapters(worker: Worker) -> AdapterList:
    """Adapters of this model: resident ones and those on disk that load on first use."""
    return AdapterList(adapters=[adapter_schema(a) for a in worker.list_adapters()])


@router.put(
    "/{name}",
    name="load_adapter",
    response_model=AdapterInfoSchema,
    dependencies=[Depends(require_admin)],
    responses=errors(400, 401, 403, 404, 409, 413, 415, 422, 429, 500, 503, 504),
    openapi_extra={"requestBody": _UPLOAD_BODY},
)
async def load_adapter(
    name: AdapterName, request: Request, worker: Worker, settings: Annotated[Settings, Depends(get_settings)]
) -> AdapterInfoSchema:
    """Load (or reload) adapter `name`, from the adapter directory or from the uploaded archive."""
    request.state.adapter = name
    data = await request.body()  # bounded by the body-limit middleware (max_adapter_upload_bytes)
    if not data:
        return adapter_schema(await worker.load_adapter(name))
    _check_content_type(request)
    target = worker.adapter_directory(name)
    upload = await asyncio.to_thread(adapter_store.new_upload_dir, target.parent)
    try:
        try:
            await archive_sandbox.extract(data, settings.max_adapter_upload_bytes, upload)
        except ArchiveError as exc:
            raise InvalidRequest("body", f"adapter archive rejected: {exc}") from None
        return adapter_schema(await worker.install_adapter(name, upload))
    finally:
        await asyncio.to_thread(shutil.rmtree, upload, True)  # what a refused upload left (gone once swapped in)


@router.delete(
    "/{name}",
    name="unload_adapter",
    status_code=204,
    dependencies=[Depends(require_admin)],
    responses=errors(401, 403, 404, 422, 500, 503),
)
async def unload_adapter(name: AdapterName, request: Request, worker: Worker) -> None:
    """Unload adapter `name` from memory; requests already using it finish first. Its files stay, so it is found
    again when the server next starts: delete its directory to remove it for good."""
    request.state.adapter = name
    await worker.unload_adapter(name)


def is_upload(scope: Scope) -> bool:
    """Whether ``scope`` is an adapter upload (load_adapter's method and path: the route itself says, for the
    body limit of uploads)."""
    return _LOAD_ROUTE.matches(scope)[0] == Match.FULL


def adapter_schema(info: AdapterInfo) -> AdapterInfoSchema:
    return AdapterInfoSchema.model_validate(dataclasses.asdict(info))


def _check_content_type(request: Request) -> None:
    given = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if given not in ARCHIVE_TYPES:
        raise HTTPException(
            415, f"an adapter upload needs Content-Type one of {', '.join(ARCHIVE_TYPES)}; got {given or 'none'}"
        )


answer_other_methods(router, "/{name}")
_LOAD_ROUTE = next(r for r in router.routes if isinstance(r, APIRoute) and r.name == "load_adapter")
