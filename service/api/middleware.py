"""Pure ASGI middleware: request ids, keys before bodies, the body-size limit, per-request metrics, client
disconnects.

Pure ASGI (not BaseHTTPMiddleware) so that streaming responses pass through untouched and the
body limit acts on the raw byte stream, before anything parses JSON.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Callable

from fastapi import HTTPException
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.auth import role_of
from service.api.http_errors import HTTP_METHODS, json_error
from service.api.routes.tokenize import ROOT_PATHS
from service.engine import tracing
from service.engine.errors import ServiceError
from service.settings import Settings

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"
UNTRACED_PATHS = ("/health", "/ready", "/metrics", "/favicon.ico")  # probes and scrapes: noise in a trace store
CLIENT_CLOSED = 499  # status recorded for a request whose client hung up before its response (nginx's)
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
UNKNOWN = "_unknown"


class RequestIdMiddleware:
    """Gives every request an id (a sane client X-Request-ID, else a new one) and echoes it back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        rid = given if given is not None and _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyTooLarge(HTTPException):
    """Raised from receive() once the body passes the limit; rendered as 413 by the error handlers
    (FastAPI re-raises HTTPExceptions met while reading a body instead of turning them into 400s)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over this server's limit of {limit} bytes")


class BodyLimitMiddleware:
    """413 for bodies over ``limit_for(scope)`` bytes: from Content-Length before the app runs, and
    counted while the app reads the body (chunked uploads or a lying Content-Length)."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], int]) -> None:
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return await json_error(400, "bad_request", "Content-Length is not a number", scope, send)
            if int(declared) > limit:
                return await json_error(413, "payload_too_large", BodyTooLarge(limit).detail, scope, send)
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watch_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watch_send)
        except BodyTooLarge as exc:  # read outside a route (the handlers render it inside one)
            if started:
                raise
            await json_error(413, "payload_too_large", exc.detail, scope, send)


def is_api_path(path: str) -> bool:
    """The API's paths (/v1, and vLLM's root paths of routes/tokenize.py): behind keys, measured per request."""
    return path.startswith("/v1/") or path in ROOT_PATHS


class KeyFirstMiddleware:
    """With API keys on, an API request without a valid key is answered 401 before its body is read, let alone
    parsed: a client without a key learns nothing from a malformed body. The routes' ``require_key`` decides the
    same way again (service.api.auth, one rule) and gives them the caller's role."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.settings.auth_enabled and is_api_path(scope["path"]):
            try:
                role_of(Headers(scope=scope).get("authorization"), self.settings)
            except HTTPException as exc:  # the unread body must not be parsed as a next request: close
                headers = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
                await json_error(exc.status_code, "unauthorized", exc.detail, scope, send,
                                 [*headers, (b"connection", b"close")])
                return
        await self.app(scope, receive, send)


class MetricsMiddleware:
    """Records ``engine.metrics.record_request`` once per API request (/v1, and vLLM's root paths of
    service.api.routes.tokenize), whatever its outcome.

    Labels stay bounded: a model or adapter the server does not know is recorded as ``_unknown``;
    routes put the adapter (and, for /v1/completions, the model) in ``request.state``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api_path(scope["path"]):
            return await self.app(scope, receive, send)
        status = 500

        async def watch_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch_send)
        finally:
            if scope.get("state", {}).get("client_disconnected"):
                status = CLIENT_CLOSED  # the client left before its response was complete (none, or a cut stream)
            try:
                self._record(scope, status)
            except Exception:  # metrics must never fail a request
                logger.exception("recording request metrics failed")

    def _record(self, scope: Scope, status: int) -> None:
        engine = getattr(scope["app"].state, "engine", None)
        if engine is None:
            return
        state = scope.get("state", {})
        route = scope.get("route")
        endpoint = getattr(route, "name", None) or UNKNOWN
        model = state.get("model") or scope.get("path_params", {}).get("model")
        adapter = state.get("adapter")
        try:
            worker = engine.get(model) if model else None
        except ServiceError:
            worker = None
        if worker is None:
            model, adapter = UNKNOWN, (None if adapter is None else UNKNOWN)
        elif adapter is not None and status >= 400 and adapter not in worker.registry.names():
            adapter = UNKNOWN
        engine.metrics.record_request(model, endpoint, adapter or "", status)


class DisconnectMiddleware:
    """Cancels a POST request's handler when its client hangs up before the response is complete.

    Starlette notices a disconnect only while it streams; a plain JSON endpoint would run to its end,
    a generation holding its batch rows and KV cache for nobody. Once the body is read, a watcher task
    is the only caller of the server's ``receive()``: on ``http.disconnect`` it cancels the handler
    (the engine job it awaits is cancelled with it and leaves the batch at the next step) and passes
    the disconnect on to the app's own ``receive()`` callers (StreamingResponse listens there).
    POST only (the inference routes): adapter uploads run to the end rather than stop mid-swap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body_read, disconnected = asyncio.Event(), asyncio.Event()
        response_done = False

        async def app_receive() -> Message:
            if body_read.is_set():
                await disconnected.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def app_send(message: Message) -> None:
            nonlocal response_done
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_done = True  # before sending: the server reports a disconnect once it is out
            await send(message)

        async def watch(handler: asyncio.Task) -> None:
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            if not response_done and not handler.done():
                scope.setdefault("state", {})["client_disconnected"] = True
                logger.info("request %s: client disconnected; cancelled", scope["state"].get("request_id"))
                handler.cancel()

        handler = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        watcher = asyncio.ensure_future(watch(handler))
        try:
            await handler
        except asyncio.CancelledError:
            # Ours (the client left): nothing to answer. The server's (shutdown): pass it on.
            current = asyncio.current_task()
            if not scope.get("state", {}).get("client_disconnected") or (current and current.cancelling()):
                raise
        finally:
            watcher.cancel()


class TracingMiddleware:
    """A server span per HTTP request (probes and scrapes left out), parented by the caller's ``traceparent``,
    whose context the response returns in its own ``traceparent`` header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or tracing.tracer() is None or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry.propagate import extract, inject
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        method = scope["method"] if scope["method"] in HTTP_METHODS else "_OTHER"  # OpenTelemetry's bounded name
        # Named "{method} {route template}" once routed; until then (and for a path no route matches) by the
        # method alone, as OpenTelemetry's HTTP conventions name it: a raw path would make span names unbounded.
        with tracing.tracer().start_as_current_span(method, context=extract(carrier),
                                           kind=SpanKind.SERVER) as span:
            span.set_attributes({"http.request.method": method, "url.path": scope["path"]})
            returned: dict[str, str] = {}
            inject(returned)

            async def send_with_context(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                    message = {**message, "headers": [*message.get("headers", []),
                                                      *((k.encode(), v.encode()) for k, v in returned.items())]}
                await send(message)

            try:
                await self.app(scope, receive, send_with_context)
            finally:
                route = scope.get("route")
                if route is not None and hasattr(route, "path"):
                    span.update_name(f"{method} {route.path}")
                    span.set_attribute("http.route", route.path)
