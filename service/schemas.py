"""Request and response bodies of the HTTP API (pydantic): static bounds only.

Limits that come from settings (caps on beams, new tokens, inputs) are checked by
:mod:`service.limits`; token lengths by the engine. Every request model forbids unknown fields and
non-finite numbers and validates strictly, so a typo, a NaN or a wrong JSON type (``true`` or ``"5"`` for a
number) is a 422 naming the field instead of a silent default or coercion.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from model import lora_config
from model.constraints import MAX_CHOICES, MAX_UNROLLED
from model.decoding import Strategy
from model.generation_config import MAX_LENGTH_PENALTY, MAX_LOGPROBS
from model.speculative import MAX_SPECULATIVE_TOKENS
from service.attention import MAX_ATTENTION_VALUES

NAME_PATTERN = f"^{lora_config.NAME_PATTERN}$"  # model and adapter names
DEFAULT_NEW_TOKENS = 64  # generate's max_new_tokens when not given
DEFAULT_MAX_TOKENS = 16  # /v1/completions' max_tokens when not given (OpenAI's default)
# Sampling limits: below them the logits overflow float32 or the nucleus underflows (greedy is the limit).
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6
MAX_SEED = 2**62  # input i samples with seed + i: room left below torch's 2**63



def unicode_text(value: object) -> object:
    """``value`` unless it is a string that is not valid Unicode: JSON's ``\\ud800`` escapes can smuggle a lone
    surrogate into a string, which no tokenizer can encode (the one text check of every text field of every route;
    run before the type's own checks, whose error for it says nothing useful)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"contains a lone surrogate (U+{ord(value[exc.start]):04X}) at character {exc.start}: "
                             "not valid Unicode text") from None
    return value


# The check wraps the constrained type (not the other way round), so that the type keeps its own messages.
AnyText = Annotated[str, BeforeValidator(unicode_text), Field(description="Text (valid Unicode).")]
Text = Annotated[Annotated[str, Field(min_length=1)], BeforeValidator(unicode_text), Field(description="Non-empty text.")]
Name = Annotated[str, Field(pattern=NAME_PATTERN, description=f"{lora_config.NAME_RULE}.")]
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1, description="Among requests waiting for this model, lower "
                                "values are taken first (within a priority, API keys take turns, FIFO per key); "
                                "running requests are not preempted. A user API key may not go below "
                                "min_user_priority (TSERVE_MIN_USER_PRIORITY, default 0; 422 below it); admin keys, "
                                "and a server without keys, may use any.")]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description="0 <= seed <= 2**62.")]


def _str_or_list(value: object) -> str:
    return "list" if isinstance(value, list | tuple) else "str"


def one_or_many(one: object, many: object) -> object:
    """``one | many`` validated by the input's JSON type (a string or an array), so a bad value gets one
    error from the branch it meant, not one per branch; the tags "str"/"list" are left out of field paths."""
    return Annotated[Annotated[one, Tag("str")] | Annotated[many, Tag("list")], Discriminator(_str_or_list)]


class RequestModel(BaseModel):
    # strict: JSON types must match (true is not max_new_tokens=1, "5" is not 5); JSON integers still
    # count as floats.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# ---- errors --------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    code: str = Field(description="Machine-readable code, e.g. invalid_request, not_found, queue_full.")
    message: str = Field(description="What went wrong; names the field and the limit where one applies.")
    field: str | None = Field(None, description="The offending request field (dotted path), when there is one.")
    request_id: str | None = Field(None, description="Same as the X-Request-ID response header.")


class ErrorResponse(BaseModel):
    """The one error shape of every endpoint, including 404/405/413 and validation errors."""

    error: ErrorDetail


# ---- health and models ---------------------------------------------------------------------------


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    models: list[str]


class AdapterInfoSchema(BaseModel):
    name: str
    rank: int
    alpha: float
    target_modules: list[str]
    path: str
    loaded_at: float | None = Field(
        None, description="Unix time the resident version was loaded (null: on disk only, loaded on first use)."
    )
    last_used: float | None = Field(None, description="Unix time of its last request.")
    in_flight: int = Field(0, description="Requests using it right now.")
    resident: bool = Field(True, description="In memory now (false: known on disk, loaded on first use).")


class AdapterList(BaseModel):
    adapters: list[AdapterInfoSchema]


