"""Large JSON answers serialized off the event loop."""

from __future__ import annotations

import asyncio

from fastapi.responses import Response
from pydantic import BaseModel


async def json_response(body: BaseModel, exclude_unset: bool = False) -> Response:
    """``body`` as an ``application/json`` response, serialized on a thread: a generate or completions answer of up
    to max_tokens_per_request token entries (megabytes with log-probabilities) never holds /health or other
    requests while it is written."""
    content = await asyncio.to_thread(body.model_dump_json, exclude_unset=exclude_unset)
    return Response(content, media_type="application/json")
