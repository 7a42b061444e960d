"""Connection limits uvicorn lacks: header and body read time-outs and a cap on open connections.

uvicorn times out only idle keep-alive connections, and only after a first response: a client that
opens a connection and sends its request line or headers slowly (or not at all), or stalls in the
middle of a body, holds its connection (and file descriptor) for ever. :class:`GuardedH11Protocol`
is uvicorn's h11 protocol with three more rules:

- the request headers must be complete ``header_timeout_s`` after the connection opens or the
  previous response ends (a deadline, so trickling bytes does not extend it); when it passes the
  client gets a 408 if it had sent part of a request, and the connection is closed;
- while a request body is being read, each read must come within ``body_timeout_s`` of the last
  (an inactivity time-out, so a large upload over a slow link passes while it makes progress): when
  it passes the client gets a 408 if no response has started, and the connection is closed. Time the
  server itself is not reading (the application has not taken the body yet) does not count;
- at most ``max_connections`` connections are open: one more is answered 503 and closed at once.

h11 is pinned (not uvicorn's "auto", which prefers httptools when installed) because these rules
subclass uvicorn's h11 protocol; h11 also caps the request head at 16 KiB (400 above).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.api.http_errors import error_payload


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits :class:`GuardedH11Protocol` enforces (from the service settings)."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


def canned_response(status: int, code: str, message: str, extra_headers: str = "") -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response in the service's error shape."""
    body = json.dumps(error_payload(code, message, None, None)).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n{extra_headers}\r\n"
    )
    return head.encode("latin-1") + body


HEADER_TIMEOUT = canned_response(408, "request_timeout", "the request headers did not arrive in time")
BODY_TIMEOUT = canned_response(408, "request_timeout", "the request body stopped arriving")
TOO_MANY_CONNECTIONS = canned_response(
    503, "too_many_connections", "this server has as many connections open as it takes", "retry-after: 1\r\n"
)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body read time-outs and a connection cap (module docstring)."""

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over_cap = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if over_cap:
            self._reply_and_close(TOO_MANY_CONNECTIONS)
        else:
            self._arm_timers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._arm_timers()

    def _arm_timers(self) -> None:
        """Set the timers for what the connection now waits for: request headers, body, or neither."""
        waiting = self.conn.their_state
        if self.transport.is_closing() or waiting is not h11.IDLE:
            self._cancel_header_timer()
        elif self._header_timer is None:  # a deadline: armed once per request
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)
        self._cancel_body_timer()
        if not self.transport.is_closing() and waiting is h11.SEND_BODY:  # re-armed on each read
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        partial_request = bool(self.conn.trailing_data[0])
        self._reply_and_close(HEADER_TIMEOUT if partial_request else b"")

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the application has not taken the body yet: not the client's stall
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
            return
        cycle = self.cycle
        answer = cycle is not None and not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application's receive() says http.disconnect; its send() is dropped
            cycle.message_event.set()
        self._reply_and_close(BODY_TIMEOUT if answer else b"")

    def _reply_and_close(self, response: bytes) -> None:
        if response:
            self.transport.write(response)
        self.transport.close()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` subclass bound to ``limits``, for ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
