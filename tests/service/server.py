"""A real server for the HTTP tests: service/local_server.py's ``running_server`` (``python -m service`` in a
subprocess on a free 127.0.0.1 port) and its helpers, plus what only the tests read (event streams).

Usage::

    with running_server(models_dir, adapters_dir, TSERVE_MAX_QUEUE="2") as server:
        httpx.get(server.url + "/ready")
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from service.local_server import (
    ROOT,
    Server,
    free_port,
    metric_samples,
    otlp_receiver,
    running_server,
    stop,
    wait_ready,
)

__all__ = ["ROOT", "Server", "free_port", "metric_samples", "otlp_receiver", "running_server", "sse_data", "stop",
           "wait_ready"]


def sse_data(lines: Iterator[str]) -> list:
    """The ``data:`` payloads of an event stream, JSON-decoded, with the final ``"[DONE]"`` kept as is."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
