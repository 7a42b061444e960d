"""Hostile requests, round two (issue 33, items 1, 3-6 and 11): what one user key could do with a small request,
each reproduced against a real server on 127.0.0.1 (``python -m service`` with API keys on)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from model.checkpoint import load_checkpoint
from model.constraints import MAX_UNROLLED
from service.api.schemas import GenerateResponse
from tests.reliability.helpers import inprocess_server
from tests.reliability.test_hostile_inputs import HUGE_TOKEN
from tests.service.fixtures import LM, MT
from tests.service.server import running_server

USER = {"Authorization": "Bearer userkey"}
SELF_REFERENCE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}


@pytest.fixture(scope="module")
def server(models_dir):
    with running_server(models_dir, TSERVE_API_KEYS="userkey", TSERVE_ADMIN_KEYS="adminkey",
                        TSERVE_MAX_BODY_BYTES=str(4 << 20)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with server.client(headers=USER) as client:
        yield client


def refused(response: httpx.Response, field: str | None, *words: str) -> str:
    """The message of a 422 on ``field`` that says each of ``words``."""
    assert response.status_code == 422, response.text[:500]
    error = response.json()["error"]
    assert error["field"] == field, error
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


def still_serving(client: httpx.Client) -> None:
    response = client.post(f"/v1/models/{LM}/generate", json={"inputs": ["hello"], "max_new_tokens": 2})
    assert response.status_code == 200 and len(response.json()["outputs"][0]["tokens"]) <= 2


# ---- 1. one small request, a response of hundreds of megabytes --------------------------------------------------

PROMPTS = [f"prompt {i}" for i in range(64)]


@pytest.mark.parametrize(("path", "body", "product"), [
    (f"/v1/models/{LM}/generate", dict(inputs=PROMPTS, strategy="beam", num_beams=8, num_return_sequences=8,
                                       max_new_tokens=100, min_new_tokens=100, logprobs=20),
     "inputs 64 x num_beams 8 x max_new_tokens 100 x (1 + logprobs 20) = 1,075,200 token entries"),
    (f"/v1/models/{LM}/generate", dict(inputs=PROMPTS, strategy="sample", num_return_sequences=8, max_new_tokens=127,
                                       logprobs=1),
     "inputs 64 x num_return_sequences 8 x max_new_tokens 127 x (1 + logprobs 1) = 130,048 token entries"),
    ("/v1/completions", dict(model=LM, prompt=PROMPTS, n=8, max_tokens=100, logprobs=20),
     "prompt 64 x n 8 x max_tokens 100 x (1 + logprobs 20) = 1,075,200 token entries"),
    ("/v1/completions", dict(model=LM, prompt=PROMPTS, n=8, max_tokens=100, logprobs=20, stream=True),
     "prompt 64 x n 8 x max_tokens 100"),
    ("/v1/completions", dict(model=LM, prompt=["the quick brown fox " * 6] * 64, echo=True, max_tokens=0,
                             logprobs=20), "prompt tokens"),
], ids=["generate-beam", "generate-sample", "completions", "completions-stream", "echo"])
def test_what_a_request_may_cost_is_bounded_before_it_runs(client, path, body, product):
    """rows x new tokens x (1 + logprobs) against max_tokens_per_request (65,536 by default): a 422 naming the
    product, at once, where a 21 KB body used to return 178 MB."""
    refused(client.post(path, json=body), None, product, "max_tokens_per_request")
    still_serving(client)


def test_the_cost_limit_is_exact(models_dir):
    """At the limit a request runs; one token entry more is refused (a small limit, so both are cheap)."""
    with inprocess_server(models_dir, max_tokens_per_request=24) as server, server.client() as client:
        at = dict(inputs=["a", "b"], strategy="beam", num_beams=3, max_new_tokens=4)
        assert client.post(f"/v1/models/{LM}/generate", json=at).status_code == 200
        refused(client.post(f"/v1/models/{LM}/generate", json={**at, "logprobs": 1}), None, "= 48 token entries")
        refused(client.post("/v1/completions", json=dict(model=LM, prompt=["a", "b"], n=3, max_tokens=5)), None,
                "prompt 2 x n 3 x max_tokens 5 = 30")


def test_large_answers_are_serialized_off_the_event_loop(models_dir, monkeypatch):
    """A generate answer is written to JSON on a worker thread: the event loop (health checks, other requests) is
    never the thread that serializes it."""
    on_loop = []
    serialize = GenerateResponse.model_dump_json

    def spy(self, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return serialize(self, **kwargs)

    monkeypatch.setattr(GenerateResponse, "model_dump_json", spy)
    with inprocess_server(models_dir) as server, server.client() as client:
        response = client.post(f"/v1/models/{LM}/generate", json={"inputs": ["a", "b"], "max_new_tokens": 3,
                                                                  "logprobs": 2})
    assert response.status_code == 200 and len(response.json()["outputs"]) == 2
    assert on_loop == [False]


# ---- 3. echo and tokenize past the input checks -----------------------------------------------------------------

def long_text(models_dir, tokens: int) -> str:
    """A text of random words that the tiny LM encodes to more than ``tokens`` tokens, within the byte bound."""
    tokenizer = load_checkpoint(models_dir / LM, "cpu").tokenizer
    words = random.Random(1).choices(["alpha", "beta", "x", "7", "dog", "the", "q"], k=tokens)
    text = " ".join(words)
    assert len(tokenizer.encode(text)) > tokens
    return text


def test_echo_holds_its_prompt_to_the_input_checks(client, models_dir):
    """echo encoded and ran the prompt before any check: over the token limit a 500 ("index out of range")."""
    over = long_text(models_dir, 127)
    body = dict(model=LM, prompt=over, echo=True, max_tokens=1)
    refused(client.post("/v1/completions", json=body), "prompt[0]", "exceeds max_input_tokens=127")
    refused(client.post("/v1/completions", json={**body, "prompt": ["ok", over]}), "prompt[1]", "max_input_tokens")
    refused(client.post("/v1/completions", json={**body, "prompt": HUGE_TOKEN}), "prompt[0]",
            f"{len(HUGE_TOKEN)} bytes, over the")
    still_serving(client)


@pytest.mark.parametrize("path", ["/v1/tokenize", "/tokenize"])
def test_tokenize_holds_its_prompt_to_the_input_checks(client, models_dir, path):
    refused(client.post(path, json={"model": LM, "prompt": HUGE_TOKEN}), "prompt",
            f"{len(HUGE_TOKEN)} bytes, over the")
    refused(client.post(path, json={"model": LM, "prompt": long_text(models_dir, 127)}), "prompt",
            "exceeds max_input_tokens=127")
    ok = client.post(path, json={"model": MT, "prompt": "hello world", "return_token_strs": True})
    assert ok.status_code == 200 and ok.json()["count"] == len(ok.json()["token_strs"]) > 0


# ---- 4, 6. constraints the engine gave up on: a 500, or "" -------------------------------------------------------

COUNTED = "a{1000000}"


@pytest.mark.parametrize(("path", "body", "field", "words"), [
    (f"/v1/models/{LM}/generate", dict(inputs=["x"], constraint={"regex": COUNTED}), "constraint.regex",
     ["1,000,000 characters", f"{MAX_UNROLLED:,} allowed"]),
    (f"/v1/models/{LM}/generate", dict(inputs=["x"], strategy="beam", num_beams=2,
                                       constraint={"regex": "(x|(ab){1000}){1000}"}), "constraint.regex",
     ["2,001,000 characters"]),
    (f"/v1/models/{LM}/generate", dict(inputs=["x"], constraint={"json_schema": {
        "type": "object", "properties": {"k": {"type": "string", "pattern": f"^{COUNTED}$"}}}}),
     "constraint.json_schema", ["unrolls"]),
    ("/v1/completions", dict(model=LM, prompt="x", guided_regex=COUNTED), "constraint.regex", ["unrolls"]),
    (f"/v1/models/{LM}/generate", dict(inputs=["x"], constraint={"json_schema": SELF_REFERENCE}),
     "constraint.json_schema", ["admits no output"]),
    ("/v1/completions", dict(model=LM, prompt="x", response_format={
        "type": "json_schema", "json_schema": {"schema": SELF_REFERENCE}}), "constraint.json_schema",
     ["admits no output"]),
], ids=["counted-regex", "nested-counts-beam", "schema-pattern", "guided-regex", "self-reference",
        "response-format"])
def test_a_constraint_the_engine_cannot_follow_is_a_422_before_decoding(client, path, body, field, words):
    """a{1000000} passed validation and failed in the engine (500, "too many expressions constructed"); a schema
    that refers only to itself answered 200 with "" and finish_reason eos."""
    refused(client.post(path, json=body), field, *words)
    still_serving(client)


# ---- 5. a lone surrogate -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/tokenize", {"model": LM, "prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"model": MT, "prompt": "a\udfffb"}, "prompt"),
    (f"/v1/models/{LM}/generate", {"inputs": ["ok", "a\ud800b"]}, "inputs[1]"),
    (f"/v1/models/{MT}/generate", {"inputs": ["ok"], "target_prefix": ["\ud800"]}, "target_prefix[0]"),
    ("/v1/completions", {"model": LM, "prompt": "a\ud800b", "echo": True, "max_tokens": 1}, "prompt"),
], ids=["tokenize", "root-tokenize", "generate", "target-prefix", "completions"])
def test_a_lone_surrogate_is_a_422_on_every_route(client, path, body, field):
    """JSON's "\\ud800" escape decodes to a lone surrogate no tokenizer can encode: /tokenize gave a 500."""
    escaped = json.dumps(body)  # ASCII: the surrogate travels as its escape, as a hostile client sends it
    refused(client.post(path, content=escaped, headers={"Content-Type": "application/json"}), field, "lone surrogate")
    still_serving(client)


# ---- 11. keys before bodies ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [b'{"model": "tiny-lm", "prompt": "x"', b"\xff\xfe", b"[1, 2"])
def test_a_request_without_a_key_is_refused_before_its_body_is_parsed(server, body):
    """Malformed JSON without a key was a 422 describing the body; it is a 401 (and with a key, the 422)."""
    headers = {"Content-Type": "application/json"}
    without = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert without.status_code == 401 and without.headers["WWW-Authenticate"] == "Bearer", without.text
    assert without.json()["error"]["code"] == "unauthorized"
    wrong = httpx.post(f"{server.url}/v1/completions", content=body, headers={**headers, "Authorization": "Bearer x"})
    assert wrong.status_code == 401
    keyed = httpx.post(f"{server.url}/v1/completions", content=body, headers={**headers, **USER})
    assert keyed.status_code in (400, 422), keyed.text