class ModelInfoSchema(BaseModel):
    id: str = Field(description="Same as name (OpenAI's model list field).")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time the server started.")
    owned_by: str = "tserve"
    name: str
    family: Literal["seq2seq", "classifier", "causal_lm"]
    device: str
    dtype: str
    parameters: int = Field(description="The model's own parameters (tied weights counted once).")
    adapter_parameters: int = Field(description="Parameters its resident LoRA adapters add.")
    vocab_size: int = Field(description="Tokens the model can output (a translator's target vocabulary).")
    max_input_tokens: int
    max_new_tokens: int = Field(description="Cap on new tokens (0 for classifiers).")
    labels: list[str] | None = Field(None, description="Class labels (classifier).")
    adapters: list[str] = Field(description="LoRA adapters this model can use.")
    format: Literal["tserve", "hf"] = Field(
        description="tserve: a checkpoint of ours; hf: a Hugging Face model directory (config.json, model.safetensors)."
    )
    generation_defaults: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="What generate uses for the fields a request leaves unset, from the model's own generation "
        "config (an HF model's generation_config.json: num_beams, max_length, length_penalty, early_stopping, "
        "do_sample), within this server's limits. Fields not named here take the request schema's defaults.",
    )
    draft_model: str | None = Field(None, description="The model that drafts for speculative method draft_model.")
    calibration: dict[str, float] | None = Field(
        None, description="A classifier's calibration (calibration.json): the temperature its probabilities are "
        "scaled by and min_confidence, below which it answers \"unknown\" unless a request sets its own."
    )


class ModelLoadFailure(BaseModel):
    name: str = Field(description="The model directory's name.")
    error: str = Field(description="Why it did not load (paths relative to the models directory).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfoSchema]
    failed: list[ModelLoadFailure] = Field(
        description="Configured models that failed to load at start-up, and why (not served)."
    )


# ---- generate ------------------------------------------------------------------------------------


class ConstraintRequest(RequestModel):
    """Exactly one of the three."""

    json_schema: dict[str, Any] | bool | None = Field(None, description="The output is JSON valid under this schema.")
    # Its size is checked with the grammar's (MAX_GRAMMAR_CHARS), not here: the body limit may be smaller.
    regex: Text | None = Field(
        None, description="The output matches this regular expression (whole), in Rust's regex syntax (llguidance's "
        "dialect): \\d, \\w and \\s are Unicode-aware (\\d matches every decimal digit, e.g. Arabic-Indic ones: write "
        f"[0-9] for ASCII digits); counted repetitions ({{n}}, {{n,m}}) may unroll to at most {MAX_UNROLLED:,} "
        "characters."
    )
    choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_CHOICES,
                                      description="The output is one of these strings.")

    @model_validator(mode="after")
    def _exactly_one(self) -> ConstraintRequest:
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex, choice (got {given or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None)


class SpeculativeRequest(RequestModel):
    method: Literal["ngram", "draft_model", "none"] = Field(
        "ngram", description="ngram: draft the tokens that followed the latest earlier occurrence of the text's last "
        "1-3 tokens (prompt lookup); draft_model: the greedy continuation of the model's draft model (a smaller "
        "causal LM with its tokenizer, setting draft_model; GET /v1/models names it); either is verified by the "
        "model in one step; none: no drafting (overrides a default)."
    )
    num_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS, description="Draft tokens per step.")


