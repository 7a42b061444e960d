"""POST /v1/completions and /v1/embeddings, wire-compatible with OpenAI's API, for causal_lm models and
classifier (encoder) models.

``"model": "name:adapter"`` selects a LoRA adapter. ``temperature: 0`` (or top_p 0) decodes greedily (n copies
of the one greedy completion when n > 1); otherwise top-p sampling, reproducible with ``seed``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from model.decoding import Strategy
from service.api import convert
from service.api.auth import Caller, caller, require_key
from service.api.deps import get_engine, get_settings, request_id, worker_for
from service.api.http_errors import errors
from service.api.routes.json_body import json_response
from service.api.routes.sse import SSE_RESPONSE, sse_response
from service.api.schemas import (
    DEFAULT_MAX_TOKENS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ConstraintRequest,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    TokenLogprob,
    Usage,
)
from service.engine.engine import Engine
from service.engine.errors import InvalidRequest
from service.engine.languages import per_input
from service.engine.limits import check_cost
from service.engine.requests import DecodingOptions, GenerationRequest
from service.engine.types import GenerationOutput, QueueTag, StreamEvent
from service.engine.worker import ModelWorker
from service.settings import Settings

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_key)])


# Engine field names as OpenAI calls them (for the 422s the engine raises).
_OPENAI_FIELDS = {"inputs": "prompt", "max_new_tokens": "max_tokens", "num_return_sequences": "n"}
_EMBEDDING_FIELDS = {"inputs": "input"}


def check_completion(req: CompletionRequest, settings: Settings) -> None:
    """Caps under OpenAI's field names, and fields accepted only at values that change nothing."""
    prompts = 1 if isinstance(req.prompt, str) else len(req.prompt)
    # max_tokens is the engine's to check (it knows the model's length); streams and greedy copies
    # are one engine input each, so the engine does not see how many prompts and choices there are.
    caps = (
        ("prompt", prompts, settings.max_inputs, "max_inputs"),
        ("n", req.n, settings.max_return_sequences, "max_return_sequences"),
    )
    for field, value, cap, setting in caps:
        if value > cap:
            raise InvalidRequest(field, f"{value} exceeds this server's limit of {cap} (setting {setting})")
    if req.echo and req.stream:
        raise InvalidRequest("echo", "is not supported with stream")
    if req.max_tokens == 0 and not req.echo:
        raise InvalidRequest("max_tokens", "0 generates nothing: it needs echo (to score the prompt)")
    unsupported = {
        "suffix": req.suffix is not None,
        "best_of": req.best_of is not None and req.best_of != req.n,
        "frequency_penalty": req.frequency_penalty != 0,
        "presence_penalty": req.presence_penalty != 0,
        "logit_bias": bool(req.logit_bias),
    }
    for field, used in unsupported.items():
        if used:
            raise InvalidRequest(field, "is not supported by this server; leave it unset (or at its default)")


def openai_names(exc: InvalidRequest, names: dict[str, str] = _OPENAI_FIELDS) -> InvalidRequest:
    """The engine's InvalidRequest with its field renamed as in OpenAI's API (inputs[1] -> prompt[1])."""
    base = exc.field.split("[")[0] if exc.field else None
    if base not in names:
        return exc
    return InvalidRequest(names[base] + exc.field[len(base):], exc.message)


def finish_reason(reason: str | None) -> str | None:
    """Ours (eos, stop, length) to OpenAI's (stop, length)."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def completion_logprobs(entries: list[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
    """OpenAI's legacy logprobs object of ``entries`` (tokens whose text starts at character ``offset``); the
    top_logprobs dicts hold the chosen token too, as OpenAI's do."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.text)
    tops = None
    if entries and entries[0].top_logprobs is not None:
        tops = [{a.text: a.logprob for a in e.top_logprobs} | {e.text: e.logprob} for e in entries]
    return CompletionLogprobs(tokens=[e.text for e in entries], token_logprobs=[e.logprob for e in entries],
                              top_logprobs=tops, text_offset=offsets)


