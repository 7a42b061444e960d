"""Request and response dataclasses shared by the engine and the HTTP layer (no torch, no FastAPI)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Alternative:
    token: int
    text: str  # the token decoded alone (part of a UTF-8 character shows as U+FFFD)
    logprob: float


@dataclass
class TokenLogprob(Alternative):
    top_logprobs: list[Alternative] | None = None  # the likeliest tokens at this position, best first (logprobs > 0)


@dataclass
class GeneratedSequence:
    text: str
    tokens: list[int]  # generated token ids
    score: float  # sequence log-probability (length-penalised for beam)
    finish_reason: str  # eos, length or stop
    logprobs: list[TokenLogprob] | None = None  # with logprobs: one entry per token of tokens
    placeholders_ok: bool | None = None  # with protected placeholders: whether the output held them all
    constraint_satisfied: bool | None = None  # with a constraint: whether the output is complete (not cut short)


@dataclass
class GenerationOutput(GeneratedSequence):
    """An input's best sequence, and every returned sequence (best first) when several were asked for."""

    candidates: list[GeneratedSequence] | None = None


@dataclass
class StreamEvent:
    """One step of a streamed generation."""

    text: str  # new text since the previous event (held back while it could start a stop string)
    token: int | None  # the token this event adds, if exactly one
    finish_reason: str | None = None  # set on the last event only
    logprobs: list[TokenLogprob] | None = None  # with logprobs: the entries of the tokens this event adds
    placeholders_ok: bool | None = None  # the last event, with protect_placeholders: see GeneratedSequence
    constraint_satisfied: bool | None = None  # the last event, with a constraint: see GeneratedSequence


@dataclass
class ClassifyOutput:
    label: str  # UNKNOWN_LABEL when the classifier abstained
    score: float  # the top label's score: its probability (softmax / sigmoid) or a regression's raw value
    probabilities: dict[str, float]  # sorted by probability, descending; top_k entries when given
    abstained: bool = False  # the top probability was below the request's (or the model's) min_confidence


UNKNOWN_LABEL = "unknown"  # what an abstaining classifier answers


@dataclass
class RerankOutput:
    scores: list[float]  # per document, in the request's order
    tokens: int  # tokens the model read (every pair, or the query and every document)
    scored_by: str  # "cross-encoder" (a one-label head) or "embedding-cosine" (service.engine.rerank)


@dataclass
class AttentionOutput:
    source_tokens: list[str]
    target_tokens: list[str] | None
    maps: dict[str, list]  # kind -> [layer][head][query][key]


@dataclass
class AdapterInfo:
    name: str
    rank: int
    alpha: float
    target_modules: list[str]
    path: str
    loaded_at: float | None  # unix time the resident version was loaded; None when only known on disk
    last_used: float | None  # unix time of the last request that used it
    in_flight: int  # requests currently using it (any version)
    resident: bool = True  # False: known on disk, loaded on first use


@dataclass
class ModelInfo:
    name: str
    family: str  # "causal_lm" | "seq2seq" | "classifier"
    device: str
    dtype: str
    parameters: int  # the model's own (tied weights once)
    adapter_parameters: int  # what the resident adapters add
    vocab_size: int  # the output vocabulary (a translator's target side)
    max_input_tokens: int
    max_new_tokens: int  # cap on a generate request's max_new_tokens (0 for classifiers)
    labels: list[str] | None
    adapters: list[str]
    format: str = "tserve"  # "hf": loaded from a Hugging Face directory
    generation_defaults: dict = field(default_factory=dict)  # what generate uses for fields a request leaves unset
    draft_model: str | None = None  # the model that drafts for speculative method draft_model
    calibration: dict | None = None  # a classifier's temperature and min_confidence (model.calibration)
    embedding_defaults: dict | None = None  # a classifier's pooling and normalize where an embed request leaves them
    chat_template: bool = False  # whether /v1/chat/completions can lay out its conversations (service.engine.chat)
    tool_call_format: str | None = None  # how its chat template writes tool calls ("hermes"); None: another, or none
    tasks: list[str] = field(default_factory=list)  # what it serves: generate, classify, embed, rerank
    languages: list[str] | None = None  # a multilingual translator's codes (target_lang, source_lang)
    source_language: str | None = None  # its tokenizer's own source language (src_lang)
    quantize: str = "none"  # its linear layers' model.quantize mode (model_mode): none, int8, bf16
    static_step: dict | None = None  # service.engine.static_decoding.StaticInfo (None: TSERVE_CUDA_GRAPHS off)


@dataclass(frozen=True)
class QueueTag:
    """Where a request waits: lower ``priority`` is taken first (API keys taking turns within one, FIFO per key),
    and ``client`` (a digest of the caller's API key; None without auth) is what the per-key cap and the turns
    count."""

    priority: int = 0
    client: str | None = None


DEFAULT_QUEUE = QueueTag()  # priority 0, no client


@dataclass
class EngineSettings:
    """What the engine needs to know, with the defaults (service.settings.Settings takes them from here and builds
    one from its fields of the same names)."""

    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 32  # rows per model step (generation) / inputs per forward (classify, embed)
    max_wait_ms: float = 5.0  # how long an idle pooled-family worker waits to fill a batch
    max_queue: int = 256  # waiting requests per model before QueueFull
    max_queue_per_key: int | None = None  # requests per model and API key, waiting or running, before QueueFull
    max_input_tokens: int | None = None  # None -> the model's limit
    max_new_tokens: int = 256
    max_beams: int = 8
    max_return_sequences: int = 8
    max_inputs: int = 64  # inputs (prompts) in one request
    max_rerank_documents: int = 1000  # documents of one rerank / score request (more: 422)
    max_tokens_per_request: int = 65_536  # rows x new tokens x (1 + logprobs) of a request (limits.py)
    request_timeout_s: float = 60.0
    model_load_timeout_s: float = 600.0  # one model's load (files, draft model, int8): failed past it, the others go on
    max_resident_adapters: int = 8
    warmup: bool = True
    quantize: str = "none"  # model.quantize.mode_for spec: "int8", or per model "name=int8,..."
    prefix_cache_mb: float = 256.0  # per generative model (model.prefix_cache); 0 = off
    speculative: str = "none"  # model.speculative.speculative_for spec: the models' default drafting
    draft_model: str = ""  # model.speculative.draft_model_for spec: which model drafts for which
    chat_template: str = ""  # service.engine.chat.chat_template_for spec: NAME=FILE template files, comma-separated
    threads: int | None = None  # intra-op threads per model worker (None: threads.worker_threads decides)
    cuda_graphs: str = "off"  # service.engine.static_decoding: off, lazy, startup
    cuda_graph_sizes: str = ""  # the static step's batch sizes, comma-separated ("": model.static_step.BATCH_SIZES)

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_mb * 2**20)