class GenerateRequest(RequestModel):
    """A field left unset takes the model's generation default (GET /v1/models: generation_defaults), else the
    default below."""

    inputs: list[Text] = Field(min_length=1, description="Source sentences (seq2seq) or prompts (causal_lm).")
    strategy: Strategy = Field(Strategy.GREEDY, strict=False)  # strict=False: a JSON string names the member
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description=f"Default {DEFAULT_NEW_TOKENS} (or the model's cap if lower); at most the model's "
        "max_new_tokens from GET /v1/models.",
    )
    min_new_tokens: int = Field(0, ge=0, description="End-of-sequence is suppressed before this many tokens.")
    num_beams: int = Field(4, ge=1, description="Beam width (strategy=beam); capped by max_beams.")
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY,
                                  description="Beam score = logprob / length**penalty.")
    early_stopping: bool | Literal["never"] = Field(
        True,
        description="Beam search ends (as in transformers' generate()) at num_beams finished (true), when the best "
        "live beam scored at its current length cannot beat them (false), or at no length could ('never').",
    )
    num_return_sequences: int = Field(1, ge=1, description="Candidates per input (beam: <= num_beams).")
    temperature: float = Field(
        1.0, ge=MIN_TEMPERATURE, le=100.0, description="Sampling temperature (strategy=sample); for 0 use greedy."
    )
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens (0: all).")
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0, description="Nucleus sampling mass.")
    seed: Seed | None = Field(None, description="Makes sampling reproducible.")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=100.0, description="Makes every token already in the prompt (a translation: its target "
        "prefix) or the output less likely, as transformers does: its logit divided by this when positive, "
        "multiplied when negative (beam search: its log-probability multiplied). 1: off. Default: the model's."
    )
    no_repeat_ngram_size: int = Field(
        0, ge=0, le=64, description="No n-gram of this many tokens occurs twice in prompt + output (as transformers "
        "counts). 0: off. Default: the model's."
    )
    stop: list[Text] = Field(default_factory=list, max_length=16, description="Stop strings (cut from the text).")
    adapter: Name | None = Field(None, description="LoRA adapter to apply.")
    stream: bool = Field(False, description="Server-sent events of tokens (one input, one sequence).")
    priority: Priority = 0
    constraint: ConstraintRequest | None = Field(
        None, description="Constrained decoding (causal_lm): every output matches a JSON schema, a regular "
        "expression or one of a list of strings (greedy, sampling or beam search; each sequence its own state). "
        "A constraint that is malformed, too large or impossible is a 422 before any decoding."
    )
    speculative: SpeculativeRequest | None = Field(
        None, description="Draft-and-verify decoding (one input, greedy or one sample): the same tokens, fewer model "
        "steps when the text repeats itself. Default: the model's (setting speculative)."
    )
    target_prefix: list[AnyText] | None = Field(
        None, description="seq2seq only, one per input: the start of its translation (typed by a user) to "
        "continue; the outputs hold what follows it (with logprobs, the alternatives at the next position)."
    )
    protect_placeholders: bool | None = Field(
        None, description="seq2seq only (default: on for seq2seq): keep the inputs' placeholders (printf %s / "
        "%(name)s / %1$s, {0} / {name}, $VAR, HTML/XML tags, URLs, e-mail addresses, --options) intact: they are "
        "swapped for sentinel tokens before encoding and put back in the output, in the source's order where "
        "order matters; an output that lost or repeated one is repaired (missing ones appended) and says "
        "placeholders_ok: false. A model whose tokenizer has no sentinels is checked only."
    )
    use_vmap: bool | None = Field(
        None, description="seq2seq only: keep each output to the candidate target tokens of the model's vocabulary "
        "map for its input (vmap.txt in the model's directory, CTranslate2's format and use_vmap): faster with a "
        "large target vocabulary, and it may translate differently. Default: on when the model has a map; true "
        "for a model without one is a 422."
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return each generated token's log-probability and the N "
        f"likeliest tokens at its position (0 <= N <= {MAX_LOGPROBS}): log-softmax of the model's logits, before "
        "temperature, top-k / top-p and bans (with a constraint: over the tokens it allows). Beam search: the "
        "returned sequences' own paths."
    )


class Alternative(BaseModel):
    token: int
    text: str = Field(description="The token decoded alone (part of a UTF-8 character shows as U+FFFD).")
    logprob: float


class TokenLogprob(Alternative):
    top_logprobs: list[Alternative] | None = Field(
        None, description="The likeliest tokens at this position, best first (logprobs > 0)."
    )


class Candidate(BaseModel):
    text: str
    tokens: list[int] = Field(description="Generated token ids.")
    score: float | None = Field(description="Sequence log-probability (length-penalised for beam).")
    finish_reason: str = Field(description="eos, length or stop.")
    logprobs: list[TokenLogprob] | None = Field(
        None, description="With logprobs: one entry per token of tokens (an ending EOS or stop token's "
        "log-probability counts in score only)."
    )
    placeholders_ok: bool | None = Field(
        None, description="With protect_placeholders (seq2seq): whether the model's output held exactly the "
        "input's placeholders (positional ones in order); false: the text was repaired, review it."
    )


class GenerateOutput(Candidate):
    candidates: list[Candidate] | None = Field(
        None, description="All returned sequences, best first (only when num_return_sequences > 1)."
    )


class GenerateResponse(BaseModel):
    outputs: list[GenerateOutput]


