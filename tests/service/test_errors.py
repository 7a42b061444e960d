"""Errors and limits: one JSON shape for every failure, auth, 404/405/413/415/422/429/503/504, uploads."""

from __future__ import annotations

import asyncio
import io
import shutil
import tarfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.api.app import create_app
from service.api.archive import ArchiveError, read_adapter_archive
from service.settings import Settings
from tests.helpers import block_worker, error_of
from tests.reliability.helpers import inprocess_server
from tests.reliability.helpers import wait_until as wait_until_true
from tests.service.conftest import ADAPTERS, CLS, LM, MT
from tests.service.server import running_server

USER, ADMIN = "user-key-1", "admin-key"
LIMITS = dict(
    TSERVE_API_KEYS=f"{USER}, user-key-2",
    TSERVE_ADMIN_KEYS=ADMIN,
    TSERVE_MAX_BODY_BYTES="4096",
    TSERVE_MAX_ADAPTER_UPLOAD_BYTES="65536",
    TSERVE_MAX_NEW_TOKENS="16",
    TSERVE_MAX_BEAMS="3",
    TSERVE_MAX_INPUTS="4",
)


@pytest.fixture(scope="module")
def server(models_dir: Path, adapters_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    adapters = tmp_path_factory.mktemp("errors") / "adapters"
    shutil.copytree(adapters_dir, adapters)
    with running_server(models_dir, adapters, **LIMITS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client(headers={"Authorization": f"Bearer {USER}"}) as c:
        yield c


def test_api_keys(server, client):
    with server.client() as anonymous:
        for path in ("/health", "/ready", "/metrics", "/"):
            assert anonymous.get(path).status_code == 200, path
        r = anonymous.get("/v1/models")
        error_of(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        for auth in ("Bearer wrong-key", f"Basic {USER}", "Bearer", f"Bearer {USER}x", "Bearer user-key"):
            r = anonymous.get("/v1/models", headers={"Authorization": auth})
            error_of(r, 401, "unauthorized")
            assert r.headers["www-authenticate"] == "Bearer"
        r = anonymous.post(f"/v1/models/{LM}/generate", json={"inputs": ["x"]}, headers={"Authorization": "Bearer no"})
        error_of(r, 401)
        for key in (USER, "user-key-2", ADMIN):
            assert anonymous.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert anonymous.put(f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}", headers=admin).status_code == 200
    error_of(client.put(f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}"), 403, "forbidden")
    error_of(client.delete(f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}"), 403, "forbidden")
    assert USER not in server.log() and ADMIN not in server.log()


def test_not_found_and_method_not_allowed(client):
    error_of(client.post("/v1/models/nope/generate", json={"inputs": ["x"]}), 404, "not_found")
    error_of(client.get("/v1/models/nope/adapters"), 404, "not_found")
    error_of(client.post(f"/v1/models/{LM}/generate", json={"inputs": ["x"], "adapter": "nope"}), 404, "not_found")
    error_of(client.post(f"/v1/models/{CLS}/classify", json={"inputs": ["x"], "adapter": "nope"}), 404)
    error_of(client.get("/v1/nothing-here"), 404, "not_found")
    error_of(client.get("/nothing-here"), 404, "not_found")
    r = client.get(f"/v1/models/{LM}/generate")
    error_of(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"


def test_body_limit_before_parsing(client):
    path = f"/v1/models/{LM}/generate"
    # Not JSON at all: a parser would say 422; the limit answers first, from Content-Length.
    error_of(
        client.post(path, content=b"x" * 5000, headers={"Content-Type": "application/json"}), 413, "payload_too_large"
    )

    def chunks():  # no Content-Length: counted while reading
        yield b'{"inputs": ["'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"]}'

    error_of(client.post(path, content=chunks(), headers={"Content-Type": "application/json"}), 413)
    # Uploads have their own, larger limit.
    r = client.put(
        f"/v1/models/{LM}/adapters/big",
        content=b"\x1f\x8b" + b"\0" * 70000,
        headers={"Content-Type": "application/gzip", "Authorization": f"Bearer {ADMIN}"},
    )
    error_of(r, 413)


LONG = "word " * 400


@pytest.mark.parametrize(
    ("path", "body", "field", "says"),
    [
        (f"{LM}/generate", {"inputs": ["x"], "max_new_tokens": 17}, "max_new_tokens", "16"),
        (f"{MT}/generate", {"inputs": ["x"], "strategy": "beam", "num_beams": 4}, "num_beams", "max_beams=3"),
        (f"{LM}/generate", {"inputs": ["x"] * 5}, "inputs", "max_inputs=4"),
        (f"{LM}/generate", {"inputs": ["x", LONG]}, "inputs[1]", "max_input_tokens"),
        (f"{MT}/generate", {"inputs": [LONG]}, "inputs[0]", "max_input_tokens"),
        (f"{LM}/generate", {"inputs": []}, "inputs", "at least 1 item"),
        (f"{LM}/generate", {"inputs": ["ok", ""]}, "inputs[1]", "at least 1 character"),
        (f"{LM}/generate", {}, "inputs", "required"),
        (f"{LM}/generate", {"inputs": "x"}, "inputs", "list"),
        (f"{LM}/generate", {"inputs": ["x"], "strategy": "magic"}, "strategy", "greedy"),
        (f"{LM}/generate", {"inputs": ["x"], "temprature": 0.5}, "temprature", "Extra inputs"),
        (f"{LM}/generate", {"inputs": ["x"], "min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens", "4"),
        (f"{LM}/generate", {"inputs": ["x"], "num_return_sequences": 2}, "num_return_sequences", "greedy"),
        (f"{LM}/generate", {"inputs": ["x", "y"], "stream": True}, "inputs", "one input"),
        (f"{LM}/generate", {"inputs": ["x"], "adapter": "../etc"}, "adapter", "pattern"),
        (f"{LM}/generate", {"inputs": ["x"], "seed": -1}, "seed", "greater than or equal"),
        (f"{LM}/generate", {"inputs": ["x"], "strategy": "sample", "temperature": 1e-300}, "temperature", "0.0001"),
        (f"{CLS}/generate", {"inputs": ["x"]}, None, "classifier"),
        (f"{CLS}/classify", {"inputs": [["a", ""]]}, "inputs[0][1]", "at least 1 character"),
        (f"{CLS}/classify", {"inputs": [["a", "b", "c"]]}, "inputs[0]", "at most 2"),
        (f"{CLS}/classify", {"inputs": ["x"], "top_k": 0}, "top_k", "greater than or equal"),
        (f"{CLS}/embed", {"inputs": ["x"], "pooling": "sum"}, "pooling", "'cls', 'mean' or 'max'"),
        (f"{LM}/embed", {"inputs": ["x"]}, None, "causal_lm"),
        (f"{MT}/attention", {"input": ""}, "input", "at least 1 character"),
        (f"{LM}/attention", {"input": LONG}, "inputs[0]", "max_input_tokens"),
    ],
)
def test_invalid_requests_name_the_field_and_limit(client, path, body, field, says):
    error = error_of(client.post(f"/v1/models/{path}", json=body), 422, "invalid_request")
    assert error["field"] == field and says in error["message"], error
    if field:
        assert field in error["message"]


@pytest.mark.parametrize(
    ("raw", "status", "field"),
    [
        (b'{"inputs": ["x"], "top_p": NaN}', 422, "top_p"),
        (b'{"inputs": ["x"], "temperature": Infinity}', 422, "temperature"),
        (b'{"inputs": ["x"], "length_penalty": -Infinity}', 422, "length_penalty"),
        (b'{"inputs": ["\xff\xfe"]}', 400, None),  # not UTF-8
        (b'{"inputs": ["\xed\xa0\x80"]}', 422, "inputs[0]"),  # UTF-8-encoded lone surrogate
        (b'{"inputs": ["\\ud800"]}', 422, "inputs[0]"),  # escaped lone surrogate
        (b'{"inputs": ["x"]', 422, "body"),  # truncated JSON
        (b"[1, 2]", 422, "body"),
        (b"", 422, "body"),
    ],
)
def test_malformed_bodies(client, raw, status, field):
    r = client.post(f"/v1/models/{LM}/generate", content=raw, headers={"Content-Type": "application/json"})
    error = error_of(r, status)
    assert error["field"] == field


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for info, content in members:
            info.size = len(content) if info.isfile() else 0
            t.addfile(info, io.BytesIO(content) if info.isfile() else None)
    return buf.getvalue()


def _file(name: str, content: bytes = b"{}") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), content


def _special(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, b""


def _zip(members: list[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, content, mode in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            z.writestr(info, content)
    return buf.getvalue()


GOOD = [_file("adapter_config.json"), _file("adapter_model.safetensors", b"\0" * 8)]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (_tar([*GOOD, _file("/etc/passwd")]), "absolute path"),
        (_tar([*GOOD, _file("../adapter_config.json")]), "leaves the archive"),
        (_tar([*GOOD, _file("sub/../../x")]), "leaves the archive"),
        (_tar([GOOD[0], _special("adapter_model.safetensors", tarfile.SYMTYPE, "/etc/passwd")]), "not a regular"),
        (
            _tar([GOOD[0], _special("adapter_model.safetensors", tarfile.LNKTYPE, "adapter_config.json")]),
            "not a regular",
        ),
        (_tar([GOOD[0], _special("adapter_model.safetensors", tarfile.CHRTYPE)]), "not a regular"),
        (_tar([GOOD[0], _special("adapter_model.safetensors", tarfile.FIFOTYPE)]), "not a regular"),
        (_tar([*GOOD, _file("adapter_model.bin", b"pickle")]), "unexpected member"),
        (_tar([*GOOD, _file("adapter_config.json")]), "twice"),
        (_tar([GOOD[0]]), "missing adapter_model.safetensors"),
        (_tar([GOOD[0], _file("adapter_model.safetensors", b"\0" * 5000)]), "over the limit"),
        (_tar([_special("./", tarfile.DIRTYPE), *[(tarfile.TarInfo("./" + i.name), c) for i, c in GOOD]]), None),
        (_zip([("adapter_config.json", b"{}", 0o100644), ("adapter_model.safetensors", b"\0", 0o100644)]), None),
        (
            _zip([("adapter_config.json", b"{}", 0), ("adapter_model.safetensors", b"/etc/passwd", 0o120777)]),
            "not a regular",
        ),
        (_zip([("adapter_config.json", b"{}", 0), ("../adapter_model.safetensors", b"\0", 0)]), "leaves"),
        (_zip([("adapter_config.json", b"{}", 0), ("C:/adapter_model.safetensors", b"\0", 0)]), "absolute"),
        (b"\x1f\x8b not really gzip", "cannot be read"),
        (b"plain bytes", "neither"),
    ],
)
def test_archive_rules(data, says):
    if says is None:
        assert set(read_adapter_archive(data, limit=4096)) == {"adapter_config.json", "adapter_model.safetensors"}
        return
    with pytest.raises(ArchiveError, match=says):
        read_adapter_archive(data, limit=4096)


def test_bad_uploads_change_nothing(client, server):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    path = f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}"
    before = client.post(f"/v1/models/{LM}/generate", json={"inputs": ["hello"], "adapter": ADAPTERS[LM]}).json()
    evil = _tar([*GOOD, _file("../../escape.txt")])
    error = error_of(client.put(path, content=evil, headers={**admin, "Content-Type": "application/gzip"}), 422)
    assert error["field"] == "body" and "leaves the archive" in error["message"]
    broken = _tar([_file("adapter_config.json", b'{"r": 4}'), _file("adapter_model.safetensors", b"junk")])
    error_of(client.put(path, content=broken, headers={**admin, "Content-Type": "application/gzip"}), 422)
    error_of(client.put(path, content=broken, headers={**admin, "Content-Type": "text/plain"}), 415)
    error_of(client.put(f"/v1/models/{LM}/adapters/not-on-disk", headers=admin), 404)
    error_of(client.put(f"/v1/models/{LM}/adapters/.hidden", headers=admin), 422)
    after = client.post(f"/v1/models/{LM}/generate", json={"inputs": ["hello"], "adapter": ADAPTERS[LM]}).json()
    assert after == before  # the failed replacement left the adapter (and its files) as they were


def test_not_ready_is_503(models_dir):
    """Before the lifespan has started the engine (in-process, no lifespan run): 503, liveness still 200."""

    async def scenario() -> list[httpx.Response]:
        app = create_app(Settings(models=models_dir))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [
                await c.get("/health"),
                await c.get("/ready"),
                await c.post(f"/v1/models/{LM}/generate", json={"inputs": ["x"]}),
            ]

    health, ready, generate = asyncio.run(scenario())
    assert health.status_code == 200
    error_of(ready, 503, "not_ready")
    error_of(generate, 503, "not_ready")


def test_queue_full_429_and_timeout_504(models_dir):
    """With the worker held, a second request finds the queue (max_queue 1) full: 429 with Retry-After; the queued
    one, its deadline passed while it waited, is a 504. Decided by events (the worker held, the deadline moved to
    "now"), not by how fast this machine decodes."""
    body = {"inputs": ["hello"], "max_new_tokens": 4}
    with inprocess_server(models_dir, max_queue=1, max_batch_size=1) as server, server.client() as client:
        worker = server.engine.get(LM)
        release = block_worker(worker)
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client.post, f"/v1/models/{LM}/generate", json=body)
            assert wait_until_true(lambda: worker.scheduler.num_waiting == 1, timeout_s=60)
            full = client.post(f"/v1/models/{LM}/generate", json=body)
            (job,) = worker.scheduler.waiting_jobs()
            job.deadline = time.monotonic()  # expired while it waits
            release.set()
            timed_out = queued.result(timeout=60)
        error = error_of(full, 429, "queue_full")
        assert int(full.headers["retry-after"]) >= 1 and "max_queue=1" in error["message"]
        error_of(timed_out, 504, "timeout")
        assert client.get("/health").status_code == 200  # still serving
        metrics = client.get("/metrics").text
        assert 'status="429"' in metrics and 'status="504"' in metrics


def test_engine_failure_is_500_with_the_request_id(models_dir):
    """A fault inside one request's model call: that request gets a 500 naming it, its neighbours do not."""

    def fault(job_ids: list[str]) -> None:
        if any(i.startswith("boom") for i in job_ids):
            raise RuntimeError("injected fault")

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        app = create_app(Settings(models=models_dir, warmup=False))
        engine = app.state.engine
        await engine.start()
        engine.get(LM).scheduler.fault_hook = fault
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                path, body = f"/v1/models/{LM}/generate", {"inputs": ["hello"], "max_new_tokens": 4}
                failed = await c.post(path, json=body, headers={"X-Request-ID": "boom-1"})
                fine = await c.post(path, json=body)
        finally:
            await engine.stop(1.0)
        return failed, fine

    failed, fine = asyncio.run(scenario())
    error = error_of(failed, 500, "engine_failure")
    assert error["request_id"] == "boom-1"
    assert fine.status_code == 200
