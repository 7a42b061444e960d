"""API keys: every /v1 operation of the OpenAPI schema needs a valid key (401 otherwise), model and adapter
load/unload/reload need an admin key (403 with a user key), keys are compared in constant time, and no
key (valid or not) ever reaches the server's log, even at debug level.
"""

from __future__ import annotations

import contextlib
import hmac
import re
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi import HTTPException

from service.api import auth
from service.settings import Settings
from tests.helpers import error_of
from tests.service.conftest import ADAPTERS, LM
from tests.service.fixtures import lm_chat_template
from tests.service.server import running_server

USER, USER2, ADMIN = "rel-user-key-0123456789", "rel-user-key-second", "rel-admin-key-abcdef"
WRONG = ["rel-user-key-012345678", "rel-user-key-0123456789x", "REL-USER-KEY-0123456789", "rel-admin-key-abcdeg"]
ADMIN_OPERATIONS = {("PUT", "/v1/models/{model}/adapters/{name}"), ("DELETE", "/v1/models/{model}/adapters/{name}"),
                    ("PUT", "/v1/models/{name}"), ("DELETE", "/v1/models/{name}")}
OPEN_PATHS = {"/health", "/ready", "/metrics"}
BODIES = {  # a valid body per operation that has one
    "/v1/models/{model}/generate": {"inputs": ["hello"], "max_new_tokens": 2},
    "/v1/models/{model}/classify": {"inputs": ["hello"]},
    "/v1/models/{model}/embed": {"inputs": ["hello"]},
    "/v1/models/{model}/entities": {"inputs": ["hello"]},
    "/v1/models/{model}/attention": {"input": "hello"},
    "/v1/completions": {"model": LM, "prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"model": LM, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
    "/v1/embeddings": {"model": "tiny-cls", "input": "hello"},
    "/v1/tokenize": {"model": LM, "prompt": "hello"},
    "/v1/detokenize": {"model": LM, "tokens": [1]},
    "/v1/rerank": {"model": "tiny-cls", "query": "hello", "documents": ["hello", {"text": "world"}]},
    "/v1/score": {"model": "tiny-cls", "text_1": "hello", "text_2": ["hello", "world"]},
}
MODEL_FOR = {"classify": "tiny-cls", "embed": "tiny-cls", "entities": "tiny-cls"}
# Operations no fixture model serves (tiny-cls has no token head): past the key, the model's own 422 says so.
NOT_SERVED = {("POST", "/v1/models/{model}/entities"): "no token classification head"}


@pytest.fixture(scope="module")
def server(models_dir: Path, adapters_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    adapters = tmp_path_factory.mktemp("auth") / "adapters"
    shutil.copytree(adapters_dir, adapters)
    env = dict(TSERVE_API_KEYS=f"{USER},{USER2}", TSERVE_ADMIN_KEYS=ADMIN, TSERVE_LOG_LEVEL="debug",
               TSERVE_WARMUP="false", TSERVE_CHAT_TEMPLATE=lm_chat_template(adapters.parent))  # fmt: skip
    with running_server(models_dir, adapters, **env) as s:
        yield s


def operations(server) -> list[tuple[str, str]]:
    spec = httpx.get(server.url + "/openapi.json").json()
    return [(method.upper(), path) for path, methods in spec["paths"].items() for method in methods]


def call(client: httpx.Client, method: str, path: str, key: str | None, scheme: str = "Bearer") -> httpx.Response:
    model = next((m for op, m in MODEL_FOR.items() if path.endswith(op)), LM)
    url = path.replace("{model}", model).replace("{name}", ADAPTERS[LM])
    headers = {"Authorization": f"{scheme} {key}".strip()} if key is not None else {}
    return client.request(method, url, json=BODIES.get(path), headers=headers)


def test_every_v1_operation_needs_a_key(server):
    ops = operations(server)
    assert {p for _, p in ops if not p.startswith("/v1/")} == OPEN_PATHS
    with server.client() as c:
        for method, path in ops:
            if not path.startswith("/v1/"):
                assert call(c, method, path, None).status_code == 200, path
                continue
            for key, scheme in [(None, "Bearer"), ("", "Bearer"), (USER, "Basic"), (USER, "Token"), *[
                    (w, "Bearer") for w in WRONG]]:  # fmt: skip
                r = call(c, method, path, key, scheme)
                error_of(r, 401, "unauthorized")
                assert r.headers["www-authenticate"] == "Bearer", (method, path)
            user = call(c, method, path, USER2)
            if (method, path) in ADMIN_OPERATIONS:
                assert "admin key" in error_of(user, 403, "forbidden")["message"]
            elif (method, path) in NOT_SERVED:
                assert NOT_SERVED[method, path] in error_of(user, 422, "invalid_request")["message"]
            else:
                assert user.status_code == 200, (method, path, user.text)
        # Admin: unload, then reload (load again from the adapter directory), then reload once more.
        name = f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}"
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert c.delete(name, headers=admin).status_code == 204
        assert c.put(name, headers=admin).status_code == 200
        assert c.put(name, headers=admin).status_code == 200
        assert c.get("/v1/models", headers=admin).status_code == 200  # an admin key is also a user key
        for path, body in (("/tokenize", BODIES["/v1/tokenize"]), ("/detokenize", BODIES["/v1/detokenize"]),
                           ("/rerank", BODIES["/v1/rerank"]), ("/v2/rerank", BODIES["/v1/rerank"]),
                           ("/score", BODIES["/v1/score"])):
            error_of(c.post(path, json=body), 401, "unauthorized")  # vLLM's root paths: the /v1 routes' key
            assert c.post(path, json=body, headers={"Authorization": f"Bearer {USER}"}).status_code == 200


def test_no_key_is_ever_logged(server):
    with server.client() as c:
        for key in (USER, USER2, ADMIN, *WRONG):
            headers = {"Authorization": f"Bearer {key}"}
            c.post(f"/v1/models/{LM}/generate", json={"inputs": ["hi"], "max_new_tokens": 2}, headers=headers)
            c.post(f"/v1/models/{LM}/generate", json={"inputs": [""]}, headers=headers)  # 422
            c.post("/v1/models/nope/generate", json={"inputs": ["x"]}, headers=headers)  # 404
            c.put(f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}", headers=headers)  # 200, 403 or 401
            with c.stream(
                "POST",
                f"/v1/models/{LM}/generate",
                headers=headers,
                json={"inputs": ["hi"], "max_new_tokens": 2, "stream": True},
            ) as r:
                r.read()
            c.get(f"/v1/models?api_key={key}")  # a key misplaced in the URL: the access log must not show it
    log = server.log()
    assert "DEBUG" in log and "POST /v1/models" in log  # debug logging and the access log were on
    for key in (USER, USER2, ADMIN, *WRONG):
        assert key not in log, key
    assert not re.search(r"Bearer \S", log)


def test_keys_are_compared_in_constant_time(monkeypatch):
    """Every configured key is compared (hmac.compare_digest) on every request, whichever matches."""
    compared: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    settings = Settings(api_keys=("u1", "u2-longer", "u3"), admin_keys=("a1", "a2"))
    for given in ("u1", "u3", "a2", "nope", "u1" * 100):
        compared.clear()
        credentials = auth.HTTPAuthorizationCredentials(scheme="Bearer", credentials=given)
        with contextlib.suppress(HTTPException):  # 401 for the wrong ones
            auth._role(credentials, settings)
        assert len(compared) == 5, given  # 3 user keys + 2 admin keys, no early exit
        assert {b for _, b in compared} == {b"u1", b"u2-longer", b"u3", b"a1", b"a2"}
