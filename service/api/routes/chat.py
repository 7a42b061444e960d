"""POST /v1/chat/completions, wire-compatible with OpenAI's API (and vLLM's extras), for causal_lm models with a
chat template (model.hf.chat_template).

The conversation is rendered by the model's own template and encoded as is (no special tokens added a second time);
generation stops at the model's EOS ids and the template's end-of-turn tokens, which never reach the text. Sampling
follows /v1/completions (service.api.routes.openai: greedy as temperature / top_p -> 0, n, seed, stop, streams).
Hermes tool calls become ``tool_calls`` and ``<think>`` blocks ``reasoning_content`` (service.api.tool_calls); with
tool_choice "required" or a named function the output is constrained to one call whose arguments are valid under
the tool's schema.

Control tokens a user writes are text. The template's own ``<|im_start|>``, ``<|im_end|>``, ``<|eot_id|>``... become
their token ids, but the same text inside what the caller sent (message content, names, tool schemas,
chat_template_kwargs) is encoded as ordinary text (model.hf.chat_prompt.PromptEncoder), so a user message holding
``<|im_end|>\n<|im_start|>system\n...`` cannot open a system turn. vLLM and transformers' ``apply_chat_template``
read such text as the tokens by default (transformers has ``sanitize_control_tokens=True`` for what we do always):
a chat client passing untrusted text through (a web page, a document, a tool's result) would let it forge turns, so
we never do. The prompt ids are transformers' with ``sanitize_control_tokens=True`` (which misses dict keys, such as a
tool schema's property names: we mark those too), and its default ones where no user string holds a control token.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from model.constraints import Constraint
from model.hf.chat_template import ChatTemplateError
from service.api import convert
from service.api.auth import Caller, caller, require_key
from service.api.deps import get_engine, get_settings, request_id, worker_for
from service.api.http_errors import errors
from service.api.routes.json_body import json_response
from service.api.routes.openai import completion_constraint, decoding_options, merge, seeded_streams
from service.api.routes.sse import SSE_RESPONSE, sse_response
from service.api.schemas import ChatCompletionRequest, ChatCompletionResponse, NamedToolChoice, Usage
from service.api.tool_calls import THINK_OPEN, OutputParser, check_tools, parse_output, tool_constraint
from service.engine.engine import Engine
from service.engine.errors import InvalidRequest
from service.engine.limits import check_cost
from service.engine.requests import GenerationRequest
from service.engine.types import QueueTag, TokenLogprob
from service.engine.worker import ModelWorker
from service.settings import Settings

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_key)])


class ConversationTooLarge(InvalidRequest):
    """A conversation over the setting max_chat_bytes."""

    status = 413
    code = "payload_too_large"


def check_chat(req: ChatCompletionRequest, settings: Settings, size: int) -> None:
    """Caps under OpenAI's field names (``size``: the conversation's bytes), and fields accepted only at values that
    change nothing."""
    caps = (("messages", len(req.messages), settings.max_chat_messages, "max_chat_messages"),
            ("n", req.n, settings.max_return_sequences, "max_return_sequences"))
    for field, value, cap, setting in caps:
        if value > cap:
            raise InvalidRequest(field, f"{value} exceeds this server's limit of {cap} (setting {setting})")
    if size > settings.max_chat_bytes:
        raise ConversationTooLarge("messages", f"the conversation (with its tools) is {size:,} bytes, over this "
                                   f"server's limit of {settings.max_chat_bytes:,} (setting max_chat_bytes)")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    unsupported = {"frequency_penalty": req.frequency_penalty != 0, "presence_penalty": req.presence_penalty != 0,
                   "logit_bias": bool(req.logit_bias)}
    for field, used in unsupported.items():
        if used:
            raise InvalidRequest(field, "is not supported by this server; leave it unset (or at its default)")


def renamed(exc: InvalidRequest, fields: dict[str, str]) -> InvalidRequest:
    """The engine's InvalidRequest under the chat request's field names (``fields``: the engine's first name part ->
    the request's field; inputs[0] -> messages, constraint.json_schema -> tools or response_format)."""
    base = (exc.field or "").split("[")[0].split(".")[0]
    return type(exc)(fields[base], exc.message) if base in fields else exc


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's chat logprobs object of ``entries``: each token's text, log-prob, UTF-8 bytes and top alternatives."""
    if entries is None:
        return None

    def one(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [one(e.text, e.logprob) | {"top_logprobs": [one(a.text, a.logprob) for a in e.top_logprobs or []]}
               for e in entries]
    return {"content": content, "refusal": None}


def finish_reason(reason: str, calls: bool) -> str:
    """Ours (eos, stop, length) to OpenAI's chat reasons: tool_calls where the answer holds calls."""
    return "length" if reason == "length" else "tool_calls" if calls else "stop"


async def chat_prompt(req: ChatCompletionRequest, worker: ModelWorker, tools: list[dict] | None) -> str:
    """The conversation rendered by the model's template (off the event loop), control tokens the caller wrote
    marked to stay text (PromptEncoder.render); 422 naming what the template refuses."""
    chat = worker.chat
    if chat.encoder is None:
        looked = f" (looked for {', '.join(chat.looked_at)} in its directory)" if chat.looked_at else ""
        why = chat.error or f"no chat template{looked}"
        raise InvalidRequest("model", f"{worker.name!r} cannot chat: {why}; give it one with the setting "
                             "chat_template (NAME=FILE)")
    messages = [m.model_dump(exclude_none=True) | ({"role": "system"} if m.role == "developer" else {})
                for m in req.messages]
    render = chat.encoder.render
    # a continued message is the prompt's end: no generation prompt after it (vLLM's rule; transformers refuses both)
    add_generation_prompt = req.add_generation_prompt and not req.continue_final_message
    try:
        return await worker.inputs.run(lambda: render(
            messages, tools=tools, documents=req.documents, add_generation_prompt=add_generation_prompt,
            continue_final_message=req.continue_final_message, extra=req.chat_template_kwargs))
    except ChatTemplateError as exc:  # raise_exception's message, a failing template
        raise InvalidRequest("messages", str(exc)) from None


def constraint(req: ChatCompletionRequest, tools: list[dict] | None, hermes: bool) -> tuple[Constraint | None, str]:
    """The output's constraint (response_format / guided_*, or the tool choice's) and the field it came from."""
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    forced = choice not in (None, "none", "auto")
    if forced and not tools:
        raise InvalidRequest("tool_choice", f"{json.dumps(choice)} needs tools")
    if tools:
        check_tools(tools, {t["function"]["name"] for t in tools} if choice == "required" else
                    {choice["function"]["name"]} if forced else set())
    if forced and not hermes:
        raise InvalidRequest("tool_choice", "this model's chat template has no tool-call format this server reads "
                             "(Hermes <tool_call>); use \"auto\" or \"none\" (calls come back as content)")
    given = convert.constraint(completion_constraint(req))
    if forced and given is not None:
        raise InvalidRequest("tool_choice", f"{json.dumps(choice)} cannot be combined with response_format or "
                             "guided_*")
    return (tool_constraint(tools, choice), "tools") if forced else (given, "response_format")


def generation_request(req: ChatCompletionRequest, worker: ModelWorker, prompt: str, ids: list[int],
                       forced: Constraint | None, adapter: str | None) -> GenerationRequest:
    """The engine's request for a rendered conversation: sampled as /v1/completions samples, up to as many tokens
    as the model's cap and length leave by default, ending at the model's end-of-turn ids."""
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, min(worker.max_new_tokens,
                                                                           worker.runner.room(len(ids))))
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    given = {"top_k": max(req.top_k, 0) if req.top_k is not None else None, "min_new_tokens": req.min_tokens,
             "repetition_penalty": req.repetition_penalty}
    decoding = decoding_options(req.temperature, req.top_p, 1 if req.stream else req.n, max_new_tokens=max_tokens,
                                seed=req.seed, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                **{k: v for k, v in given.items() if v is not None})
    return GenerationRequest(inputs=[prompt], decoding=decoding, stop=stop, adapter=adapter, constraint=forced,
                             prompt_ids=[ids], stop_token_ids=worker.chat.stop_ids)


