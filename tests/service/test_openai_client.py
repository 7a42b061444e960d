"""The OpenAI surface driven by the official ``openai`` client against a real server: completions (streamed,
``n``, ``stop``, ``logprobs``) and embeddings; then /v1/embeddings, /v1/tokenize and /v1/detokenize over HTTP,
their refusals (422, never a 500) and their metrics labels."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import httpx
import openai
import pytest

from model.checkpoint import load_checkpoint
from tests.service.conftest import CLS, LM, MT
from tests.service.server import metric_samples, running_server

PROMPT = "the quick brown"
TEXTS = ["i love this", "the box is on the table"]


@pytest.fixture(scope="module")
def server(models_dir: Path):
    with running_server(models_dir) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-anything", max_retries=0) as c:
        yield c


def post(client: httpx.Client, path: str, **body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refusal(client: httpx.Client, path: str, body: dict, status: int = 422) -> dict:
    """The error object of a refused request (the one error shape)."""
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()["error"]


def native_generate(client: httpx.Client, prompt: str, **fields) -> dict:
    return post(client, f"/v1/models/{LM}/generate", inputs=[prompt], **fields)["outputs"][0]


def token_count(client: httpx.Client, model: str, text: str) -> int:
    return post(client, "/v1/tokenize", model=model, prompt=text)["count"]


# ---- completions through the client -------------------------------------------------------------------


def test_client_completion_matches_native_generate(oai, client):
    out = oai.completions.create(model=LM, prompt=PROMPT, max_tokens=8, temperature=0)
    expected = native_generate(client, PROMPT, max_new_tokens=8)
    (choice,) = out.choices
    assert choice.text == expected["text"] and out.model == LM and out.object == "text_completion"
    assert out.usage.completion_tokens == len(expected["tokens"])
    assert out.usage.prompt_tokens == token_count(client, LM, PROMPT)


def test_client_n_stop_and_logprobs(oai, client):
    sampled = dict(model=LM, prompt=PROMPT, max_tokens=6, n=3, temperature=0.9, seed=5)
    first = oai.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in oai.completions.create(**sampled).choices] == [c.text for c in first.choices]

    text = native_generate(client, PROMPT, max_new_tokens=12)["text"]
    stop = text[1:3]
    assert stop.strip(), text
    (cut,) = oai.completions.create(model=LM, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]).choices
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"

    (choice,) = oai.completions.create(model=LM, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2).choices
    native = native_generate(client, PROMPT, max_new_tokens=6, logprobs=2)["logprobs"]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and lp.tokens == [e["text"] for e in native]
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in native], abs=1e-5)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy


def test_client_stream_equals_whole_completion(oai):
    body = dict(model=LM, prompt=[PROMPT, "hello world"], max_tokens=8, n=2, temperature=0)
    whole = oai.completions.create(**body)
    texts: dict[int, str] = {}
    usage = None
    for chunk in oai.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


# ---- embeddings ------------------------------------------------------------------------------------------


def test_client_embeddings_equal_native_embed(oai, client):
    native = post(client, f"/v1/models/{CLS}/embed", inputs=TEXTS)
    out = oai.embeddings.create(model=CLS, input=TEXTS)  # the client asks for base64 and decodes it
    assert out.object == "list" and out.model == CLS and [d.index for d in out.data] == [0, 1]
    for got, want in zip(out.data, native["embeddings"], strict=True):
        assert got.object == "embedding" and len(got.embedding) == native["dimensions"]
        assert got.embedding == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(token_count(client, CLS, t) for t in TEXTS)
    floats = oai.embeddings.create(model=CLS, input=TEXTS[0], encoding_format="float", dimensions=len(want))
    assert floats.data[0].embedding == pytest.approx(native["embeddings"][0], rel=1e-5, abs=1e-6)


def test_base64_is_little_endian_float32_of_the_float_vector(client):
    floats = post(client, "/v1/embeddings", model=CLS, input=TEXTS, encoding_format="float")["data"]
    encoded = post(client, "/v1/embeddings", model=CLS, input=TEXTS, encoding_format="base64")["data"]
    for f, b in zip(floats, encoded, strict=True):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]  # float32 values, exactly


def test_client_raises_the_servers_refusals(oai):
    cases = [
        (dict(model=LM, input="hello"), 422, "model"),  # a generative model has no embeddings
        (dict(model=CLS, input=[[1, 2, 3]]), 422, "input"),  # token-id arrays
        (dict(model=CLS, input="hello", dimensions=7), 422, "dimensions"),
        (dict(model="no-such-model", input="hello"), 404, None),
    ]
    for body, status, field in cases:
        with pytest.raises(openai.APIStatusError) as caught:
            oai.embeddings.create(**body)
        assert caught.value.status_code == status, body
        assert caught.value.body["field"] == field, body  # the client unwraps {"error": ...}


def test_embeddings_refusals(client, server):
    long_text = "word " * 4000
    cases = [
        ({"model": CLS, "input": [1, 2]}, "input", "token-id arrays"),
        ({"model": CLS, "input": []}, "input", None),
        ({"model": CLS, "input": ""}, "input", None),
        ({"model": CLS, "input": ["ok", ""]}, "input[1]", None),
        ({"model": CLS, "input": ["ok", long_text]}, "input[1]", "max_input_tokens"),  # renamed from inputs[1]
        ({"model": CLS, "input": ["ok"] * 65}, "input", "65 inputs"),  # the setting max_inputs (64)
        ({"model": CLS, "input": "x", "encoding_format": "int8"}, "encoding_format", None),
        ({"model": CLS, "input": "x", "dimensions": 0}, "dimensions", None),
        ({"model": CLS, "input": "x", "dimensions": "32"}, "dimensions", None),
        ({"model": CLS, "input": "x", "pooling": "cls"}, "pooling", None),  # not an OpenAI field
        ({"input": "x"}, "model", None),
        ({"model": "bad name!", "input": "x"}, "model", None),
        ({"model": MT, "input": "x"}, "model", "seq2seq"),
    ]
    for body, field, words in cases:
        error = refusal(client, "/v1/embeddings", body)
        assert error["field"] == field, (body, error)
        assert words is None or words in error["message"], (body, error)
    assert "Traceback" not in server.log()


# ---- tokenize / detokenize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [LM, MT, CLS])
def test_tokenize_is_the_models_own_encoding(client, models_dir, model):
    ckpt = load_checkpoint(models_dir / model, device="cpu")
    tok = ckpt.src_tokenizer if ckpt.family == "seq2seq" else ckpt.tokenizer
    own = tok.encode(PROMPT)
    expected = {"causal_lm": [tok.bos_id, *own], "seq2seq": [*own, tok.eos_id],
                "classifier": [tok.cls_id, *own, tok.sep_id]}[ckpt.family]
    info = next(m for m in client.get("/v1/models").json()["data"] if m["name"] == model)

    out = post(client, "/v1/tokenize", model=model, prompt=PROMPT)
    assert out == {"count": len(expected), "max_model_len": info["max_input_tokens"], "tokens": expected,
                   "token_strs": None}
    bare = post(client, "/v1/tokenize", model=model, prompt=PROMPT, add_special_tokens=False, return_token_strs=True)
    assert bare["tokens"] == own and "".join(bare["token_strs"]) == PROMPT
    assert post(client, "/v1/detokenize", model=model, tokens=bare["tokens"]) == {"prompt": PROMPT}
    assert post(client, "/v1/detokenize", model=model, tokens=[]) == {"prompt": ""}


def test_tokenize_counts_what_generation_reads(client):
    prompts = [PROMPT, "hello world"]
    usage = post(client, "/v1/completions", model=LM, prompt=prompts, max_tokens=1)["usage"]
    assert usage["prompt_tokens"] == sum(token_count(client, LM, p) for p in prompts)
    assert post(client, "/v1/tokenize", model=LM, prompt="")["tokens"] == [1]  # <s> alone: an empty prompt


def test_detokenize_keeps_special_tokens_and_refuses_ids_outside_the_vocabulary(client, models_dir):
    tok = load_checkpoint(models_dir / LM, device="cpu").tokenizer
    size = tok.vocab_size
    ids = [tok.bos_id, *tok.encode("hi"), tok.eos_id]
    assert post(client, "/v1/detokenize", model=LM, tokens=ids) == {"prompt": "<s>hi</s>"}
    assert post(client, "/v1/detokenize", model=LM, tokens=[size - 1]) == {"prompt": tok.decode([size - 1], False)}
    for tokens, field in (([5, size], "tokens[1]"), ([10**30], "tokens[0]"), ([-1], "tokens[0]"),
                          ([1.5], "tokens[0]"), (["5"], "tokens[0]"), ([True], "tokens[0]"), ("5", "tokens")):
        error = refusal(client, "/v1/detokenize", {"model": LM, "tokens": tokens})
        assert error["field"] == field, (tokens, error)
    assert "outside the vocabulary" in refusal(client, "/v1/detokenize", {"model": LM, "tokens": [size]})["message"]


def test_tokenize_refusals(client):
    cases = [
        ({"model": LM}, "prompt"),
        ({"model": LM, "prompt": 5}, "prompt"),
        ({"model": LM, "prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"model": LM, "prompt": "x", "return_token_strs": 1}, "return_token_strs"),
        ({"model": LM, "messages": [{"role": "user", "content": "x"}]}, "prompt"),  # chat: not supported
        ({"prompt": "x"}, "model"),
        ({"model": "", "prompt": "x"}, "model"),
    ]
    for body, field in cases:
        assert refusal(client, "/v1/tokenize", body)["field"] == field, body
    assert refusal(client, "/v1/tokenize", {"model": "nope", "prompt": "x"}, 404)["code"] == "not_found"
    assert refusal(client, "/v1/detokenize", {"model": "nope", "tokens": [1]}, 404)["code"] == "not_found"


def test_new_routes_are_counted_with_bounded_labels(client):
    post(client, "/v1/tokenize", model=LM, prompt="x")
    post(client, "/v1/detokenize", model=CLS, tokens=[7])
    post(client, "/v1/embeddings", model=CLS, input="x")
    refusal(client, "/v1/embeddings", {"model": "made-up-name", "input": "x"}, 404)
    requests = metric_samples(client.get("/metrics").text, "tserve_requests_total")
    for endpoint, model, status in (("tokenize", LM, "200"), ("detokenize", CLS, "200"), ("embeddings", CLS, "200"),
                                    ("embeddings", "_unknown", "404")):
        key = (("adapter", ""), ("endpoint", endpoint), ("model", model), ("status", status))
        assert requests.get(key, 0) >= 1, (key, sorted(requests))
    assert not any(dict(k)["model"] == "made-up-name" for k in requests)


def test_vllms_root_paths_are_the_same_routes(client):
    """/tokenize and /detokenize at the root, where vLLM serves them: the /v1 answers, and counted alike."""
    before = metric_samples(client.get("/metrics").text, "tserve_requests_total")
    key = (("adapter", ""), ("endpoint", "tokenize"), ("model", LM), ("status", "200"))
    assert post(client, "/tokenize", model=LM, prompt=PROMPT) == post(client, "/v1/tokenize", model=LM, prompt=PROMPT)
    ids = post(client, "/tokenize", model=LM, prompt=PROMPT)["tokens"]
    assert post(client, "/detokenize", model=LM, tokens=ids) == post(client, "/v1/detokenize", model=LM, tokens=ids)
    assert refusal(client, "/tokenize", {"model": LM})["field"] == "prompt"
    after = metric_samples(client.get("/metrics").text, "tserve_requests_total")
    assert after[key] - before.get(key, 0) == 3