# ---- classify / embed / attention ----------------------------------------------------------------

# A list, not a tuple: strict validation of the parsed JSON body (Python objects) takes no list as a tuple.
Pair = Annotated[list[Text], Field(min_length=2, max_length=2, description="A sentence pair [first, second].")]
TextOrPair = one_or_many(Text, Pair)


class ClassifyRequest(RequestModel):
    inputs: list[TextOrPair] = Field(min_length=1, description="Texts or [text, text] pairs.")
    adapter: Name | None = None
    top_k: int | None = Field(None, ge=1, description="Return only the k likeliest labels' probabilities.")
    min_confidence: float | None = Field(
        None, ge=0.0, le=1.0, description="Answer \"unknown\" (abstained) for a text whose top probability is "
        "below this. Default: the model's calibrated threshold (calibration.json), else 0 (never)."
    )
    priority: Priority = 0


class Classification(BaseModel):
    label: str = Field(description="The likeliest label, or \"unknown\" when the classifier abstained.")
    score: float = Field(description="The top probability (calibrated when the model has a calibration).")
    probabilities: dict[str, float]
    abstained: bool = Field(False, description="The top probability was below min_confidence.")


class ClassifyResponse(BaseModel):
    outputs: list[Classification]


class EmbedRequest(RequestModel):
    inputs: list[Text] = Field(min_length=1)
    pooling: Literal["cls", "mean", "max"] | None = Field(
        None, description="cls: the [CLS] state; mean / max: over the input's tokens (padding excluded). Default: "
        "the model's (a sentence-transformers model's Pooling module), else mean."
    )
    normalize: bool | None = Field(
        None, description="Unit-length vectors. Default: the model's (a sentence-transformers Normalize module), "
        "else false."
    )
    priority: Priority = 0


class EmbedResponse(BaseModel):
    embeddings: list[list[float]]
    dimensions: int


Indices = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=64)]


class AttentionRequest(RequestModel):
    input: Text = Field(description="The text (seq2seq: the source sentence).")
    target: Text | None = Field(None, description="seq2seq only: the target sentence the decoder reads.")
    layers: Indices | None = Field(None, description="Layers to return (0-based, in this order); default all.")
    heads: Indices | None = Field(None, description="Heads to return (0-based, in this order); default all.")


AttentionKind = Literal["encoder_self", "decoder_self", "cross", "self"]


class AttentionResponse(BaseModel):
    source_tokens: list[str]
    target_tokens: list[str] | None = None
    maps: dict[AttentionKind, list[list[list[list[float]]]]] = Field(
        description="kind -> [layer][head][query][key] weights of the selected layers and heads; kinds: "
        "encoder_self, decoder_self, cross (seq2seq) or self (classifier, causal_lm). At most "
        f"{MAX_ATTENTION_VALUES:,} weights in all: a larger selection is a 422."
    )


# ---- OpenAI completions --------------------------------------------------------------------------


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

    model: str = Field(min_length=1, max_length=129, description="A causal_lm model, or 'model:adapter'.")
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


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize body (its completion form: chat ``messages`` are not supported)."""

    model: Name = Field(description="A model from GET /v1/models.")
    prompt: AnyText = Field(description="The text (a translator's is its source text, read by the source tokenizer).")
    add_special_tokens: bool = Field(
        True, description="true: the ids the model reads for this text as an input (<s> text for a causal LM, "
        "text </s> for a translator, [CLS] text [SEP] for a classifier); false: the text's own tokens alone."
    )
    return_token_strs: bool = Field(False, description="Also return each token's text (token_strs).")


class TokenizeResponse(BaseModel):
    count: int = Field(description="len(tokens).")
    max_model_len: int = Field(description="The most tokens an input of this model may have here (GET /v1/models' "
                               "max_input_tokens).")
    tokens: list[int]
    token_strs: list[str] | None = Field(
        None, description="With return_token_strs: each token's text (part of a UTF-8 character shows as U+FFFD)."
    )


class DetokenizeRequest(RequestModel):
    """vLLM's /detokenize body: the inverse of /tokenize (a translator's ids are of its source vocabulary)."""

    model: Name = Field(description="A model from GET /v1/models.")
    tokens: list[Annotated[int, Field(ge=0)]] = Field(
        description="Token ids, each below the vocabulary size (an id outside it is a 422); special tokens are "
        "kept in the text."
    )


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="The text of tokens.")
