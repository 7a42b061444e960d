"""Hand-written bad input against a real server: each case gets a 4xx in the one error shape whose
message names the problem, and the server stays healthy after every case (/health, and a good request
still returns what it returned before the case).

Cases already in tests/service/test_errors.py (empty inputs and strings, over-long inputs, NaN and
infinities, invalid UTF-8, lone surrogates, unknown model and adapter, caps on tokens, beams and inputs,
413 before parsing) are not repeated here; these are the ones it lacks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import error_of
from tests.reliability.helpers import rss_bytes
from tests.service.conftest import CLS, LM, MT
from tests.service.server import running_server

LIMITS = dict(
    TSERVE_MAX_BODY_BYTES="65536",
    TSERVE_MAX_NEW_TOKENS="16",
    TSERVE_MAX_BEAMS="3",
    TSERVE_MAX_INPUTS="4",
    TSERVE_WARMUP="false",
)
GOOD = {"inputs": ["hello world"], "max_new_tokens": 6}


@pytest.fixture(scope="module")
def server(models_dir: Path):
    with running_server(models_dir, None, **LIMITS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def good_output(client) -> list:
    r = client.post(f"/v1/models/{LM}/generate", json=GOOD)
    assert r.status_code == 200, r.text
    return r.json()["outputs"]


def still_healthy(client: httpx.Client, good_output: list) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    r = client.post(f"/v1/models/{LM}/generate", json=GOOD)
    assert r.status_code == 200 and r.json()["outputs"] == good_output, r.text


X = {"inputs": ["x"]}
SAMPLE = {"inputs": ["x"], "strategy": "sample"}
BEAM = {"inputs": ["x"], "strategy": "beam"}


@pytest.mark.parametrize(
    ("path", "body", "field", "says"),
    [
        # wrong types (strict: no coercion of true or "5" to a number)
        (f"{LM}/generate", {**X, "max_new_tokens": True}, "max_new_tokens", "valid integer"),
        (f"{LM}/generate", {**X, "max_new_tokens": "5"}, "max_new_tokens", "valid integer"),
        (f"{LM}/generate", {**X, "max_new_tokens": 5.5}, "max_new_tokens", "valid integer"),
        (f"{LM}/generate", {**X, "stream": "yes"}, "stream", "valid boolean"),
        (f"{LM}/generate", {**SAMPLE, "temperature": "hot"}, "temperature", "valid number"),
        (f"{LM}/generate", {"inputs": [None]}, "inputs[0]", "valid string"),
        (f"{LM}/generate", {"inputs": [["x"]]}, "inputs[0]", "valid string"),
        (f"{LM}/generate", {"inputs": {"x": 1}}, "inputs", "valid list"),
        (f"{CLS}/classify", {"inputs": [{"a": "b"}]}, "inputs[0]", "valid string"),
        (f"{CLS}/classify", {"inputs": [["a"]]}, "inputs[0]", "at least 2 items"),
        ("completions", {"model": LM, "prompt": 5}, "prompt", "valid string"),
        ("completions", {"model": LM, "prompt": "x", "n": "2"}, "n", "valid integer"),
        # negative, zero and enormous numbers
        (f"{LM}/generate", {**X, "max_new_tokens": -5}, "max_new_tokens", "greater than or equal to 1"),
        (f"{LM}/generate", {**X, "max_new_tokens": 0}, "max_new_tokens", "greater than or equal to 1"),
        (f"{LM}/generate", {**X, "max_new_tokens": 10**30}, "max_new_tokens", "exceeds the limit 16"),
        (f"{LM}/generate", {**X, "min_new_tokens": 10**30}, "min_new_tokens", "max_new_tokens"),
        (f"{LM}/generate", {**BEAM, "num_beams": 0}, "num_beams", "greater than or equal to 1"),
        (f"{LM}/generate", {**BEAM, "num_beams": -3}, "num_beams", "greater than or equal to 1"),
        (f"{LM}/generate", {**BEAM, "num_beams": 10**9}, "num_beams", "max_beams=3"),
        (f"{LM}/generate", {**SAMPLE, "top_k": -1}, "top_k", "greater than or equal to 0"),
        (f"{LM}/generate", {**SAMPLE, "temperature": 0}, "temperature", "greater than or equal to 0.0001"),
        (f"{LM}/generate", {**SAMPLE, "temperature": -1}, "temperature", "greater than or equal to 0.0001"),
        (f"{LM}/generate", {**SAMPLE, "temperature": 1e308}, "temperature", "less than or equal to 100"),
        (f"{LM}/generate", {**SAMPLE, "top_p": 0}, "top_p", "greater than or equal to 0.000001"),
        (f"{LM}/generate", {**X, "num_return_sequences": 10**6}, "num_return_sequences", "max_return_sequences"),
        (f"{LM}/generate", {**X, "seed": 2**64}, "seed", "less than or equal to"),
        ("completions", {"model": LM, "prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ("completions", {"model": LM, "prompt": "x", "max_tokens": 10**30}, "max_tokens", "exceeds the limit 16"),
        ("completions", {"model": LM, "prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
        ("completions", {"model": LM, "prompt": "x", "n": 10**6}, "n", "max_return_sequences"),
        ("completions", {"model": LM, "prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
        # empty and over-long, in tokens and in bytes
        (f"{CLS}/embed", {"inputs": [""]}, "inputs[0]", "at least 1 character"),
        (f"{LM}/generate", {**X, "stop": [""]}, "stop[0]", "at least 1 character"),
        (f"{LM}/generate", {**X, "stop": ["a"] * 17}, "stop", "at most 16"),
        ("completions", {"model": LM, "prompt": ""}, "prompt", "at least 1 character"),
        ("completions", {"model": LM, "prompt": []}, "prompt", "at least 1 item"),
        ("completions", {"model": "", "prompt": "x"}, "model", "at least 1 character"),
        (f"{LM}/generate", {"inputs": ["\U0001f600" * 3000]}, "inputs[0]", "max_input_tokens"),  # 12 kB, 12k tokens
        (f"{CLS}/embed", {"inputs": ["x" * 3000]}, "inputs[0]", "max_input_tokens"),
        (f"{MT}/attention", {"input": "x", "target": "y " * 500}, "target", "max_len"),
        (f"{LM}/attention", {"input": "x", "target": "y " * 500}, "target", "max_len"),
        # very many inputs (under the byte limit)
        (f"{LM}/generate", {"inputs": ["x"] * 10000}, "inputs", "max_inputs=4"),
        (f"{CLS}/classify", {"inputs": ["x"] * 5000}, "inputs", "max_inputs=4"),
        ("completions", {"model": LM, "prompt": ["x"] * 5000}, "prompt", "max_inputs"),
        # adapter names that try to leave the adapters directory
        (f"{LM}/generate", {**X, "adapter": "/etc/passwd"}, "adapter", "pattern"),
        (f"{LM}/generate", {**X, "adapter": "../tiny-mt/mt-a"}, "adapter", "pattern"),
        (f"{LM}/generate", {**X, "adapter": ".."}, "adapter", "pattern"),
        (f"{LM}/generate", {**X, "adapter": ""}, "adapter", "pattern"),
        (f"{CLS}/classify", {**X, "adapter": "a/../../b"}, "adapter", "pattern"),
    ],
)
def test_bad_values_are_422_naming_the_field(client, good_output, path, body, field, says):
    url = "/v1/completions" if path == "completions" else f"/v1/models/{path}"
    error = error_of(client.post(url, json=body), 422, "invalid_request")
    assert error["field"] == field and field in error["message"] and says in error["message"], error
    still_healthy(client, good_output)


@pytest.mark.parametrize(
    ("raw", "status", "says"),
    [
        (b'{"inputs": ["a\x01b"]}', 422, "Invalid control character"),  # raw control characters: not JSON
        (b'{"inputs": ["a\nb"]}', 422, "Invalid control character"),
        (b'{"inputs": ["x"], "inputs": 3}', 422, "valid list"),  # duplicate key: the last one wins
        (b'"hello"', 422, "valid dictionary"),
        (b"null", 422, "valid dictionary"),
        (b'{"inputs": ["x"], "max_new_tokens": 1e400}', 422, "valid integer"),
        (b'{"inputs": ["x"], "strategy": "sample", "temperature": 1e400}', 422, "finite number"),
        (b'{"inputs":' + b"[" * 20000 + b"]" * 20000 + b"}", 400, "nested too deeply"),
        (b'{"inputs": ["x"], "max_new_tokens": 1' + b"0" * 5000 + b"}", 400, "4300 digits"),
    ],
)
def test_malformed_json_is_4xx_naming_the_problem(client, good_output, raw, status, says):
    r = client.post(f"/v1/models/{LM}/generate", content=raw, headers={"Content-Type": "application/json"})
    assert says in error_of(r, status)["message"]
    still_healthy(client, good_output)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("PUT", f"/v1/models/{LM}/adapters/..%2F..%2Fetc", 404),  # decoded to a path no route has
        ("PUT", f"/v1/models/{LM}/adapters/%2Fetc%2Fpasswd", 404),
        ("DELETE", f"/v1/models/{LM}/adapters/..%2F{MT}", 404),
        ("GET", "/v1/models/%ff%fe/adapters", 422),  # not a model name
        ("POST", "/v1/models/.hidden/generate", 422),
    ],
)
def test_paths_that_leave_their_directory_are_refused(client, good_output, method, path, status):
    r = client.request(method, path, json=X if method == "POST" else None)
    error_of(r, status)
    still_healthy(client, good_output)


def test_escaped_control_characters_are_text(client, good_output):
    """JSON escapes of control characters are valid text: served like any other, and the server lives on."""
    r = client.post(f"/v1/models/{LM}/generate", json={"inputs": ["x\u0000y\u0007\u001b[31m"], "max_new_tokens": 4})
    assert r.status_code == 200 and len(r.json()["outputs"]) == 1
    still_healthy(client, good_output)


def test_enormous_top_k_means_every_token(client, good_output):
    """top_k at or above the vocabulary restricts nothing: the same draws as top_k=0 (HF clamps it too)."""
    body = {"inputs": ["the cat"], "strategy": "sample", "seed": 7, "max_new_tokens": 8}
    unrestricted = client.post(f"/v1/models/{LM}/generate", json={**body, "top_k": 0}).json()
    for top_k in (10**6, 2**63 - 1):
        assert client.post(f"/v1/models/{LM}/generate", json={**body, "top_k": top_k}).json() == unrestricted
    probabilities = client.post(f"/v1/models/{CLS}/classify", json={"inputs": ["x"], "top_k": 10**12}).json()
    assert len(probabilities["outputs"][0]["probabilities"]) == 3
    still_healthy(client, good_output)


def test_huge_bodies_are_refused_before_parsing_without_growing_memory(server, client, good_output):
    """20 MB bodies, declared or chunked, are refused at the limit; the server's memory does not grow."""
    rss_start = rss_bytes(server.process.pid)
    chunk = b"[" + b'"aaaaaaaa",' * 10_000  # 110 kB of a JSON array that never ends

    def chunks():
        for _ in range(180):
            yield chunk

    start = time.perf_counter()
    for _ in range(5):
        r = client.post(f"/v1/models/{LM}/generate", content=chunks(), headers={"Content-Type": "application/json"})
        assert "65536 bytes" in error_of(r, 413, "payload_too_large")["message"]
        big = json.dumps({"inputs": ["a" * (20 << 20)]})
        r = client.post(f"/v1/models/{LM}/generate", content=big, headers={"Content-Type": "application/json"})
        error_of(r, 413, "payload_too_large")
    elapsed = time.perf_counter() - start
    growth = rss_bytes(server.process.pid) - rss_start
    assert growth < 10 << 20, growth  # 200 MB went by; well under one body's size stayed
    print(f"FIGURE huge_body_10x20MB_s={elapsed:.2f} rss_growth_mb={growth / 2**20:.1f}")
    still_healthy(client, good_output)
