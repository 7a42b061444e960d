"""Exceptions the engine raises; each carries the HTTP status and a stable error code.

The message (``str(exc)``) names the field, limit or thing involved, so the HTTP layer can return it
as is: ``{"error": {"code": exc.code, "message": str(exc)}}`` with ``exc.status``.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class: a request the engine refused or could not complete."""

    status: int = 500
    code: str = "internal_error"


class InvalidRequest(ServiceError):
    """The request is malformed or exceeds a limit: ``field`` (a request field such as ``inputs[2]``, or None)
    and the message about it; ``str(exc)`` is ``"inputs[2]: 612 tokens exceeds max_input_tokens=512"``."""

    status = 422
    code = "invalid_request"

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class NotFound(ServiceError):
    """Unknown model or adapter."""

    status = 404
    code = "not_found"


class Conflict(ServiceError):
    """The request conflicts with the current state of a resource."""

    status = 409
    code = "conflict"


class QueueFull(ServiceError):
    """The model's queue (or its resident-adapter slots) is full; retry after ``retry_after`` seconds."""

    status = 429
    code = "queue_full"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NotReady(ServiceError):
    """The engine is starting or shutting down."""

    status = 503
    code = "not_ready"


class RequestTimeout(ServiceError):
    """The request exceeded its deadline; its rows were freed."""

    status = 504
    code = "timeout"


class EngineFailure(ServiceError):
    """The computation of one request failed (the others in its batch are unaffected)."""

    status = 500
    code = "engine_failure"

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id


__all__ = [
    "Conflict",
    "EngineFailure",
    "InvalidRequest",
    "NotFound",
    "NotReady",
    "QueueFull",
    "RequestTimeout",
    "ServiceError",
]
