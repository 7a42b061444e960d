"""Models loaded and unloaded at run time (PUT / DELETE /v1/models/{name}, admin key), against a real server.

A load reads a directory under the models directory as start-up does and is listed, served, reported by /ready and
/metrics (the vLLM-compat gauges too); a path outside the models directory or a broken model is a 422 that says why,
and the other models serve on. An unload takes the model off the list at once (new requests 404), lets a request in
flight finish, drops its metric series and releases its memory (the module is garbage collected); the name can then
be loaded again.
"""

from __future__ import annotations

import gc
import shutil
import threading
import weakref
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import StepGate, error_of
from tests.reliability.helpers import inprocess_server, wait_until
from tests.service.conftest import CLS, LM

USER, ADMIN = "mc-user-key", "mc-admin-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
CLASSIFY = {"inputs": ["hello"]}


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("model-control") / "models"
    shutil.copytree(models_dir / LM, root / LM)  # served from start-up: the model that must keep serving
    with inprocess_server(root, api_keys=(USER,), admin_keys=(ADMIN,), metrics_compat="vllm") as s:
        yield s


@pytest.fixture
def client(server):
    with server.client(headers=AS_ADMIN) as c:
        yield c


def models_root(server) -> Path:
    return server.engine.models_dir


def series_of(server, model: str) -> set[str]:
    """Names of the /metrics samples labelled with ``model`` (``model`` or vLLM's ``model_name``)."""
    text = httpx.get(server.url + "/metrics").text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples
            if model in (s.labels.get("model"), s.labels.get("model_name"))}


def assert_lm_serves(c: httpx.Client) -> None:
    r = c.post(f"/v1/models/{LM}/generate", json={"inputs": ["hello"], "max_new_tokens": 2})
    assert r.status_code == 200, r.text


def test_loading_and_unloading_need_an_admin_key(server):
    with server.client(headers={"Authorization": f"Bearer {USER}"}) as c:
        assert "admin key" in error_of(c.put("/v1/models/x", json={"path": LM}), 403, "forbidden")["message"]
        assert "admin key" in error_of(c.delete(f"/v1/models/{LM}"), 403, "forbidden")["message"]
        error_of(c.get("/v1/models/x"), 405)  # the other methods: 405, listing both
        assert c.get("/v1/models/x").headers["allow"] == "DELETE, PUT"
    error_of(httpx.put(server.url + "/v1/models/x", json={"path": LM}), 401, "unauthorized")
    assert [m["id"] for m in httpx.get(server.url + "/v1/models", headers=AS_ADMIN).json()["data"]] == [LM]


def test_refused_loads_say_why_and_the_others_serve_on(server, client, models_dir, tmp_path):
    root = models_root(server)
    outside = tmp_path / "outside"
    shutil.copytree(models_dir / CLS, outside / "cls")
    (root / "escape").symlink_to(outside)  # a link on the way: the path leads out of the models directory
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    try:
        for path in ("../outside/cls", str(outside / "cls"), ".hidden", "escape/cls", "a/../../x", ""):
            error = error_of(client.put("/v1/models/x", json={"path": path}), 422, "invalid_request")
            assert error["field"] == "path", (path, error)
        error = error_of(client.put("/v1/models/x", json={"path": "broken"}), 422, "invalid_request")
        assert "did not load" in error["message"] and "broken" in error["message"], error
        assert str(root) not in error["message"]  # no server paths in answers
        assert "not found" in error_of(client.put("/v1/models/x", json={"path": "missing"}), 422)["message"]
        error_of(client.put("/v1/models/.x", json={"path": LM}), 422)  # not a model name
        error_of(client.put("/v1/models/x", json={"path": LM, "extra": 1}), 422)
        assert "already loaded" in error_of(client.put(f"/v1/models/{LM}", json={"path": LM}), 409, "conflict")[
            "message"]
        error_of(client.delete("/v1/models/nope"), 404, "not_found")
        listed = client.get("/v1/models").json()
        assert [m["id"] for m in listed["data"]] == [LM] and listed["failed"] == []  # run-time failures: the 422
        assert client.get("/ready").json()["models"] == [LM]
        assert_lm_serves(client)
        assert not series_of(server, "x")
    finally:
        (root / "escape").unlink()
        shutil.rmtree(broken)


def test_load_serve_unload_while_in_flight_and_reload(server, client, models_dir):
    root = models_root(server)
    shutil.copytree(models_dir / CLS, root / "staging" / "cls-v2")
    try:
        r = client.put("/v1/models/cls2", json={"path": "staging/cls-v2"})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "cls2" and r.json()["family"] == "classifier"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["cls2", LM]
        assert client.get("/ready").json()["models"] == ["cls2", LM]
        assert client.post("/v1/models/cls2/classify", json=CLASSIFY).status_code == 200
        assert {"tserve_model_load_seconds", "tserve_requests_total", "vllm:num_requests_waiting"} <= series_of(
            server, "cls2")

        # Hold a request in flight in the model's worker, then unload it.
        worker = server.engine.get("cls2")
        module = weakref.ref(worker.model)
        gate = StepGate(worker.scheduler)
        del worker
        answers: dict[str, httpx.Response] = {}

        def send(key: str, method: str, path: str, **kwargs) -> threading.Thread:
            def run() -> None:
                with server.client(headers=AS_ADMIN) as c:
                    answers[key] = c.request(method, path, **kwargs)
            thread = threading.Thread(target=run)
            thread.start()
            return thread

        in_flight = send("in_flight", "POST", "/v1/models/cls2/classify", json=CLASSIFY)
        gate.wait_parked()
        unload = send("unload", "DELETE", "/v1/models/cls2")
        assert wait_until(lambda: "cls2" not in client.get("/ready").json()["models"])
        error_of(client.post("/v1/models/cls2/classify", json=CLASSIFY), 404, "not_found")  # new ones: 404
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [LM]
        assert "unload" not in answers  # still draining: the held request has not finished
        gate.release()
        in_flight.join()
        unload.join()
        assert answers["in_flight"].status_code == 200, answers["in_flight"].text
        assert answers["unload"].status_code == 204, answers["unload"].text
        gc.collect()
        assert module() is None  # its memory is released
        assert not series_of(server, "cls2")  # its series are gone, the vLLM-compat gauges' too
        assert_lm_serves(client)

        # The name is free again: load it once more.
        assert client.put("/v1/models/cls2", json={"path": "staging/cls-v2"}).status_code == 200
        assert client.post("/v1/models/cls2/classify", json=CLASSIFY).status_code == 200
        assert client.delete("/v1/models/cls2").status_code == 204
    finally:
        shutil.rmtree(root / "staging")
