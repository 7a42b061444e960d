"""Server-sent events: errors surface as statuses until the first event, as an error event after."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from service.api.http_errors import error_payload
from service.engine.errors import ServiceError

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# The 200 response of a streaming route in OpenAPI: ``itemSchema`` describes one event (OpenAPI 3.2's
# keyword for sequential media types; before 3.2, tools such as schemathesis read a plain ``schema``
# of text/event-stream as the schema of each event, not of the whole body as a string).
SSE_RESPONSE = {
    "content": {
        "text/event-stream": {
            "itemSchema": {
                "type": "object",
                "required": ["data"],
                "properties": {
                    "data": {
                        "type": "string",
                        "description": "A JSON object (a token event, or an error object once the stream has "
                        "started), or `[DONE]` last.",
                    },
                    "event": {"type": "string"},
                    "id": {"type": "string"},
                    "retry": {"type": "integer"},
                },
            }
        }
    },
    "description": "With stream=true: `data: <json>` events, then `data: [DONE]`.",
}


def event(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def sse_response(
    events: AsyncIterator[Any], encode: Callable[[Any], Any], rid: str, after: Callable[[], list[Any]] | None = None
) -> StreamingResponse:
    """Await the first event (so a rejected request gets its status), then stream the rest.

    ``encode`` turns one item into the JSON of its event; ``after`` gives extra events before [DONE].
    """
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield event(encode(first))
                async for item in events:
                    yield event(encode(item))
            for extra in after() if after else []:
                yield event(extra)
            yield DONE
        except ServiceError as exc:
            yield event(error_payload(exc.code, str(exc), getattr(exc, "field", None), rid))
        except Exception as exc:  # the status is sent already: report in-band, keep the server up
            logger.error("stream of request %s failed", rid, exc_info=exc)
            yield event(error_payload("internal_error", "internal error during the stream", None, rid))
        finally:
            await events.aclose()  # a client that hangs up cancels its request in the engine

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
