"""Property-based fuzzing of the whole HTTP API from its OpenAPI schema (schemathesis).

Every operation gets generated paths, headers and bodies through the real ASGI app with its
lifespan (the engine) running and API keys on: schemathesis' coverage phase (boundary values,
wrong types, missing fields, unexpected methods; deterministic) and its fuzzing phase (random
valid and schema-violating examples, derandomized). Every response must not be a 5xx and must have
a status, content type, headers and body that the operation documents; schema-violating input must
be refused with a 4xx.
"""

from __future__ import annotations

import collections
import json
import shutil
import zlib
from pathlib import Path

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation.meta import negated_parameters

from service.api.app import create_app
from service.api.routes.adapters import ARCHIVE_TYPES
from service.settings import Settings
from tests.service.conftest import ADAPTERS, CLS, LM, MT
from tests.service.fixtures import lm_chat_template

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]
MAX_EXAMPLES = 40
MAX_BODY_BYTES = 16384
ADMIN = "fuzz-admin-key"
# Every operation of the schema; test_every_operation_is_fuzzed fails when a route is added without
# being listed here (schemathesis' pytest plug-in, from_fixture, does not run under pytest 9).
OPERATIONS = {
    "GET /health": [],
    "GET /ready": [],
    "GET /metrics": [],
    "GET /v1/models": [],
    "POST /v1/models/{model}/generate": [LM, MT],  # the models whose family the operation serves
    "POST /v1/models/{model}/classify": [CLS],
    "POST /v1/models/{model}/embed": [CLS],
    "POST /v1/models/{model}/entities": [CLS],  # no token head: its 422s
    "POST /v1/models/{model}/attention": [LM, MT, CLS],
    "GET /v1/models/{model}/adapters": [LM, MT, CLS],
    "PUT /v1/models/{model}/adapters/{name}": [LM, MT, CLS],
    "DELETE /v1/models/{model}/adapters/{name}": [LM, MT, CLS],
    "PUT /v1/models/{name}": [],  # generated names and paths: never the served models (prepare)
    "DELETE /v1/models/{name}": [],
    "POST /v1/completions": [LM],
    "POST /v1/chat/completions": [LM],
    "POST /v1/embeddings": [CLS],
    "POST /v1/tokenize": [LM, MT, CLS],
    "POST /v1/detokenize": [LM, MT, CLS],
    "POST /v1/rerank": [],
    "POST /v1/score": [],
}
# The models a positive example's body "model" is pointed at (or it keeps the generated name).
BODY_MODELS = {"POST /v1/completions": [LM, f"{LM}:{ADAPTERS[LM]}", MT],
               "POST /v1/chat/completions": [LM, f"{LM}:{ADAPTERS[LM]}", MT], "POST /v1/embeddings": [CLS, LM],
               "POST /v1/tokenize": [LM, MT, CLS], "POST /v1/detokenize": [LM, MT, CLS],
               "POST /v1/rerank": [CLS, f"{CLS}:{ADAPTERS[CLS]}", LM],
               "POST /v1/score": [CLS, f"{CLS}:{ADAPTERS[CLS]}"]}
NOTHING_TO_VIOLATE = {"GET /health", "GET /ready", "GET /metrics"}  # no parameter, body or key
MODEL_CONTROL = {"PUT /v1/models/{name}", "DELETE /v1/models/{name}"}  # would unload the models the others need
for _media_type in ARCHIVE_TYPES:  # the upload's binary body, whichever archive type the example picks
    if _media_type != "application/octet-stream":
        schemathesis.serializer.alias(_media_type, "application/octet-stream")