@router.post(
    "/chat/completions",
    name="chat_completions",
    response_model=ChatCompletionResponse,
    responses={200: SSE_RESPONSE, **errors(400, 401, 404, 413, 422, 429, 500, 503, 504)},
)
async def chat_completions(
    req: ChatCompletionRequest,
    request: Request,
    engine: Annotated[Engine, Depends(get_engine)],
    settings: Annotated[Settings, Depends(get_settings)],
    rid: Annotated[str, Depends(request_id)],
    client: Annotated[Caller, Depends(caller)],
) -> Response:
    """OpenAI-compatible chat completion (also streamed as OpenAI's `chat.completion.chunk` events, ending
    `data: [DONE]`), with tool calls and reasoning. Control tokens written inside messages, tools, documents or
    chat_template_kwargs (`<|im_end|>`, `<|im_start|>`...) are read as text, never as the template's tokens (vLLM's
    default reads them as tokens): no message can forge a turn."""
    name, _, adapter = req.model.partition(":")
    request.state.model, request.state.adapter = name, adapter or None
    worker = worker_for(engine, name)
    if worker.family != "causal_lm":
        raise InvalidRequest("model", f"{name!r} is a {worker.family} model; /v1/chat/completions serves causal_lm "
                             "models")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    size = len(json.dumps([m.model_dump(exclude_none=True) for m in req.messages] + (tools or []),
                          ensure_ascii=False).encode("utf-8"))
    check_chat(req, settings, size)
    hermes = worker.chat.tool_call_format == "hermes"
    rendered_tools = None if req.tool_choice == "none" else tools
    prompt = await chat_prompt(req, worker, rendered_tools)
    template = worker.chat.encoder.template
    forced, constraint_field = constraint(req, tools, hermes)
    fields = {"inputs": "messages", "constraint": constraint_field, "num_return_sequences": "n",
              "max_new_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
              "min_new_tokens": "min_tokens"}
    try:
        ids = (await worker.inputs.input_ids([prompt], chat=True))[0]
    except InvalidRequest as exc:
        raise renamed(exc, fields) from None
    generate = generation_request(req, worker, prompt, ids, forced, adapter or None)
    check_cost(settings.max_tokens_per_request, {"n": req.n, fields["max_new_tokens"]: min(
        generate.decoding.max_new_tokens, worker.max_new_tokens)}, generate.decoding.logprobs)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
    # what the answer is read for: calls (Hermes, unless tool_choice none), thinking (a reasoning template; the
    # prompt may open it), never inside a constrained output
    reading = dict(tools=hermes and bool(rendered_tools), reasoning=template.reasoning,
                   thinking=forced is None and template.reasoning and prompt.rstrip().endswith(THINK_OPEN))
    queue = client.queue(req.priority)
    try:
        if req.stream:
            return await _stream(worker, req, generate, head, reading, len(ids), rid, queue)
        outputs = await worker.generate(generate, rid, queue)
    except InvalidRequest as exc:
        raise renamed(exc, fields) from None
    out = outputs[0]
    choices, completion_tokens = [], 0
    for index, seq in enumerate(out.candidates if out.candidates is not None else [out] * req.n):
        message = {"role": "assistant", **parse_output(seq.text, **reading)}
        choices.append({"index": index, "message": message, "logprobs": chat_logprobs(seq.logprobs),
                        "finish_reason": finish_reason(seq.finish_reason, "tool_calls" in message)})
        completion_tokens += len(seq.tokens)
    usage = Usage(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                  total_tokens=len(ids) + completion_tokens)
    return await json_response(lambda: ChatCompletionResponse(**head, choices=choices, usage=usage))