def echo_logprobs(decode: Callable[[list[int]], str], prompt: list[int], prompt_lp: list[float | None],
                  prompt_tops: list | None, completion: list[TokenLogprob]) -> CompletionLogprobs:
    """OpenAI's logprobs object over the prompt's tokens, then the completion's."""
    tokens = [decode([t]) for t in prompt] + [e.text for e in completion]
    tops: list[dict[str, float] | None] | None = None
    if prompt_tops is not None:
        tops = [None if top is None else {decode([t]): lp for t, lp in top} | {tokens[k]: prompt_lp[k]}
                for k, top in enumerate(prompt_tops)]
        tops += [{a.text: a.logprob for a in e.top_logprobs or []} | {e.text: e.logprob} for e in completion]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[*prompt_lp, *(e.logprob for e in completion)],
                              top_logprobs=tops, text_offset=offsets)


def completion_constraint(req: CompletionRequest | ChatCompletionRequest) -> ConstraintRequest | None:
    """The constraint of vLLM's guided_* fields or OpenAI's response_format (at most one of them)."""
    given = {name: value for name, value in (("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
                                             ("guided_choice", req.guided_choice))
             if value is not None}
    if req.response_format is not None and req.response_format.type != "text":
        given["response_format"] = req.response_format
    if len(given) > 1:
        raise InvalidRequest(sorted(given)[1], f"give at most one of {sorted(given)}")
    if not given:
        return None
    (field, value), = given.items()
    try:
        if field == "guided_json":
            return ConstraintRequest(json_schema=json.loads(value) if isinstance(value, str) else value)
        if field == "guided_regex":
            return ConstraintRequest(regex=value)
        if field == "guided_choice":
            return ConstraintRequest(choice=value)
        if value.type == "json_object":
            return ConstraintRequest(json_schema={"type": "object"})
        if value.json_schema is None:
            raise InvalidRequest("response_format.json_schema", "is required with type json_schema")
        return ConstraintRequest(json_schema=value.json_schema.schema_)
    except (ValueError, TypeError) as exc:  # not JSON, or not a schema object
        raise InvalidRequest(field, f"is not a usable JSON schema: {exc}") from None


def completion_request(req: CompletionRequest, prompts: list[str], adapter: str | None,
                       worker: ModelWorker) -> GenerationRequest:
    """The engine's request for an OpenAI completion: top-p sampling, or greedy as temperature / top_p -> 0."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    max_tokens = req.max_tokens if req.max_tokens is not None else worker.capped_new_tokens(DEFAULT_MAX_TOKENS)
    decoding = decoding_options(req.temperature, req.top_p, 1 if req.stream else req.n, max_new_tokens=max_tokens,
                                seed=req.seed, logprobs=req.logprobs)
    return GenerationRequest(inputs=prompts, decoding=decoding, stop=stop, adapter=adapter,
                             constraint=convert.constraint(completion_constraint(req)), target_lang=req.target_lang,
                             source_lang=req.source_lang)


def decoding_options(temperature: float, top_p: float, samples: int, **given: Any) -> DecodingOptions:
    """OpenAI's sampling: top-p sampling of ``samples`` sequences, or greedy as temperature / top_p -> 0 (both tend
    to greedy in the limit); ``given``: more DecodingOptions fields."""
    if temperature < MIN_TEMPERATURE or top_p < MIN_TOP_P:
        return DecodingOptions(strategy=Strategy.GREEDY, **given)
    return DecodingOptions(strategy=Strategy.SAMPLE, temperature=temperature, top_p=top_p,
                           num_return_sequences=samples, **given)


@router.post(
    "/completions",
    name="completions",
    response_model=CompletionResponse,
    responses={200: SSE_RESPONSE, **errors(400, 401, 404, 413, 422, 429, 500, 503, 504)},
)
async def completions(
    req: CompletionRequest,
    request: Request,
    engine: Annotated[Engine, Depends(get_engine)],
    settings: Annotated[Settings, Depends(get_settings)],
    rid: Annotated[str, Depends(request_id)],
    client: Annotated[Caller, Depends(caller)],
) -> Response:
    """OpenAI-compatible text completion (also streamed as OpenAI's SSE chunks, ending `data: [DONE]`)."""
    name, _, adapter = req.model.partition(":")
    request.state.model, request.state.adapter = name, adapter or None
    worker = worker_for(engine, name)
    if worker.info.family not in ("causal_lm", "seq2seq"):
        raise InvalidRequest("model", f"{name!r} is a {worker.info.family} model; /v1/completions serves causal_lm "
                             "and seq2seq models")
    check_completion(req, settings)
    prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    generate = completion_request(req, prompts, adapter or None, worker)
    # Over the model's cap, max_tokens gets the engine's own 422 naming that cap.
    check_cost(settings.max_tokens_per_request, {"prompt": len(prompts), "n": req.n,
                                                 "max_tokens": min(generate.decoding.max_new_tokens,
                                                                   worker.max_new_tokens)},
               req.logprobs)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
    }
    queue = client.queue(req.priority)
    try:
        if req.stream:
            return await _stream(worker, prompts, req, generate, head, rid, queue)
        echoed = await worker.echo(prompts, adapter or None, req.logprobs or 0, rid, queue) if req.echo else None
        if req.max_tokens == 0:
            outputs = [GenerationOutput(text="", tokens=[], score=0.0, finish_reason="length", logprobs=[])
                       for _ in prompts]
        else:
            outputs = await worker.generate(generate, rid, queue)
    except InvalidRequest as exc:
        raise openai_names(exc) from None
    choices, completion_tokens = [], 0
    for i, out in enumerate(outputs):
        sequences = out.candidates if out.candidates is not None else [out] * req.n
        for j, seq in enumerate(sequences):
            text, logprobs = seq.text, completion_logprobs(seq.logprobs, 0)
            if echoed is not None:
                text = prompts[i] + seq.text
                if req.logprobs is not None:
                    logprobs = echo_logprobs(worker.checkpoint.tokenizer.decode, *echoed[i], seq.logprobs or [])
            choices.append(CompletionChoice(text=text, index=i * req.n + j, logprobs=logprobs,
                                            finish_reason=finish_reason(seq.finish_reason)))
            completion_tokens += len(seq.tokens)
    prompt = await worker.prompt_tokens(prompts)
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)
    return await json_response(lambda: CompletionResponse(**head, choices=choices, usage=usage))


