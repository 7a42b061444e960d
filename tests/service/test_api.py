"""The HTTP API against a real ``python -m service`` on 127.0.0.1: every endpoint, batching, adapters."""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import archive, assert_same_outputs, block_worker, generate
from tests.reliability.helpers import inprocess_server, wait_until
from tests.service.conftest import ADAPTERS, CLS, LABELS, LM, MT, TEXTS
from tests.service.fixtures import PROMPTS
from tests.service.server import metric_samples, running_server, sse_data


@pytest.fixture(scope="module")
def server(models_dir: Path, adapters_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    adapters = tmp_path_factory.mktemp("api") / "adapters"
    shutil.copytree(adapters_dir, adapters)  # uploads land here, not in the shared fixture
    with running_server(models_dir, adapters, TSERVE_MAX_WAIT_MS="30") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def test_health_ready_index_and_request_ids(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert len(r.headers["x-request-id"]) >= 16
    r = client.get("/ready", headers={"X-Request-ID": "client-id.42"})
    assert r.json() == {"status": "ready", "models": [CLS, LM, MT]}
    assert r.headers["x-request-id"] == "client-id.42"
    assert client.get("/health", headers={"X-Request-ID": "no spaces allowed"}).headers["x-request-id"] != (
        "no spaces allowed"
    )
    page = client.get("/")
    assert page.headers["content-type"].startswith("text/html")
    assert 'href="docs"' in page.text and 'href="metrics"' in page.text


def test_models_list(client):
    data = {m["name"]: m for m in client.get("/v1/models").json()["data"]}
    assert {n: m["family"] for n, m in data.items()} == {LM: "causal_lm", MT: "seq2seq", CLS: "classifier"}
    for name, m in data.items():
        assert m["id"] == name and m["object"] == "model" and m["parameters"] > 0
        assert m["device"] == "cpu" and m["dtype"] == "float32" and m["max_input_tokens"] > 0
        assert ADAPTERS[name] in m["adapters"]
    assert data[CLS]["labels"] == LABELS and data[CLS]["max_new_tokens"] == 0
    assert data[LM]["max_new_tokens"] > 0
    # What embed does for a request that names neither: a checkpoint of ours pools by mean, unnormalized.
    assert data[CLS]["embedding_defaults"] == {"pooling": "mean", "normalize": False}
    assert data[LM]["embedding_defaults"] is None and data[MT]["embedding_defaults"] is None


@pytest.mark.parametrize("model", [LM, MT])
def test_generate_strategies(client, model):
    greedy = generate(client, model, inputs=PROMPTS[:2], max_new_tokens=6)["outputs"]
    assert len(greedy) == 2
    for out in greedy:
        # No candidates for one sequence; a translation says whether it kept its input's placeholders (none here).
        translation = {"placeholders_ok"} if model == MT else set()
        assert set(out) == {"text", "tokens", "score", "finish_reason"} | translation
        assert out.get("placeholders_ok", True) is True
        assert out["finish_reason"] in ("eos", "length") and 0 < len(out["tokens"]) <= 6
    # Beam of width 1 is greedy search.
    beam1 = generate(client, model, inputs=PROMPTS[:2], max_new_tokens=6, strategy="beam", num_beams=1)["outputs"]
    assert [o["tokens"] for o in beam1] == [o["tokens"] for o in greedy]
    beam = generate(
        client, model, inputs=PROMPTS[:1], max_new_tokens=6, strategy="beam", num_beams=3, num_return_sequences=2
    )["outputs"][0]
    assert len(beam["candidates"]) == 2 and beam["text"] == beam["candidates"][0]["text"]
    assert beam["candidates"][0]["score"] >= beam["candidates"][1]["score"]
    body = dict(inputs=PROMPTS[:2], max_new_tokens=6, strategy="sample", seed=7, top_k=20, num_return_sequences=3)
    first, again = generate(client, model, **body), generate(client, model, **body)
    assert first == again and all(len(o["candidates"]) == 3 for o in first["outputs"])


def test_generate_stop_string(client):
    out = generate(client, LM, inputs=[PROMPTS[0]], max_new_tokens=12)["outputs"][0]
    stop = out["text"][2:4]
    assert stop.strip(), out  # the tiny model writes printable text
    cut = generate(client, LM, inputs=[PROMPTS[0]], max_new_tokens=12, stop=[stop])["outputs"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == out["text"][: out["text"].index(stop)]


@pytest.mark.parametrize("model", [LM, MT])
@pytest.mark.parametrize("strategy", ["greedy", "sample"])
def test_stream_equals_non_stream(client, model, strategy):
    body = dict(inputs=[PROMPTS[1]], max_new_tokens=10, strategy=strategy, seed=3)
    whole = generate(client, model, **body)["outputs"][0]
    with client.stream("POST", f"/v1/models/{model}/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r.iter_lines())
    assert events[-1] == "[DONE]"
    events = events[:-1]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [e["token"] for e in events if e["token"] is not None] == whole["tokens"]
    assert [e["finish_reason"] for e in events] == [None] * (len(events) - 1) + [whole["finish_reason"]]


def test_classify_texts_pairs_top_k_and_adapter(client):
    inputs = [TEXTS[0], [TEXTS[1], TEXTS[2]]]
    r = client.post(f"/v1/models/{CLS}/classify", json={"inputs": inputs})
    assert r.status_code == 200, r.text
    outputs = r.json()["outputs"]
    assert len(outputs) == 2
    for out in outputs:
        assert set(out["probabilities"]) == set(LABELS)
        assert sum(out["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
        assert out["label"] == max(out["probabilities"], key=out["probabilities"].get)
        assert out["score"] == pytest.approx(out["probabilities"][out["label"]])
    top = client.post(f"/v1/models/{CLS}/classify", json={"inputs": inputs, "top_k": 1}).json()["outputs"]
    assert [list(o["probabilities"]) for o in top] == [[o["label"]] for o in outputs]
    tuned = client.post(f"/v1/models/{CLS}/classify", json={"inputs": inputs, "adapter": ADAPTERS[CLS]})
    assert tuned.status_code == 200 and tuned.json()["outputs"] != outputs


def test_embed_pooling(client):
    vectors = {}
    for pooling in ("cls", "mean"):
        r = client.post(f"/v1/models/{CLS}/embed", json={"inputs": TEXTS[:3], "pooling": pooling})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["dimensions"] == 32 and [len(v) for v in body["embeddings"]] == [32] * 3
        vectors[pooling] = body["embeddings"]
    assert vectors["cls"] != vectors["mean"]


def _shape(maps: list) -> tuple[int, int, int, int]:
    return len(maps), len(maps[0]), len(maps[0][0]), len(maps[0][0][0])


def test_attention_all_families(client):
    r = client.post(f"/v1/models/{MT}/attention", json={"input": TEXTS[0], "target": "le chat"})
    assert r.status_code == 200, r.text
    body = r.json()
    src, tgt = len(body["source_tokens"]), len(body["target_tokens"])
    assert set(body["maps"]) == {"encoder_self", "decoder_self", "cross"}
    assert _shape(body["maps"]["encoder_self"]) == (2, 4, src, src)
    assert _shape(body["maps"]["decoder_self"]) == (2, 4, tgt, tgt)
    assert _shape(body["maps"]["cross"]) == (2, 4, tgt, src)
    assert all(sum(row) == pytest.approx(1.0, abs=1e-4) for row in body["maps"]["cross"][0][0])
    for model in (LM, CLS):
        body = client.post(f"/v1/models/{model}/attention", json={"input": TEXTS[1]}).json()
        ((kind, maps),) = body["maps"].items()
        n = len(body["source_tokens"])
        assert _shape(maps) == (2, 4, n, n), kind


def test_adapters_list_load_upload_unload(client, server, adapters_dir):
    base = generate(client, LM, inputs=PROMPTS, max_new_tokens=8)["outputs"]
    names = [a["name"] for a in client.get(f"/v1/models/{LM}/adapters").json()["adapters"]]
    assert names == [ADAPTERS[LM]]
    r = client.put(f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}")  # reload from the adapter directory
    assert r.status_code == 200, r.text
    assert r.json()["resident"] and r.json()["rank"] == 4 and r.json()["alpha"] == 8
    tuned = generate(client, LM, inputs=PROMPTS, max_new_tokens=8, adapter=ADAPTERS[LM])["outputs"]
    assert tuned != base
    source = adapters_dir / LM / ADAPTERS[LM]
    for kind, content_type in (("tar.gz", "application/gzip"), ("zip", "application/zip")):
        name = f"up-{kind.replace('.', '-')}"
        r = client.put(
            f"/v1/models/{LM}/adapters/{name}", content=archive(source, kind), headers={"Content-Type": content_type}
        )
        assert r.status_code == 200, r.text
        assert_same_outputs([generate(client, LM, inputs=PROMPTS, max_new_tokens=8, adapter=name)["outputs"]], [tuned])
    listed = {a["name"] for a in client.get(f"/v1/models/{LM}/adapters").json()["adapters"]}
    assert listed == {ADAPTERS[LM], "up-tar-gz", "up-zip"}
    assert client.delete(f"/v1/models/{LM}/adapters/up-zip").status_code == 204
    assert "up-zip" not in {a["name"] for a in client.get(f"/v1/models/{LM}/adapters").json()["adapters"]}
    r = client.post(f"/v1/models/{LM}/generate", json={"inputs": ["x"], "adapter": "up-zip"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_concurrent_requests_batch_and_match_sequential(models_dir):
    """Requests that wait together are batched (a model step of several rows) and answer as each does alone. They
    are made to wait together by holding the worker until all of them are queued (an event), not by hoping
    concurrent HTTP requests overlap on a busy machine."""
    bodies = [{"inputs": [p], "max_new_tokens": 8} for p in PROMPTS]
    with inprocess_server(models_dir) as server, server.client() as client:
        sequential = [generate(client, LM, **b)["outputs"] for b in bodies]
        worker = server.engine.get(LM)
        release = block_worker(worker)
        with ThreadPoolExecutor(len(bodies)) as pool:
            pending = [pool.submit(client.post, f"/v1/models/{LM}/generate", json=b) for b in bodies]
            assert wait_until(lambda: worker.scheduler.num_waiting == len(bodies), timeout_s=60)
            release.set()
            responses = [f.result(timeout=60) for f in pending]
        assert [r.status_code for r in responses] == [200] * len(bodies)
        assert_same_outputs([r.json()["outputs"] for r in responses], sequential)
        metrics = client.get("/metrics").text
    count = metric_samples(metrics, "tserve_batch_size_count")[(("model", LM),)]
    alone = metric_samples(metrics, "tserve_batch_size_bucket")[(("le", "1.0"), ("model", LM))]
    assert count > alone, "no model step ran more than one row"


def test_adapter_swap_under_load_loses_no_request(client, server):
    name = ADAPTERS[LM]
    bodies = [{"inputs": [p], "max_new_tokens": 8, "adapter": name if i % 2 else None} for i, p in enumerate(PROMPTS)]
    expected = [generate(client, LM, **b)["outputs"] for b in bodies]

    async def scenario() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            path = f"/v1/models/{LM}/generate"
            load = [asyncio.create_task(c.post(path, json=b)) for b in bodies * 2]
            swaps = []
            for _ in range(3):
                await asyncio.sleep(0.01)
                swaps.append(await c.put(f"/v1/models/{LM}/adapters/{name}"))
            return list(await asyncio.gather(*load)), swaps

    results, swaps = asyncio.run(scenario())
    assert [s.status_code for s in swaps] == [200] * 3
    assert [r.status_code for r in results] == [200] * len(results)
    assert_same_outputs([r.json()["outputs"] for r in results], expected * 2)  # same files: same outputs


def test_metrics_count_requests_with_bounded_labels(client):
    client.post("/v1/models/no-such-model/generate", json={"inputs": ["x"]})
    text = client.get("/metrics").text
    assert text.startswith("# HELP") or "# HELP" in text
    requests = metric_samples(text, "tserve_requests_total")
    key = (("adapter", ""), ("endpoint", "generate"), ("model", LM), ("status", "200"))
    assert requests[key] >= 1
    assert requests[(("adapter", ""), ("endpoint", "generate"), ("model", "_unknown"), ("status", "404"))] >= 1
    assert not any(dict(k)["model"] == "no-such-model" for k in requests)


def test_openapi_documents_error_responses(client):
    spec = client.get("/openapi.json").json()
    generate_responses = spec["paths"]["/v1/models/{model}/generate"]["post"]["responses"]
    for status in ("401", "404", "413", "422", "429", "500", "503", "504"):
        ref = generate_responses[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            if "422" in op["responses"]:
                assert "ErrorResponse" in json.dumps(op["responses"]["422"]), (path, method)
    assert "HTTPValidationError" not in spec["components"]["schemas"]
