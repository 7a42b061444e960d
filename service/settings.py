"""Service settings: one dataclass, every field readable from a ``TSERVE_*`` environment variable.

The command line (``python -m service --help``) offers the same settings as flags; a flag wins over
its environment variable, which wins over the default. :func:`settings_table` renders the table
below as markdown for the README.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from model.generation_config import ConfigError
from model.native import KernelOptions
from model.quantize import QuantizeError, mode_for
from model.speculative import draft_model_for, speculative_for
from service.engine import tracing
from service.engine.chat import chat_template_for
from service.engine.static_decoding import check_mode, parse_sizes
from service.engine.types import EngineSettings
from service.engine.vllm_metrics import COMPAT_MODES
from service.model_sources import ModelSourceError, model_sources

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineSettings)}


class SettingsError(ValueError):
    """A setting (flag or environment variable) has a value it cannot take; the message names it."""


def _keys(value: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in value.split(",") if k.strip())


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {value!r}")


def _optional_int(value: str) -> int | None:
    return None if value.strip().lower() in ("", "none", "auto") else int(value)


def _optional_str(value: str) -> str | None:
    return value.strip() or None


def _optional_path(value: str) -> Path | None:
    return Path(value) if value.strip() else None


def _engine(env: str, help: str, parse: Callable[[str], Any]) -> Any:
    """A setting the engine takes: its default is EngineSettings' (the one source) of the same name, TSERVE_NAME."""
    return _setting(_ENGINE_DEFAULTS[env.removeprefix("TSERVE_").lower()], env, help, parse)


