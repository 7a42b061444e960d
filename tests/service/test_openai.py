"""POST /v1/completions on a real server, sent exactly as the official ``openai`` Python client sends it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import torch

from tests.service.conftest import ADAPTERS, CLS, LM
from tests.service.server import running_server, sse_data

PROMPTS = ["the quick brown", "hello world", "to be or"]
# What openai-python 1.x puts on the wire besides the JSON body.
CLIENT_HEADERS = {
    "Authorization": "Bearer sk-anything",  # no keys configured: any key is accepted
    "Accept": "application/json",
    "Content-Type": "application/json",
    "User-Agent": "OpenAI/Python 1.82.0",
    "X-Stainless-Lang": "python",
    "X-Stainless-Package-Version": "1.82.0",
    "X-Stainless-Runtime": "CPython",
    "X-Stainless-Retry-Count": "0",
}


@pytest.fixture(scope="module")
def server(models_dir: Path, adapters_dir: Path):
    with running_server(models_dir, adapters_dir) as s:  # read-only use of the adapters
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client(headers=CLIENT_HEADERS) as c:
        yield c


def complete(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client: httpx.Client, **body) -> list:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_data(r.iter_lines())


def native(client: httpx.Client, model: str, **body) -> list[dict]:
    r = client.post(f"/v1/models/{model}/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["outputs"]


def test_response_shape_and_usage_match_openai(client):
    body = complete(client, model=LM, prompt=PROMPTS[0], max_tokens=8, temperature=0, user="u-1")
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == LM
    (choice,) = body["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None
    (expected,) = native(client, LM, inputs=[PROMPTS[0]], max_new_tokens=8)
    assert choice["text"] == expected["text"]
    assert choice["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[expected["finish_reason"]]
    usage = body["usage"]
    assert usage["completion_tokens"] == len(expected["tokens"])
    assert usage["prompt_tokens"] >= len(PROMPTS[0].split()) + 1  # <s> + the prompt's tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_prompt_list_and_n(client):
    body = dict(model=LM, prompt=PROMPTS[:2], max_tokens=6, n=2, temperature=0.9, top_p=0.95, seed=11)
    first = complete(client, **body)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert first["choices"] == complete(client, **body)["choices"]  # seeded
    greedy = complete(client, model=LM, prompt=PROMPTS[:2], max_tokens=6, n=2, temperature=0)["choices"]
    expected = native(client, LM, inputs=PROMPTS[:2], max_new_tokens=6)
    assert [c["text"] for c in greedy] == [o["text"] for o in expected for _ in range(2)]
    assert complete(client, model=LM, prompt="x", max_tokens=2, n=2, best_of=2)["choices"]  # best_of == n is fine


def test_temperature_or_top_p_near_zero_is_greedy(client):
    greedy = complete(client, model=LM, prompt=PROMPTS, max_tokens=8, temperature=0)["choices"]
    for extra in ({"temperature": 1e-300}, {"top_p": 0}, {"top_p": 1e-300, "temperature": 2}):
        assert complete(client, model=LM, prompt=PROMPTS, max_tokens=8, **extra)["choices"] == greedy, extra


def test_stop(client):
    text = complete(client, model=LM, prompt=PROMPTS[1], max_tokens=12, temperature=0)["choices"][0]["text"]
    stop = text[1:3]
    assert stop.strip(), text
    for value in (stop, [stop, "never-seen"]):
        choice = complete(client, model=LM, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=value)["choices"][0]
        assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"


def test_stream_chunks_equal_non_stream(client):
    body = dict(model=LM, prompt=PROMPTS[:2], max_tokens=10, n=2, temperature=0)
    whole = complete(client, **body)
    events = stream(client, **body, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert {c["id"] for c in chunks} == {usage_chunk["id"]} and len({c["created"] for c in chunks}) == 1
    texts, reasons = {}, {}
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == LM and c["usage"] is None
        (choice,) = c["choices"]
        assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
        assert choice["index"] not in reasons, "a chunk after the choice's finish_reason"
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert reasons == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]


def test_stream_sampling_matches_with_seed_and_no_usage_by_default(client):
    body = dict(model=LM, prompt=PROMPTS[:2], max_tokens=8, temperature=0.8, seed=5)
    whole = complete(client, **body)["choices"]
    events = stream(client, **body)
    chunks = [e for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    texts = {}
    for c in chunks:
        texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert texts == {c["index"]: c["text"] for c in whole}


def test_model_colon_adapter(client):
    adapter = ADAPTERS[LM]
    body = complete(client, model=f"{LM}:{adapter}", prompt=PROMPTS, max_tokens=8, temperature=0)
    assert body["model"] == f"{LM}:{adapter}"
    expected = native(client, LM, inputs=PROMPTS, max_new_tokens=8, adapter=adapter)
    assert [c["text"] for c in body["choices"]] == [o["text"] for o in expected]
    r = client.post("/v1/completions", json={"model": f"{LM}:nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_logprobs_fill_openais_object_and_agree_with_the_native_route(client):
    body = complete(client, model=LM, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    native_out = native(client, LM, inputs=[PROMPTS[1]], max_new_tokens=6, logprobs=3)[0]
    entries = native_out["logprobs"]
    assert lp["tokens"] == [e["text"] for e in entries] and "".join(lp["tokens"]).startswith(choice["text"])
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in entries], abs=1e-5)
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(entries))]
    for top, entry in zip(lp["top_logprobs"], entries, strict=True):
        assert top[entry["text"]] == pytest.approx(entry["logprob"], abs=1e-5)  # the chosen token is listed
        assert len(top) <= 4 and max(top.values()) == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-5)
    assert sum(lp["token_logprobs"]) == pytest.approx(native_out["score"], abs=1e-3) or \
        native_out["finish_reason"] == "eos"  # an ending EOS counts in the score only
    streamed = [c for c in stream(client, model=LM, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
                if c != "[DONE]"]
    tokens = [t for c in streamed if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    values = [v for c in streamed if c["choices"][0]["logprobs"]
              for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    offsets = [o for c in streamed if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == lp["tokens"] and values == pytest.approx(lp["token_logprobs"], abs=1e-5)
    assert offsets == lp["text_offset"]
    assert complete(client, model=LM, prompt=PROMPTS[1], max_tokens=3)["choices"][0]["logprobs"] is None


def test_echo_returns_the_prompt_and_its_logprobs_then_the_completions(client, models_dir):
    from model.checkpoint import load_checkpoint

    body = complete(client, model=LM, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2, echo=True)
    plain = complete(client, model=LM, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    choice, alone = body["choices"][0], plain["choices"][0]
    assert choice["text"] == PROMPTS[0] + alone["text"]
    lp = choice["logprobs"]
    n = len(lp["tokens"]) - len(alone["logprobs"]["tokens"])
    assert "".join(lp["tokens"][:n]) == PROMPTS[0]
    assert lp["token_logprobs"][n:] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-5)
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    # The prompt's log-probs against a float64 forward of the checkpoint (after the BOS the model adds).
    ckpt = load_checkpoint(models_dir / LM, device="cpu")
    ids = ckpt.tokenizer.encode(PROMPTS[0], add_bos=True)
    reference = ckpt.model.double()
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([ids]))[0], dim=-1)
    want = [float(logprobs[k - 1, ids[k]]) for k in range(1, len(ids))]
    assert lp["token_logprobs"][:n] == pytest.approx(want, abs=1e-4)
    scored = complete(client, model=LM, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=0, echo=True, logprobs=0)
    assert [c["text"] for c in scored["choices"]] == PROMPTS[:2]
    assert scored["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)
    assert scored["usage"]["completion_tokens"] == 0


def test_guided_fields_and_response_format_constrain_the_completion(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    for extra in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}):
        text = complete(client, model=LM, prompt="hello", max_tokens=60, temperature=0, **extra)["choices"][0]["text"]
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    choice = complete(client, model=LM, prompt="hello", max_tokens=120, temperature=0,
                      response_format={"type": "json_object"})["choices"][0]
    # Any object: nothing bounds its keys' length, so the length limit may cut it (then it is an object's start).
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["text"].startswith("{")
    choices = complete(client, model=LM, prompt=["hello", "to be"], max_tokens=10, temperature=1.0, seed=3, n=2,
                       guided_choice=["alpha", "beta"])["choices"]
    assert len(choices) == 4 and all(c["text"] in ("alpha", "beta") for c in choices)
    text = complete(client, model=LM, prompt="hello", max_tokens=20, temperature=0,
                    guided_regex="[0-9]{3}-[a-z]{2}")["choices"][0]["text"]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text)


@pytest.mark.parametrize(
    ("extra", "status", "field"),
    [
        ({"logprobs": 21}, 422, "logprobs"),
        ({"guided_regex": "[a-z"}, 422, "constraint.regex"),
        ({"guided_json": "{not json"}, 422, "guided_json"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, 422, "guided_regex"),
        ({"response_format": {"type": "json_schema"}}, 422, "response_format.json_schema"),
        ({"logprobs": -1}, 422, "logprobs"),
        ({"echo": True, "stream": True}, 422, "echo"),
        ({"max_tokens": 0}, 422, "max_tokens"),
        ({"best_of": 3}, 422, "best_of"),
        ({"suffix": "!"}, 422, "suffix"),
        ({"presence_penalty": 0.5}, 422, "presence_penalty"),
        ({"logit_bias": {"50256": -100}}, 422, "logit_bias"),
        ({"functions": []}, 422, "functions"),
        ({"max_tokens": 100000}, 422, "max_tokens"),
        ({"n": 100}, 422, "n"),
        ({"temperature": 3}, 422, "temperature"),
        ({"prompt": []}, 422, "prompt"),
        ({"prompt": [1, 2, 3]}, 422, "prompt[0]"),
        ({"prompt": "word " * 400}, 422, "prompt[0]"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 422, "stop"),
        ({"model": CLS}, 422, "model"),
        ({"model": "no-such-model"}, 404, None),
    ],
)
def test_rejected_fields(client, extra, status, field):
    r = client.post("/v1/completions", json={"model": LM, "prompt": "hello", "max_tokens": 4, **extra})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["field"] == field and error["request_id"] == r.headers["x-request-id"]
    if field:
        assert field in error["message"]