async def _stream(
    worker: ModelWorker,
    prompts: list[str],
    req: CompletionRequest,
    generate: GenerationRequest,
    head: dict[str, Any],
    rid: str,
    queue: QueueTag,
) -> StreamingResponse:
    """One engine stream per (prompt, choice), merged; chunk index = prompt * n + choice.

    Stream k samples with seed + k, so with n = 1 each prompt draws what it draws unstreamed (seed + i);
    with n > 1 the samples differ from the unstreamed ones (equally valid draws).
    """
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    streams = await seeded_streams(worker, generate, prompts, req.n, rid, queue)
    try:
        prompt_count = await worker.prompt_tokens(prompts) if include_usage else 0  # once each, as unstreamed
    except BaseException:
        _discard(streams)
        raise
    generated = [0] * len(streams)
    offsets = [0] * len(streams)  # characters of text the stream's token entries covered so far

    def chunk(item: tuple[int, StreamEvent]) -> dict[str, Any]:
        index, e = item
        generated[index] += e.token is not None
        logprobs = completion_logprobs(e.logprobs, offsets[index])
        if logprobs is not None:
            offsets[index] += sum(len(t) for t in logprobs.tokens)
            logprobs = logprobs.model_dump()
        choice = {"text": e.text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason(e.finish_reason)}
        return {**head, "choices": [choice], **({"usage": None} if include_usage else {})}

    def usage_chunk() -> list[dict[str, Any]]:
        if not include_usage:
            return []
        completion = sum(generated)
        usage = {"prompt_tokens": prompt_count, "completion_tokens": completion,
                 "total_tokens": prompt_count + completion}
        return [{**head, "choices": [], "usage": usage}]

    return await sse_response(merge(streams), chunk, rid, after=usage_chunk)


