"""Bodies of OpenAI's /v1/chat/completions (with vLLM's extras), request and response."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from model.constraints import MAX_CHOICES
from model.generation_config import MAX_LOGPROBS
from service.api.schemas.common import (
    MIN_TEMPERATURE,
    MIN_TOP_P,
    AnyText,
    Priority,
    RequestModel,
    Seed,
    Text,
    one_or_many,
)
from service.api.schemas.openai import ResponseFormat, StreamOptions, Usage

MAX_TOOLS = 128  # OpenAI's limit on tools per request
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class TextPart(RequestModel):
    type: Literal["text"] = Field(description="Only text parts: images, audio and files are refused (422).")
    text: AnyText


class FunctionCall(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: AnyText = Field(description="The arguments as JSON text, as the model wrote them.")


class ToolCall(RequestModel):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    """A turn of the conversation. developer is OpenAI's newer name of system (the template sees "system")."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: one_or_many(AnyText, list[TextPart]) | None = Field(
        None, description="Text, or a list of text parts (joined with newlines unless the template reads parts)."
    )
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's calls (assistant only).")
    tool_call_id: str | None = Field(None, max_length=256, description="The call a tool message answers (tool only).")
    reasoning_content: AnyText | None = Field(None, description="An assistant's thinking (vLLM's field).")

    @model_validator(mode="after")
    def _fields_of_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages have them, not {self.role} messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id: only tool messages have one, not {self.role} messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: {self.role} messages need content")
        return self


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ and -, at most 64 characters.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments (an object).")
    strict: bool | None = Field(None, description="Accepted; with tool_choice required or a named function the "
                                "arguments always follow the schema.")


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(RequestModel):
    """OpenAI's /v1/chat/completions body, with vLLM's extras. Fields that would change the meaning but are not
    supported (penalties, logit_bias) are refused rather than ignored."""

    model: str = Field(min_length=1, max_length=129, description="A causal_lm model, or 'model:adapter'.")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation (at most the setting "
                                        "max_chat_messages, max_chat_bytes of text).")
    max_tokens: int | None = Field(None, ge=1, description="Default: as many as the model's limit and length leave.")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description=f"Below {MIN_TEMPERATURE:g}: greedy decoding.")
    top_p: float = Field(1.0, ge=0.0, le=1.0, description=f"Below {MIN_TOP_P:g}: greedy decoding.")
    n: int = Field(1, ge=1, description="Choices to generate.")
    stop: one_or_many(Text, Annotated[list[Text], Field(max_length=4)]) | None = Field(
        None, description="A stop string or up to 4 of them (the model's end-of-turn tokens always stop)."
    )
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = Field(False, description="Log-probabilities of each output token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With logprobs: the N likeliest "
                                     "tokens at each position.")
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}: the '
        "output is constrained to it."
    )
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default "auto" with tools. "required" or a named function: the output is constrained to '
        "one Hermes call whose arguments are valid under the tool's parameters (templates with that format)."
    )
    parallel_tool_calls: bool | None = Field(None, description="Accepted; a constrained answer holds one call.")
    user: str | None = Field(None, description="Accepted and ignored.")
    presence_penalty: float = Field(0.0, description="Only 0.")
    frequency_penalty: float = Field(0.0, description="Only 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Only null or empty.")
    # vLLM's extras:
    top_k: int | None = Field(None, ge=-1, description="Sample from the k likeliest tokens (0 or -1: all).")
    min_tokens: int | None = Field(None, ge=0, description="End-of-turn and stop tokens are held off until this "
                                   "many tokens.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="> 1: tokens seen before are less likely.")
    add_generation_prompt: bool = Field(True, description="End the prompt with the template's opening of the "
                                        "assistant's turn (not when continue_final_message).")
    continue_final_message: bool = Field(False, description="Continue the final (assistant) message instead of "
                                         "starting a new one (no generation prompt is added after it).")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Variables for the template, e.g. "
                                                        "Qwen3's enable_thinking.")
    documents: list[dict[str, str]] | None = Field(None, description="For templates that read documents (RAG).")
    priority: Priority = 0
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema (object or text).")
    guided_regex: Text | None = Field(None, description="vLLM's: a regular expression (Rust's regex syntax).")
    guided_choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_CHOICES)


# ---- the answer ------------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class MadeToolCall(BaseModel):
    id: str = Field(description="call_ and 24 hex digits.")
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[MadeToolCall] | None = Field(None, description="The Hermes calls of the output (templates "
                                                  "with that format, tools given, tool_choice not none).")
    reasoning_content: str | None = Field(None, description="The thinking of a reasoning template (vLLM's field).")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
