"""Large JSON answers serialized off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi.responses import Response
from pydantic import BaseModel


async def json_response(body: Callable[[], BaseModel], exclude_unset: bool = False) -> Response:
    """The answer ``body()`` builds, as an ``application/json`` response, built and serialized on a thread: a
    generate or completions answer of up to max_tokens_per_request token entries (megabytes with
    log-probabilities) holds /health and other requests only as long as pydantic holds the GIL."""
    content = await asyncio.to_thread(lambda: body().model_dump_json(exclude_unset=exclude_unset))
    return Response(content, media_type="application/json")
