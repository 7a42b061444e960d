"""OpenTelemetry traces of requests (optional: ``pip install -r requirements-otel.txt``), off unless an OTLP endpoint
is configured (``--otlp-traces-endpoint``, or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``).

Every API request gets a server span (service/api/middleware.py's TracingMiddleware: its parent from the caller's
W3C ``traceparent`` header, which the response carries back with this span's id). A request's work in the engine
becomes a child span named after the GenAI semantic conventions ("text_completion code", "embeddings langid") with
their attributes (model, adapter, token counts, strategy, finish reasons), and that span has children for the phases
the worker timed: ``queue`` (arrival to admission), then ``prefill`` (admission to the first token) and ``decode``
(to the end) for generation, or ``compute`` for classification and embeddings. The worker thread only stamps times
on the job; the spans are made on the event loop once the job is over, so tracing costs the decoding loop nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from model.generation_config import Strategy
from service.engine.jobs import GenerationJob, Job, PoolingJob

OPERATIONS = {"generate": "text_completion", "stream": "text_completion", "embed": "embeddings",
              "classify": "classification"}

_tracer: Any = None  # an opentelemetry Tracer once configure() enabled tracing
_provider: Any = None


class TracingUnavailable(RuntimeError):
    """An OTLP endpoint is configured but the opentelemetry packages are not installed."""


def tracer() -> Any:
    """The Tracer configure() made, or None while tracing is off."""
    return _tracer


def endpoint_configured(setting: str) -> bool:
    """Whether traces go anywhere: our setting or OpenTelemetry's own environment variables."""
    return bool(setting or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(endpoint: str, service_name: str = "tserve") -> bool:
    """Start exporting spans over OTLP/HTTP to ``endpoint`` (a traces URL; empty: OpenTelemetry's environment
    variables decide); return whether tracing is on. Raises TracingUnavailable without the packages."""
    global _tracer, _provider
    if not endpoint_configured(endpoint):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(f"an OTLP traces endpoint is set but OpenTelemetry is not installed ({exc}): "
                                 "pip install -r requirements-otel.txt") from None
    _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
    _tracer = _provider.get_tracer("tserve")
    return True


def shutdown() -> None:
    """Export what is buffered and stop (the server's shutdown)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def record_job(job: Job, model: str, outputs: Iterable[Any] | None, error: BaseException | None) -> None:
    """The span of ``job``'s work in model ``model`` and its phases, under the current span (the request's), from
    the times the worker stamped; ``outputs`` (generation's GenerateOutput list, if any) give the finish reasons.
    A no-op unless tracing is on and a request is being traced (the start-up warm-up is not)."""
    if _tracer is None:
        return
    from opentelemetry.trace import Status, StatusCode, get_current_span, set_span_in_context

    if not get_current_span().get_span_context().is_valid:
        return

    to_epoch_ns = time.time_ns() - time.monotonic_ns()  # the job's stamps are time.monotonic() seconds

    def ns(stamp: float) -> int:
        return int(stamp * 1e9) + to_epoch_ns

    end = job.finished_at if job.finished_at is not None else time.monotonic()
    operation = OPERATIONS.get(job.endpoint, job.endpoint)
    span = _tracer.start_span(f"{operation} {model}", start_time=ns(job.arrival), attributes=_attributes(
        job, model, operation, list(outputs or [])))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)))
        span.set_attribute("error.type", type(error).__name__)
    parent = set_span_in_context(span)
    for name, start, stop in _phases(job, end):
        _tracer.start_span(name, context=parent, start_time=ns(start)).end(end_time=ns(stop))
    span.end(end_time=ns(end))


def _phases(job: Job, end: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of the phases the job went through, in monotonic seconds."""
    if job.admitted_at is None:
        return [("queue", job.arrival, end)]
    phases = [("queue", job.arrival, job.admitted_at)]
    if not isinstance(job, GenerationJob):
        return [*phases, ("compute", job.admitted_at, end)]
    if job.first_token_at is None:
        return [*phases, ("prefill", job.admitted_at, end)]
    return [*phases, ("prefill", job.admitted_at, job.first_token_at), ("decode", job.first_token_at, end)]


def _attributes(job: Job, model: str, operation: str, outputs: list[Any]) -> dict[str, Any]:
    """The GenAI semantic conventions' attributes of ``job`` (``tserve.*`` for what they do not name)."""
    attributes: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "tserve",
                                  "gen_ai.request.model": model, "tserve.request_id": job.id}
    if job.adapter_name is not None:
        attributes["tserve.adapter"] = job.adapter_name
    if isinstance(job, GenerationJob):
        config = job.config
        attributes |= {"gen_ai.usage.input_tokens": job.prompt_tokens,
                       "gen_ai.usage.output_tokens": job.generated_tokens,
                       "gen_ai.request.max_tokens": config.max_new_tokens, "tserve.strategy": config.strategy.value,
                       "tserve.inputs": len(job.prompts)}
        if config.strategy == Strategy.SAMPLE:
            sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                        "seed": config.seed}
            attributes |= {f"gen_ai.request.{k}": v for k, v in sampling.items() if v is not None}
        if config.strategy == Strategy.BEAM:
            attributes["tserve.num_beams"] = config.num_beams
        reasons = [o.finish_reason for o in outputs if getattr(o, "finish_reason", None)]
        if reasons:
            attributes["gen_ai.response.finish_reasons"] = reasons
    elif isinstance(job, PoolingJob):
        attributes |= {"gen_ai.usage.input_tokens": sum(len(ids) for ids, _ in job.inputs),
                       "tserve.inputs": len(job.inputs)}
    return attributes
