"""POST /v1/tokenize and /v1/detokenize in vLLM's shapes, for every model family.

A translator (seq2seq) reads and writes here with its source tokenizer: /detokenize inverts /tokenize.
Under /v1, and at vLLM's own root paths (``ROOT_PATHS``) for its clients: the same handlers, the same key, the
same request metrics; the OpenAPI schema lists the /v1 paths only.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from service.api.auth import require_key
from service.api.deps import get_engine, worker_for
from service.api.http_errors import errors
from service.api.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from service.engine.engine import Engine
from service.engine.errors import InvalidRequest

router = APIRouter(prefix="/v1", tags=["tokenize"], dependencies=[Depends(require_key)])
_ERRORS = errors(400, 401, 404, 413, 422, 503)


@router.post("/tokenize", name="tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(req: TokenizeRequest, request: Request,
                   engine: Annotated[Engine, Depends(get_engine)]) -> TokenizeResponse:
    """The token ids of a text, as vLLM's `/tokenize` gives them (`count`, `max_model_len`, `tokens`)."""
    request.state.model = req.model
    worker = worker_for(engine, req.model)
    try:
        (ids,) = await worker.inputs.input_ids([req.prompt], req.add_special_tokens, field="prompt")
    except InvalidRequest as exc:  # the one index of a single prompt is not the client's
        raise InvalidRequest("prompt", exc.message) from None
    strings = None
    if req.return_token_strs:
        strings = await asyncio.to_thread(worker.checkpoint.prompt_tokenizer.token_strings, ids)
    return TokenizeResponse(count=len(ids), max_model_len=worker.max_input_tokens, tokens=ids, token_strs=strings)


@router.post("/detokenize", name="detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(req: DetokenizeRequest, request: Request,
                     engine: Annotated[Engine, Depends(get_engine)]) -> DetokenizeResponse:
    """The text of token ids, as vLLM's `/detokenize` gives it (special tokens kept)."""
    request.state.model = req.model
    tokenizer = worker_for(engine, req.model).checkpoint.prompt_tokenizer
    size = tokenizer.vocab_size
    for i, token in enumerate(req.tokens):
        if token >= size:
            raise InvalidRequest(f"tokens[{i}]", f"{token} is outside the vocabulary of model {req.model!r} (ids 0 to "
                                 f"{size - 1})")
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, req.tokens, False))


# vLLM's paths at the root, for clients written against vLLM: the /v1 handlers under the same key.
ROOT_PATHS = ("/tokenize", "/detokenize")
root_router = APIRouter(tags=["tokenize"], dependencies=[Depends(require_key)], include_in_schema=False)
for _path, _handler, _response in zip(ROOT_PATHS, (tokenize, detokenize), (TokenizeResponse, DetokenizeResponse),
                                      strict=True):
    root_router.add_api_route(_path, _handler, methods=["POST"], name=_handler.__name__, response_model=_response)