def _setting(default: Any, env: str, help: str, parse: Callable[[str], Any], **kw: Any) -> Any:
    meta = {"env": env, "help": help, "parse": parse}
    if isinstance(default, tuple | list):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class Settings:
    """Everything the service can be told; see :func:`settings_table` for the env vars."""

    models: str | Path | None = _setting(
        None, "TSERVE_MODELS", "directory of model checkpoints, one subdirectory per model, and/or Hugging Face repo "
        "ids in the local Hugging Face cache, comma-separated: [NAME=]ORG/REPO[@REVISION], served as REPO unless "
        "NAME= is given (never downloaded; README: Serve a Hugging Face model)", _optional_str
    )
    adapters: Path | None = _setting(
        None,
        "TSERVE_ADAPTERS",
        "directory of LoRA adapters, laid out as <adapters>/<model>/<name>/ (uploads are extracted there)",
        _optional_path,
    )
    host: str = _setting("127.0.0.1", "TSERVE_HOST", "address to listen on", str)
    port: int = _setting(8000, "TSERVE_PORT", "TCP port to listen on", int)
    device: str = _engine("TSERVE_DEVICE", "torch device: auto (CUDA when available), cpu, cuda, cuda:N", str)
    dtype: str = _engine("TSERVE_DTYPE", "weights dtype: auto, float32, float16, bfloat16", str)
    max_batch_size: int = _engine("TSERVE_MAX_BATCH_SIZE", "most requests one forward pass batches", int)
    max_wait_ms: float = _engine("TSERVE_MAX_WAIT_MS", "how long an idle classifier / embedder waits to fill a batch "
                                 "(ms); generation starts at once (later requests join its running batch)", float)
    max_queue: int = _engine("TSERVE_MAX_QUEUE", "queued requests per model before 429", int)
    max_queue_per_key: int | None = _engine(
        "TSERVE_MAX_QUEUE_PER_KEY",
        "requests per model and API key, waiting or running, before 429 for that key (with API keys; default: no cap)",
        _optional_int,
    )
    min_user_priority: int = _setting(
        0, "TSERVE_MIN_USER_PRIORITY",
        "lowest (first-served) priority a user API key may ask for, 422 below it; admin keys, and a server without "
        "keys, may use any",
        int,
    )
    max_new_tokens: int = _engine("TSERVE_MAX_NEW_TOKENS", "cap on max_new_tokens / max_tokens", int)
    max_beams: int = _engine("TSERVE_MAX_BEAMS", "cap on num_beams", int)
    max_return_sequences: int = _engine("TSERVE_MAX_RETURN_SEQUENCES", "cap on num_return_sequences / n", int)
    max_inputs: int = _engine("TSERVE_MAX_INPUTS", "most inputs (prompts) in one request", int)
    max_rerank_documents: int = _engine(
        "TSERVE_MAX_RERANK_DOCUMENTS", "most documents in one rerank request (texts in one score request's text_2; "
        "422 above)", int
    )
    max_tokens_per_request: int = _engine(
        "TSERVE_MAX_TOKENS_PER_REQUEST",
        "most token entries one generate / completions request may produce, checked before it runs: rows (inputs x "
        "beams or sequences) x max new tokens x (1 + logprobs); echo: prompt tokens x (1 + logprobs); 422 above",
        int,
    )
    max_input_tokens: int | None = _engine(
        "TSERVE_MAX_INPUT_TOKENS", "cap on input tokens (default: each model's maximum length)", _optional_int
    )
    request_timeout_s: float = _engine("TSERVE_REQUEST_TIMEOUT_S", "per-request time-out (504 after it)", float)
    model_load_timeout_s: float = _engine(
        "TSERVE_MODEL_LOAD_TIMEOUT_S", "seconds one model's load may take (at start-up, or PUT /v1/models/NAME) "
        "before it fails (a directory whose files block or crawl) and the other models go on serving", float
    )
    max_resident_adapters: int = _engine(
        "TSERVE_MAX_RESIDENT_ADAPTERS", "LoRA adapters kept in memory per model (least recently used evicted)", int
    )
    max_body_bytes: int = _setting(1 << 20, "TSERVE_MAX_BODY_BYTES", "largest request body (413 above)", int)
    max_chat_messages: int = _setting(512, "TSERVE_MAX_CHAT_MESSAGES", "most messages in one chat completion "
                                      "request (422 above)", int)
    max_chat_bytes: int = _setting(1 << 20, "TSERVE_MAX_CHAT_BYTES", "most bytes of text (contents, tool calls, "
                                   "tools) in one chat completion request (413 above)", int)
    chat_template: str = _engine(
        "TSERVE_CHAT_TEMPLATE", "chat template files that replace models' own (or give one to a model without "
        "one): NAME=FILE entries, comma-separated (a jinja file, as transformers renders it)", str
    )
    max_adapter_upload_bytes: int = _setting(
        64 << 20,
        "TSERVE_MAX_ADAPTER_UPLOAD_BYTES",
        "largest adapter archive upload, and largest total size extracted from it",
        int,
    )
    api_keys: tuple[str, ...] = _setting(
        (),
        "TSERVE_API_KEYS",
        "comma-separated Bearer keys for /v1 (empty: no auth); /health, /ready, /metrics and / stay open",
        _keys,
    )
    admin_keys: tuple[str, ...] = _setting(
        (),
        "TSERVE_ADMIN_KEYS",
        "comma-separated Bearer keys that may also load and unload models and adapters (with auth on and none set, "
        "nobody may)",
        _keys,
    )
    threads: int | None = _engine(
        "TSERVE_THREADS", "torch intra-op threads of each model's worker (default: the CPU cores divided among "
        "the models, at least 1)", _optional_int
    )
    drain_timeout_s: float = _setting(
        30.0, "TSERVE_DRAIN_TIMEOUT_S", "on shutdown, how long in-flight requests may finish", float
    )
    header_timeout_s: float = _setting(
        10.0,
        "TSERVE_HEADER_TIMEOUT_S",
        "time a client has to send a request's line and headers, from connecting or the previous response "
        "(408 and closed after it)",
        float,
    )
    body_timeout_s: float = _setting(
        30.0,
        "TSERVE_BODY_TIMEOUT_S",
        "longest pause between reads of a request body (408 and closed after it; a slow upload that keeps "
        "sending passes)",
        float,
    )
    max_connections: int = _setting(
        512,
        "TSERVE_MAX_CONNECTIONS",
        "most open client connections (one more is answered 503 and closed); keep it under the open-file "
        "limit (ulimit -n)",
        int,
    )
    prefix_cache_mb: float = _engine(
        "TSERVE_PREFIX_CACHE_MB",
        "memory per generative model for reused prompt prefixes (causal LM) and encoded sources (seq2seq), "
        "least recently used evicted; 0 turns prefix caching off",
        float,
    )
    speculative: str = _engine(
        "TSERVE_SPECULATIVE",
        "draft-and-verify decoding for requests that leave \"speculative\" unset (one input, greedy or one sample): "
        "none, ngram:K (prompt lookup, K draft tokens per step), draft_model:K (the model's draft model), or per "
        "model name=... entries plus an optional bare default, e.g. none,code=ngram:4",
        str,
    )
    draft_model: str = _engine(
        "TSERVE_DRAFT_MODEL",
        "the smaller causal LM (a directory of the models directory, same tokenizer) that drafts for speculative "
        "method draft_model: TARGET=DRAFT entries, or one DRAFT for every other causal LM; empty: none",
        str,
    )
    metrics_compat: str = _setting(
        "none",
        "TSERVE_METRICS_COMPAT",
        "also export the gauges a gateway routes by under another server's names: vllm (vllm:num_requests_waiting, "
        "vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:lora_requests_info, as the Gateway API "
        "Inference Extension reads them) or none",
        str,
    )
    otlp_traces_endpoint: str = _setting(
        "",
        "TSERVE_OTLP_TRACES_ENDPOINT",
        "OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces) to export a span per request to (service/"
        "engine/tracing.py; needs requirements-otel.txt); empty: OpenTelemetry's OTEL_EXPORTER_OTLP_ENDPOINT decides, "
        "unset = off",
        str,
    )
    log_level: str = _setting("info", "TSERVE_LOG_LEVEL", "logging level: " + ", ".join(LOG_LEVELS), str)
    warmup: bool = _engine("TSERVE_WARMUP", "run one tiny request per model before reporting ready", _bool)
    quantize: str = _engine(
        "TSERVE_QUANTIZE",
        "lower-precision linear weights (CPU only; on a GPU use dtype): none, int8 (int8 weights, ~4x fewer "
        "bytes), bf16 (bfloat16 weights, float32 accumulation), or per model name=mode entries plus an optional bare "
        "default, e.g. none,translation=int8,code=bf16",
        str,
    )
    cuda_graphs: str = _engine(
        "TSERVE_CUDA_GRAPHS",
        "decoding steps through the static step (service/engine/static_decoding.py): off; lazy (on a GPU each padded "
        "batch size's step is captured as a CUDA graph on first use; on the CPU the same step runs eagerly, slower "
        "than the C++ step: for testing); startup (every size built, captured on a GPU, when the model loads)",
        str,
    )
    cuda_graph_sizes: str = _engine(
        "TSERVE_CUDA_GRAPH_SIZES",
        "the static step's batch sizes, comma-separated (a batch is padded up to the next; more rows than the largest "
        "decode eagerly); empty: 1,2,4,8,16,32,64",
        str,
    )

    def __post_init__(self) -> None:
        positive = (
            "port",
            "max_batch_size",
            "max_queue",
            "max_new_tokens",
            "max_beams",
            "max_return_sequences",
            "max_inputs",
            "max_rerank_documents",
            "max_tokens_per_request",
            "max_resident_adapters",
            "max_body_bytes",
            "max_chat_messages",
            "max_chat_bytes",
            "max_adapter_upload_bytes",
            "max_connections",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} ({_env(name)}) must be >= 1, got {getattr(self, name)}")
        for name in ("max_wait_ms", "drain_timeout_s", "prefix_cache_mb"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise SettingsError(f"{name} ({_env(name)}) must be a finite number >= 0, got {value}")
        for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s", "model_load_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise SettingsError(f"{name} ({_env(name)}) must be a finite number > 0, got {value}")
        for name in ("max_input_tokens", "threads", "max_queue_per_key"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SettingsError(f"{name} ({_env(name)}) must be >= 1, got {getattr(self, name)}")
        if self.port > 65535:
            raise SettingsError(f"port ({_env('port')}) must be <= 65535, got {self.port}")
        if tracing.endpoint_configured(self.otlp_traces_endpoint) and importlib.util.find_spec(
                "opentelemetry.sdk") is None:
            raise SettingsError("an OTLP traces endpoint is set (otlp_traces_endpoint or OTEL_EXPORTER_OTLP_*) but "
                                "OpenTelemetry is not installed: pip install -r requirements-otel.txt")
        if self.metrics_compat not in COMPAT_MODES:
            raise SettingsError(f"metrics_compat ({_env('metrics_compat')}) must be one of {COMPAT_MODES}, got "
                                f"{self.metrics_compat!r}")
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(f"log_level ({_env('log_level')}) must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if any(not k.isascii() or not k.isprintable() or " " in k for k in self.api_keys + self.admin_keys):
            raise SettingsError("API keys must be printable ASCII without spaces")
        if self.models is not None:
            try:
                model_sources(self.models)
            except ModelSourceError as exc:
                raise SettingsError(f"models ({_env('models')}): {exc}") from None
        try:
            mode_for(self.quantize, "")
        except QuantizeError as exc:
            raise SettingsError(f"quantize ({_env('quantize')}): {exc}") from None
        for name, check in (("cuda_graphs", check_mode), ("cuda_graph_sizes", lambda text: parse_sizes(text or "1"))):
            try:
                check(getattr(self, name))
            except ValueError as exc:
                raise SettingsError(f"{name} ({_env(name)}): {exc}") from None
        try:
            speculative_for(self.speculative, "")
        except ConfigError as exc:
            raise SettingsError(f"speculative ({_env('speculative')}): {exc.message}") from None
        try:
            chat_template_for(self.chat_template, "")
        except ValueError as exc:
            raise SettingsError(f"chat_template ({_env('chat_template')}): {exc}") from None
        try:
            draft_model_for(self.draft_model, "")
        except ConfigError as exc:
            raise SettingsError(f"draft_model ({_env('draft_model')}): {exc.message}") from None

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``TSERVE_*`` variables from ``environ``, then ``overrides`` (e.g. CLI flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is None:
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError as exc:
                raise SettingsError(f"{f.metadata['env']}={raw!r}: {exc}") from None
        return cls(**{**values, **overrides})

    def engine_settings(self) -> EngineSettings:
        """The subset the engine takes (EngineSettings' fields, by name)."""
        return EngineSettings(**{f.name: getattr(self, f.name) for f in fields(EngineSettings)})


def _env(name: str) -> str:
    return next(f.metadata["env"] for f in fields(Settings) if f.name == name)


def setting_fields() -> list[Any]:
    """The dataclass fields with their ``env``, ``help`` and ``parse`` metadata (for the CLI)."""
    return list(fields(Settings))


def _shown_default(f: Any) -> str:
    default = f.default_factory() if callable(f.default_factory) else f.default
    if default is None or default == ():
        return "(none)"
    return str(default)


def settings_table() -> str:
    """The configuration table as markdown: flag, environment variable, default, meaning; then the C++
    kernels' options (model.native.KernelOptions: environment variables only, read once per process)."""
    rows = ["| Flag | Environment variable | Default | Meaning |", "|---|---|---|---|"]
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        rows.append(f"| `{flag}` | `{f.metadata['env']}` | `{_shown_default(f)}` | {f.metadata['help']} |")
    for f in fields(KernelOptions):
        rows.append(f"| (none) | `{f.metadata['env']}` | `{f.metadata['shown']}` | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"
