"""A chat model's output as OpenAI's assistant message: Hermes tool calls (``<tool_call>{"name", "arguments"}
</tool_call>``, as Qwen2.5 / Qwen3 / Hermes / SmolLM3 templates write them) become ``tool_calls``, and the thinking of
a reasoning template (``<think> ... </think>``) becomes ``reasoning_content`` (vLLM's field); and the constraint that
makes a model's output one call to the tools a request allows.

One parser (:class:`OutputParser`) reads text as it streams, holding back what could still be the start of a tag, and
gives OpenAI's delta fields; a finished text is parsed by feeding it whole (:func:`parse_output`), so a stream and its
unstreamed answer say the same thing. A call whose JSON does not parse stays in the content, as vLLM leaves it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import llguidance

from model.constraints import Constraint
from model.hf.chat_template import HERMES_TOOL_CALL, THINK
from service.engine.errors import InvalidRequest

TOOL_OPEN, TOOL_CLOSE = HERMES_TOOL_CALL
THINK_OPEN, THINK_CLOSE = THINK


def call_id() -> str:
    """A new tool call id, as OpenAI's look (call_ + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str) -> dict[str, Any] | None:
    """OpenAI's tool call (id, type, function name and arguments as JSON text) of a Hermes call's JSON body, or None
    where it is not a JSON object with a string ``name``."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": value["name"], "arguments": text}}


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could begin one of ``tags``."""
    return max((k for tag in tags for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


@dataclass
class OutputParser:
    """Splits a chat model's output, fed in pieces, into OpenAI's delta fields: ``content``, ``reasoning_content``
    (with ``reasoning``: the template knows ``<think>``; ``thinking``: the prompt left the model inside one) and
    ``tool_calls`` (with ``tools``: Hermes calls are parsed). Whitespace around calls and inside and after the
    thinking is dropped; the content's own is kept (a continued message may start with a space)."""

    tools: bool = False
    reasoning: bool = False
    thinking: bool = False
    calls: int = field(default=0, init=False)  # tool calls given so far
    _pending: str = field(default="", init=False)  # text read but not yet given
    _in_call: bool = field(default=False, init=False)
    _gap: str = field(default="", init=False)  # whitespace before the current call's tag (content if it fails)
    _thought: bool = field(default=False, init=False)  # reasoning has been given: its whitespace is kept
    _started: bool = field(default=False, init=False)  # content has been given: <think> opens nothing now
    _trim: bool = field(default=False, init=False)  # after </think> or a call: drop the whitespace that follows
    _deltas: list[dict[str, Any]] = field(default_factory=list, init=False)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` completes (each one a dict of delta fields)."""
        self._pending += text
        self._drain(final=False)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was held back (the output ended)."""
        self._drain(final=True)
        return self._take()

    def _take(self) -> list[dict[str, Any]]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def _drain(self, final: bool) -> None:
        while self._pending:
            if self.thinking:
                if not self._thought:
                    self._pending = self._pending.lstrip()
                if not self._until(THINK_CLOSE, "reasoning_content", final):
                    return
                self.thinking, self._trim = False, True
            elif self._in_call:
                end = self._pending.find(TOOL_CLOSE)
                if end < 0 and not final:
                    return
                body = self._pending[:end] if end >= 0 else self._pending
                self._pending = self._pending[end + len(TOOL_CLOSE):] if end >= 0 else ""
                self._in_call = False
                call = parse_call(body)
                if call is None:
                    self._emit("content", self._gap + TOOL_OPEN + body + (TOOL_CLOSE if end >= 0 else ""))
                else:
                    self._deltas.append({"tool_calls": [{"index": self.calls, **call}]})
                    self.calls, self._trim = self.calls + 1, True
            else:
                if self._trim:  # after </think> or a call, whitespace before what follows is dropped
                    self._pending = self._pending.lstrip()
                    if not self._pending:
                        return
                    self._trim = False
                if self.reasoning and not (self._started or self._thought or self.calls):  # the output's start
                    opening = self._pending.lstrip()
                    if opening.startswith(THINK_OPEN):
                        self._pending, self.thinking = opening[len(THINK_OPEN):], True
                        continue
                    if not final and THINK_OPEN.startswith(opening):
                        return
                if not self._until(TOOL_OPEN if self.tools else None, "content", final):
                    return
                self._in_call = True

    def _until(self, tag: str | None, kind: str, final: bool) -> bool:
        """Give ``kind`` text up to ``tag``, holding back what could begin it and the whitespace before it (dropped
        where the tag follows); True where the tag was found (and consumed)."""
        at = self._pending.find(tag) if tag else -1
        if at >= 0:
            before = self._pending[:at].rstrip()
            self._gap = self._pending[len(before):at]
            self._emit(kind, before)
            self._pending = self._pending[at + len(tag):]
            return True
        if final:
            self._emit(kind, self._pending.rstrip() if kind == "content" and self.calls else self._pending)
            self._pending = ""
            return False
        ready = self._pending[:len(self._pending) - _held(self._pending, (tag,))] if tag else self._pending
        ready = ready.rstrip() if tag else ready
        self._emit(kind, ready)
        self._pending = self._pending[len(ready):]
        return False

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        self._started |= kind == "content"
        self._thought |= kind == "reasoning_content"
        if self._deltas and list(self._deltas[-1]) == [kind]:
            self._deltas[-1][kind] += text
        else:
            self._deltas.append({kind: text})


def parse_output(text: str, tools: bool, reasoning: bool, thinking: bool = False) -> dict[str, Any]:
    """The assistant message fields of a finished output: ``content`` (None where calls alone were made),
    ``reasoning_content`` (with ``reasoning``) and ``tool_calls`` (when there are calls)."""
    parser = OutputParser(tools=tools, reasoning=reasoning, thinking=thinking)
    message: dict[str, Any] = {"content": ""}
    for delta in parser.feed(text) + parser.finish():
        for key, value in delta.items():
            if key == "tool_calls":
                message.setdefault("tool_calls", []).extend({k: v for k, v in c.items() if k != "index"}
                                                            for c in value)
            else:
                message[key] = (message.get(key) or "") + value
    if reasoning:
        message.setdefault("reasoning_content", None)
    if "tool_calls" in message and not message["content"]:
        message["content"] = None
    return message


# ---- the constraint of tool_choice "required" or a named function ---------------------------------------


# The grammar library's refusals of valid JSON Schema it cannot enforce (keywords such as "if", "not"; formats it
# does not know): fine in a tool the model is only told about, a 422 for one its output is constrained to.
UNENFORCEABLE = ("Unimplemented keys", "Unknown format")


def check_tools(tools: list[dict[str, Any]], constrained: set[str]) -> None:
    """Each tool's ``parameters`` is a JSON schema, which the grammar library can enforce for the tools named in
    ``constrained`` (InvalidRequest naming it)."""
    for i, tool in enumerate(tools):
        schema = tool["function"].get("parameters")
        if schema is None:
            continue
        try:
            error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
        except (ValueError, TypeError, RuntimeError) as exc:  # the library's own refusals
            error = str(exc) or type(exc).__name__
        if error and (tool["function"]["name"] in constrained or not error.startswith(UNENFORCEABLE)):
            raise InvalidRequest(f"tools[{i}].function.parameters", f"is not a usable JSON schema: "
                                 f"{error.strip().splitlines()[0]}")


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one Hermes call's body to one of ``tools``: its name, then arguments valid under its
    parameters."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


@dataclass(frozen=True)
class ToolCallConstraint(Constraint):
    """One Hermes call, ``<tool_call>\\n{json}\\n</tool_call>``, whose JSON (compact) is valid under ``value`` (a
    :func:`call_schema`): a JSON schema constraint (its size and pattern checks) wrapped in the call's tags."""

    def grammar(self) -> str:
        super().grammar()  # the schema's checks: size, counted repetitions
        schema = {**self.value, "x-guidance": {"whitespace_flexible": False}}
        return llguidance.LLMatcher.grammar_from_lark(
            f"start: {json.dumps(TOOL_OPEN + chr(10))} call {json.dumps(chr(10) + TOOL_CLOSE)}\n"
            f"call: %json {json.dumps(schema)}")


def tool_constraint(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None) -> Constraint | None:
    """The constraint of ``tool_choice`` "required" (a call to one of ``tools``) or a named function (a call to it);
    None for "none" and "auto"."""
    if choice is None or choice in ("none", "auto"):
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise InvalidRequest("tool_choice.function.name", f"{name!r} is not one of the request's tools")
    return ToolCallConstraint("json_schema", call_schema(tools))
