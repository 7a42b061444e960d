"""The one error shape, ``{"error": {"code", "message", "field", "request_id"}}``, for every failure.

Engine errors (:class:`ServiceError`) keep their status and code; FastAPI's validation errors,
Starlette's 404/405 and anything unexpected are reformatted into the same shape.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope, Send

from service.api.schemas import ErrorResponse
from service.engine.errors import EngineFailure, QueueFull, ServiceError

logger = logging.getLogger(__name__)

CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "queue_full",
    500: "internal_error",
    503: "not_ready",
    504: "timeout",
}
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")  # RFC 9110, 5789
# Union members are tagged "str"/"list"/"object" in request schemas (no request has a field of those names); the
# tags are not fields, so they leave the path.
_UNION_TAGS = {"str", "list", "object"}


def request_id(scope: Scope) -> str | None:
    return scope.get("state", {}).get("request_id")


def error_payload(code: str, message: str, field: str | None, rid: str | None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "field": field, "request_id": rid}}


def error_response(
    request: Request,
    status: int,
    message: str,
    *,
    code: str | None = None,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
    rid: str | None = None,
) -> JSONResponse:
    payload = error_payload(code or CODES.get(status, "error"), message, field, rid or request_id(request.scope))
    return JSONResponse(payload, status_code=status, headers=dict(headers or {}))


async def json_error(status: int, code: str, message: str, scope: Scope, send: Send,
                     extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Send an error from raw ASGI (middleware that answers before the app runs)."""
    body = json.dumps(error_payload(code, message, None, request_id(scope)), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    if status == 413:
        headers.append((b"connection", b"close"))  # the unread body must not be parsed as a next request
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def field_path(loc: Sequence[Any]) -> str | None:
    """("body", "inputs", 0, "str") -> "inputs[0]"; ("path", "model") -> "model"."""
    parts = list(loc[1:]) if loc and loc[0] in ("body", "path", "query", "header") else list(loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _UNION_TAGS:
            out += f".{part}" if out else str(part)
    return out or (str(loc[0]) if loc else None)


def _describe(error: Mapping[str, Any]) -> str:
    if error.get("type") == "json_invalid":
        position = error.get("loc", ("body", "?"))[-1]
        return f"not valid JSON at character {position}: {error.get('ctx', {}).get('error', 'decode error')}"
    message = str(error.get("msg", "invalid value"))
    return message.removeprefix("Value error, ")


def _field(error: Mapping[str, Any]) -> str | None:
    return "body" if error.get("type") == "json_invalid" else field_path(error.get("loc", ()))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    fields = [_field(e) for e in errors]
    parts = [f"{f}: {_describe(e)}" if f else _describe(e) for f, e in zip(fields, errors, strict=True)]
    if len(parts) > 5:
        parts = parts[:5] + [f"and {len(parts) - 5} more"]
    return error_response(request, 422, "; ".join(parts) or "invalid request", field=fields[0] if fields else None)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    headers = {}
    if isinstance(exc, QueueFull):
        headers["Retry-After"] = str(max(1, math.ceil(getattr(exc, "retry_after", 1.0) or 1.0)))
    rid = None
    if isinstance(exc, EngineFailure):
        rid = getattr(exc, "request_id", None)
        logger.error("engine failure on request %s: %s", rid or request_id(request.scope), exc)
    return error_response(
        request, exc.status, str(exc), code=exc.code, field=getattr(exc, "field", None), headers=headers, rid=rid
    )


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404 and exc.detail == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif status == 400 and isinstance(exc.__cause__, UnicodeError):
        message = "body is not valid UTF-8"
    elif status == 400 and isinstance(exc.__cause__, RecursionError):
        message = "body is not valid JSON: nested too deeply"
    elif status == 400 and isinstance(exc.__cause__, ValueError):  # e.g. an integer of over 4300 digits
        message = f"body is not valid JSON: {str(exc.__cause__).split(';')[0]}"  # not Python's advice after ';'
    else:
        message = str(exc.detail)
    return error_response(request, status, message, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Runs in ServerErrorMiddleware, outside RequestIdMiddleware: set the header here.
    rid = request_id(request.scope)
    logger.error("unhandled error on request %s", rid, exc_info=exc)
    response = error_response(request, 500, "internal error; the request id identifies it in the server log")
    if rid:
        response.headers["X-Request-ID"] = rid
    return response


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status with the error model, so /docs lists every failure."""
    described = {
        400: "Malformed body (e.g. not UTF-8).",
        401: "Missing or invalid API key (when keys are configured).",
        403: "The key may not do this (admin key needed).",
        404: "Unknown model, adapter or route.",
        409: "Conflicts with the current state.",
        413: "Body over the size limit.",
        415: "Unsupported Content-Type.",
        422: "Invalid request; the message names the field and the limit.",
        429: "Queue full; retry after the Retry-After header's seconds.",
        500: "Engine failure; the request id identifies it in the log.",
        503: "Models not loaded yet, or shutting down.",
        504: "The request took longer than the time-out.",
    }
    return {s: {"model": ErrorResponse, "description": described[s]} for s in statuses}


def answer_other_methods(router: APIRouter, path: str) -> None:
    """A 405 listing every method of ``router``'s routes at ``path`` for the other methods (Starlette names only
    the first route's, e.g. ``Allow: PUT`` where DELETE is allowed too). Added after those routes."""
    allowed = sorted({m for r in router.routes if isinstance(r, APIRoute) and r.path == router.prefix + path
                      for m in r.methods})

    async def method_not_allowed() -> None:
        raise HTTPException(405, headers={"Allow": ", ".join(allowed)})

    others = [m for m in HTTP_METHODS if m not in allowed]
    router.add_api_route(path, method_not_allowed, methods=others, include_in_schema=False)