async def seeded_streams(worker: ModelWorker, generate: GenerationRequest, prompts: list[str], n: int, rid: str,
                         queue: QueueTag) -> list[AsyncIterator[StreamEvent]]:
    """One engine stream per (prompt, choice), in that order: stream k samples with seed + k. A refusal of any
    discards those opened before it."""
    streams: list[AsyncIterator[StreamEvent]] = []
    targets = per_input("target_lang", generate.target_lang, len(prompts))  # each prompt's own language
    sources = per_input("source_lang", generate.source_lang, len(prompts))
    try:
        for k, (i, prompt) in enumerate((i, p) for i, p in enumerate(prompts) for _ in range(n)):
            seed = None if generate.decoding.seed is None else generate.decoding.seed + k
            ids = None if generate.prompt_ids is None else [generate.prompt_ids[i]]
            one = dataclasses.replace(generate, inputs=[prompt], prompt_ids=ids, target_lang=targets[i],
                                      source_lang=sources[i],
                                      decoding=dataclasses.replace(generate.decoding, seed=seed))
            streams.append(await worker.stream(one, rid, queue))
    except BaseException:
        _discard(streams)
        raise
    return streams


_discarding: set[asyncio.Task] = set()


def _discard(streams: list[AsyncIterator[StreamEvent]]) -> None:
    """Cancel streams whose jobs are queued but which were never iterated (a later prompt was refused):
    an engine stream cancels its job when closed after its first event, so take one and close."""

    async def close(stream: AsyncIterator[StreamEvent]) -> None:
        with contextlib.suppress(Exception):
            await anext(stream)
        await stream.aclose()

    for stream in streams:
        task = asyncio.create_task(close(stream))
        _discarding.add(task)
        task.add_done_callback(_discarding.discard)


async def merge(streams: list[AsyncIterator[StreamEvent]]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """Interleave several streams as (index, event). Every stream's first event is awaited before the
    first yield, so a refusal of any of them (queue full, too long) fails the whole request up front."""
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()
        raise failed[0]
    queue: asyncio.Queue[tuple[int, StreamEvent | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StreamEvent]) -> None:
        try:
            async for e in stream:
                await queue.put((index, e, None))
            await queue.put((index, None, None))
        except Exception as exc:
            await queue.put((index, None, exc))

    for index, first in enumerate(firsts):
        yield index, first
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, e, exc = await queue.get()
            if exc is not None:
                raise exc
            if e is None:
                open_streams -= 1
            else:
                yield index, e
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: the numbers, or base64 of their little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post(
    "/embeddings",
    name="embeddings",
    response_model=EmbeddingResponse,
    responses=errors(400, 401, 404, 413, 422, 429, 500, 503, 504),
)
async def embeddings(
    req: EmbeddingRequest,
    request: Request,
    engine: Annotated[Engine, Depends(get_engine)],
    rid: Annotated[str, Depends(request_id)],
    client: Annotated[Caller, Depends(caller)],
) -> EmbeddingResponse:
    """OpenAI-compatible embeddings of classifier (encoder) models: the vectors of `/v1/models/{model}/embed`
    with the model's default pooling and normalization."""
    request.state.model = req.model
    worker = worker_for(engine, req.model)
    if worker.family != "classifier":
        raise InvalidRequest("model", f"{req.model!r} is a {worker.family} model; /v1/embeddings serves classifier "
                             "(encoder) models")
    size = worker.config.d_model
    if req.dimensions is not None and req.dimensions != size:
        raise InvalidRequest("dimensions", f"{req.dimensions} differs from model {req.model!r}'s embedding size "
                             f"{size} (vectors are not shortened): leave it unset or send {size}")
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    try:
        vectors = await worker.embed(texts, None, rid, None, client.queue(req.priority))
    except InvalidRequest as exc:
        raise openai_names(exc, _EMBEDDING_FIELDS) from None
    tokens = sum(map(len, await worker.inputs.input_ids(texts)))
    data = [Embedding(index=i, embedding=encode_vector(v, req.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=req.model, usage=EmbeddingUsage(prompt_tokens=tokens,
                                                                              total_tokens=tokens))
