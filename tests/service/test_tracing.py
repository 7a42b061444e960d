"""OpenTelemetry traces from a real server to an OTLP/HTTP receiver the test runs on 127.0.0.1: a request's server
span continues the caller's traceparent (and returns its own), its engine work is a GenAI span with the phases
the worker timed under it, with the semantic conventions' attributes; probes are not traced."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from service.api.app import create_app  # noqa: E402
from service.api.middleware import TracingMiddleware  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.settings import Settings  # noqa: E402
from tests.service.conftest import ADAPTERS, CLS, LM  # noqa: E402
from tests.service.server import otlp_receiver, running_server  # noqa: E402

CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = list(v.string_value for v in value.array_value.values) if kind == "array_value" else \
            getattr(value, kind)
    return out


def wait_for(spans: list, names: set[str], timeout_s: float = 60.0) -> dict[str, list]:
    deadline = time.monotonic() + timeout_s
    while not names <= {s.name for s in spans}:
        assert time.monotonic() < deadline, f"spans received: {sorted({s.name for s in spans})}"
        time.sleep(0.01)
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    return by_name


def test_requests_are_traced_under_the_callers_trace(models_dir, adapters_dir):
    with otlp_receiver() as (endpoint, spans), running_server(
            models_dir, adapters_dir, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_BSP_SCHEDULE_DELAY="50") as server:
        traceparent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
        generated = httpx.post(f"{server.url}/v1/models/{LM}/generate", headers={"traceparent": traceparent},
                               json={"inputs": ["hello"], "max_new_tokens": 3, "min_new_tokens": 3}, timeout=60)
        classified = httpx.post(f"{server.url}/v1/models/{CLS}/classify",
                                json={"inputs": ["i love it"], "adapter": ADAPTERS[CLS]}, timeout=60)
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/no/route/x7q2").status_code == 404  # named by its method: names stay bounded
        by_name = wait_for(spans, {f"text_completion {LM}", f"classification {CLS}", "queue", "prefill", "decode",
                                   "compute", "POST /v1/models/{model}/generate", "GET"})
        assert not any("x7q2" in name for name in by_name)
    assert generated.status_code == classified.status_code == 200
    returned = generated.headers["traceparent"].split("-")
    assert returned[1] == CALLER_TRACE and returned[2] != CALLER_SPAN  # our server span, in the caller's trace
    (request,) = by_name["POST /v1/models/{model}/generate"]
    assert (request.trace_id.hex(), request.parent_span_id.hex(), request.span_id.hex()) == (
        CALLER_TRACE, CALLER_SPAN, returned[2])
    assert attributes(request)["http.response.status_code"] == 200
    (work,) = by_name[f"text_completion {LM}"]
    assert work.parent_span_id == request.span_id
    got = attributes(work)
    assert (got["gen_ai.operation.name"], got["gen_ai.request.model"], got["gen_ai.usage.output_tokens"],
            got["gen_ai.response.finish_reasons"], got["tserve.strategy"]) == (
        "text_completion", LM, 3, ["length"], "greedy")
    assert got["gen_ai.usage.input_tokens"] > 0
    phases = {s.name: s for s in spans if s.parent_span_id == work.span_id}
    assert sorted(phases) == ["decode", "prefill", "queue"]
    assert work.start_time_unix_nano <= phases["queue"].start_time_unix_nano <= phases["queue"].end_time_unix_nano \
        <= phases["prefill"].end_time_unix_nano <= phases["decode"].end_time_unix_nano <= work.end_time_unix_nano
    (classify,) = by_name[f"classification {CLS}"]
    assert attributes(classify)["tserve.adapter"] == ADAPTERS[CLS]
    assert sorted(s.name for s in spans if s.parent_span_id == classify.span_id) == ["compute", "queue"]
    assert classify.trace_id.hex() != CALLER_TRACE  # no traceparent: a trace of its own
    assert not any(s.name.endswith("/health") for s in spans)
    assert all(s.parent_span_id for s in spans if s.name.split()[0] in ("text_completion", "classification",
                                                                         "embeddings"))  # no warm-up traces


def test_tracing_is_off_without_an_endpoint(models_dir, monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings(models=models_dir)
    app = create_app(settings, Engine(settings.engine_settings(), models_dir, None))
    assert not any(m.cls is TracingMiddleware for m in app.user_middleware)
