"""Bodies of OpenAI's /v1/completions and /v1/embeddings."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from model.constraints import MAX_CHOICES
from model.generation_config import MAX_LOGPROBS
from service.api.schemas.common import (
    DEFAULT_MAX_TOKENS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    LanguageCodes,
    Name,
    Priority,
    RequestModel,
    Seed,
    Text,
    language_codes,
    one_or_many,
)


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(RequestModel):
    """OpenAI's /v1/completions body. Fields that would change the meaning but are not supported
    (suffix, best_of != n, penalties, logit_bias) are rejected rather than ignored."""

    model: str = Field(min_length=1, max_length=129, description="A causal_lm or seq2seq model, or 'model:adapter'.")
    prompt: one_or_many(Text, Annotated[list[Text], Field(min_length=1)]) = Field(
        description="A prompt or a list of prompts."
    )
    max_tokens: int | None = Field(None, ge=0, description=f"Default {DEFAULT_MAX_TOKENS} (or the model's cap); 0 "
                                   "only with echo (score the prompt, generate nothing).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description=f"Below {MIN_TEMPERATURE:g}: greedy decoding.")
    top_p: float = Field(1.0, ge=0.0, le=1.0, description=f"Below {MIN_TOP_P:g}: greedy decoding.")
    n: int = Field(1, ge=1, description="Completions per prompt.")
    stop: one_or_many(Text, Annotated[list[Text], Field(max_length=4)]) | None = Field(
        None, description="A stop string or up to 4 of them."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    user: str | None = Field(None, description="Accepted and ignored.")
    priority: Priority = 0  # an extension, as vLLM's
    # Extensions for multilingual translators, as generate's fields:
    target_lang: LanguageCodes | None = language_codes("the language to translate into (one per prompt).")
    source_lang: LanguageCodes | None = language_codes("the language of the prompt.")
    # Constrained decoding under vLLM's names (at most one of the four):
    guided_json: dict[str, Any] | str | None = Field(None, description="A JSON schema (object or its JSON text).")
    guided_regex: Text | None = Field(None, description="As generate's constraint.regex (Rust's regex syntax).")
    guided_choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "json_object"} (any JSON object) or {"type": "json_schema", "json_schema": '
        '{"schema": {...}}}; {"type": "text"} constrains nothing.'
    )
    # Accepted only at their neutral values:
    best_of: int | None = Field(None, ge=1, description="Only null or equal to n.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Log-probabilities of each completion token and of the N likeliest "
        f"tokens at its position (0 <= N <= {MAX_LOGPROBS}; the chosen token is always listed too)."
    )
    echo: bool = Field(False, description="Prepend each prompt to its completion text; with logprobs, the prompt "
                       "tokens' log-probabilities come first (the first token's is null). Not with stream.")
    suffix: str | None = Field(None, description="Only null.")
    frequency_penalty: float = Field(0.0, description="Only 0.")
    presence_penalty: float = Field(0.0, description="Only 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Only null or empty.")


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completion log-probabilities, one entry per token in every list (with echo, the prompt's
    tokens first: the very first one has no log-probability)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int] = Field(description="Where each token's text starts in the choice's text.")


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- OpenAI embeddings, vLLM tokenize / detokenize -------------------------------------------------


class EmbeddingRequest(RequestModel):
    """OpenAI's /v1/embeddings body, for classifier (encoder) models: the vectors /embed gives with the model's
    default pooling and normalization."""

    model: Name = Field(description="A classifier (encoder) model from GET /v1/models.")
    input: one_or_many(Text, Annotated[list[Text], Field(min_length=1)]) = Field(
        description="A text or a list of texts (at most the setting max_inputs). OpenAI's token-id arrays are "
        "refused (422): send text."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the vector's little-endian float32 bytes, "
        "base64-encoded (what the openai client asks for by default and decodes)."
    )
    dimensions: int | None = Field(
        None, ge=1, description="Only null or the model's embedding size (vectors are not shortened)."
    )
    user: str | None = Field(None, description="Accepted and ignored.")
    priority: Priority = 0  # an extension, as vLLM's

    @field_validator("input", mode="before")
    @classmethod
    def _no_token_ids(cls, value: object) -> object:
        if isinstance(value, list) and any(isinstance(item, int | list) for item in value):
            raise ValueError("token-id arrays are not supported by this server; send text")
        return value


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int = Field(description="The input's position in the request.")
    embedding: list[float] | str = Field(description="The vector, or its base64 text (encoding_format base64).")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(description="Tokens the model read, special tokens included.")
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