@pytest.fixture(scope="module")
def fuzz_schema(models_dir: Path, adapters_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    torch.set_num_threads(1)
    adapters = tmp_path_factory.mktemp("fuzz") / "adapters"
    shutil.copytree(adapters_dir, adapters)  # the fuzzer uploads and unloads adapters: a private copy
    app = create_app(
        Settings(
            models=models_dir,
            adapters=adapters,
            chat_template=lm_chat_template(adapters.parent),
            device="cpu",
            warmup=False,
            max_new_tokens=8,
            max_beams=3,
            max_return_sequences=3,
            max_inputs=4,
            max_body_bytes=MAX_BODY_BYTES,
            max_adapter_upload_bytes=65536,
            request_timeout_s=20,
            api_keys=("fuzz-user-key",),
            admin_keys=(ADMIN,),
        )
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    yield schema
    schemathesis.python.asgi.shutdown_lifespans()


@pytest.fixture(scope="module")
def statuses():
    """Status codes seen per test (shown with -s), to see that examples reach the handlers."""
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    yield seen
    for key, counter in sorted(seen.items()):
        print(f"{key}: {dict(sorted(counter.items()))}")


def _pick(case, options: list[str]) -> str:
    """A deterministic choice per example (Python's hash() is salted per process)."""
    key = repr((case.path_parameters, case.query, case.body)).encode("utf-8", "surrogatepass")
    return options[zlib.crc32(key) % len(options)]


def over_limit(case) -> bool:
    """Whether a JSON body is over max_body_bytes (counted as ASCII-escaped JSON, so at least its size): refused 413
    before it is read, which schemathesis does not count as rejecting a schema-violating body."""
    body = case.body if isinstance(case.body, dict | list) else None
    return body is not None and len(json.dumps(body).encode()) > MAX_BODY_BYTES


def prepare(case, models: list[str]) -> None:
    """Point the example at a real model (and adapter) unless that is what it violates; add the admin key
    unless the example is about a missing one. Generated names would almost always be unknown (404)."""
    negated = {name for name, _ in negated_parameters(case.meta)}
    params = case.path_parameters or {}
    if "model" in params and "model" not in negated and _pick(case, ["real", "real", "real", "generated"]) == "real":
        params["model"] = _pick(case, models)
        if "name" in params and "name" not in negated:
            params["name"] = ADAPTERS[params["model"]]
    if case.operation.label in MODEL_CONTROL and params.get("name") in (LM, MT, CLS):
        params["name"] += "-fuzz"
    positive = case.meta is None or not case.meta.generation.mode.is_negative
    body = case.body if isinstance(case.body, dict) else {}
    if case.operation.label in BODY_MODELS and positive and "model" in body:
        body["model"] = _pick(case, [*BODY_MODELS[case.operation.label], body["model"]])
    if case.operation.label == "POST /v1/chat/completions" and positive and _pick(case, [True, False]):
        # the schema leaves each role's own rules (content, tool_calls, tool_call_id) to validation, so generated
        # conversations are mostly refused: half the examples get a valid one, for their other fields to reach
        # generation
        body["messages"] = [{"role": "user", "content": "hello"}]
    if not case.operation.schema.is_security_param_negated(case):
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {ADMIN}"}


def test_every_operation_is_fuzzed(fuzz_schema):
    labels = sorted(result.ok().label for result in fuzz_schema.get_all_operations())
    assert labels == sorted(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_coverage_phase(fuzz_schema, statuses, label):
    """Schemathesis' deterministic boundary and type-violation cases, positive and negative."""
    operation = fuzz_schema.find_operation_by_label(label)
    cases = fuzz_schema.iter_coverage_cases(
        operation,
        generation_modes=list(GenerationMode),
        generation_config=fuzz_schema.config.generation_for(operation=operation),
    )
    for case in cases:
        prepare(case, OPERATIONS[label])
        response = case.call_and_validate(checks=CHECKS)
        statuses[f"coverage {label}"][response.status_code] += 1


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzzing_phase(fuzz_schema, statuses, label, mode):
    if mode == GenerationMode.NEGATIVE and label in NOTHING_TO_VIOLATE:
        pytest.skip("no parameter, body or key to violate")
    operation = fuzz_schema.find_operation_by_label(label)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        # Most negative examples would just drop the key (401, tested by hand elsewhere): keep a quarter
        # (all for GET /v1/models, whose key is all there is to violate).
        if label != "GET /v1/models" and fuzz_schema.is_security_param_negated(case):
            assume(_pick(case, [True, False, False, False]))
        assume(mode == GenerationMode.POSITIVE or not over_limit(case))  # a chat body easily grows past the limit
        prepare(case, OPERATIONS[label])
        response = case.call_and_validate(checks=CHECKS)
        statuses[f"fuzz {mode.value} {label}"][response.status_code] += 1

    fuzz()