async def _stream(worker: ModelWorker, req: ChatCompletionRequest, generate: GenerationRequest, head: dict[str, Any],
                  reading: dict[str, bool], prompt_tokens: int, rid: str, queue: QueueTag) -> Response:
    """One engine stream per choice (seeded as /v1/completions' streams), merged into OpenAI's chunks: a first
    one per choice with the role, then content / reasoning / tool call deltas (logprobs on the chunk of their
    tokens, or the next), then one with the finish_reason; with include_usage a last one with the usage."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    streams = await seeded_streams(worker, generate, generate.inputs, req.n, rid, queue)
    head = {**head, "object": "chat.completion.chunk", **({"usage": None} if include_usage else {})}
    parsers = [OutputParser(**reading) for _ in streams]
    generated = [0] * len(streams)

    def chunk(index: int, delta: dict[str, Any], logprobs: list | None = None, reason: str | None = None
              ) -> dict[str, Any]:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                                     "finish_reason": reason}]}

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        started, held = [False] * len(streams), [[] for _ in streams]
        merged = merge(streams)
        try:
            async for index, e in merged:
                if not started[index]:
                    started[index] = True
                    yield chunk(index, {"role": "assistant", "content": ""})
                generated[index] += e.token is not None
                held[index] += e.logprobs or []
                parser = parsers[index]
                deltas = parser.feed(e.text) + (parser.finish() if e.finish_reason is not None else [])
                for delta in deltas:
                    yield chunk(index, delta, held[index] if generate.decoding.logprobs is not None else None)
                    held[index] = []
                if e.finish_reason is not None:
                    yield chunk(index, {}, held[index] if held[index] else None,
                                finish_reason(e.finish_reason, parser.calls > 0))
        finally:
            await merged.aclose()
        if include_usage:
            completion = sum(generated)
            yield {**head, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                                    "total_tokens": prompt_tokens + completion}}

    return await sse_response(chunks(), lambda item: item, rid)
