"""Request and response bodies of the HTTP API (pydantic), one module per API surface; every name is here too."""

from __future__ import annotations

from service.api.schemas.chat import (  # noqa: F401
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    FunctionDefinition,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCall,
)
from service.api.schemas.common import (  # noqa: F401
    DEFAULT_MAX_TOKENS,
    DEFAULT_NEW_TOKENS,
    MAX_SEED,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    NAME_PATTERN,
    AnyText,
    ErrorDetail,
    ErrorResponse,
    Name,
    Priority,
    RequestModel,
    Seed,
    Text,
)
from service.api.schemas.encoders import (  # noqa: F401
    AttentionKind,
    AttentionRequest,
    AttentionResponse,
    Classification,
    ClassifyRequest,
    ClassifyResponse,
    EmbedRequest,
    EmbedResponse,
    Indices,
    Pair,
    TextOrPair,
)
from service.api.schemas.generate import (  # noqa: F401
    Alternative,
    Candidate,
    ConstraintRequest,
    GenerateOutput,
    GenerateRequest,
    GenerateResponse,
    SpeculativeRequest,
    TokenLogprob,
)
from service.api.schemas.models import (  # noqa: F401
    AdapterInfoSchema,
    AdapterList,
    HealthResponse,
    ModelInfoSchema,
    ModelList,
    ModelLoadFailure,
    ModelLoadRequest,
    ReadyResponse,
)
from service.api.schemas.openai import (  # noqa: F401
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
    Usage,
)
from service.api.schemas.rerank import (  # noqa: F401
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from service.api.schemas.tokenize import (  # noqa: F401
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
