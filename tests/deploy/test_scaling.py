"""Two real replicas sharing one adapter directory: deploy/sync_adapter.py swaps an adapter on both
(what `docker compose run --rm adapter-sync ...` does behind the name `api`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx

from tests.deploy.conftest import ROOT
from tests.service.conftest import MT, make_adapter
from tests.service.server import running_server

SYNC = ROOT / "deploy" / "sync_adapter.py"


def sync(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SYNC), *args], capture_output=True, text=True, timeout=120)


def resident(url: str, model: str) -> dict[str, float | None]:
    adapters = httpx.get(f"{url}/v1/models/{model}/adapters", timeout=10).json()["adapters"]
    return {a["name"]: a["loaded_at"] for a in adapters}


def test_sync_adapter_reaches_every_replica(models_dir: Path, adapters_dir: Path, tmp_path: Path):
    shared = tmp_path / "adapters"  # the volume every replica mounts
    shutil.copytree(adapters_dir, shared)
    with ExitStack() as stack:
        a, b = (stack.enter_context(running_server(models_dir, shared)) for _ in range(2))
        targets = f"{a.url[7:]},{b.url[7:]}"

        # A new version lands on the shared volume (as an upload through one replica would put it)...
        make_adapter(models_dir / MT, shared / MT / "mt-new", seed=7)
        proc = sync("--targets", targets, "load", MT, "mt-new")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "2 of 2 replicas" in proc.stdout
        # ... and every replica has it resident, reading the same files.
        for server in (a, b):
            assert resident(server.url, MT).get("mt-new") is not None
        out_a = httpx.post(f"{a.url}/v1/models/{MT}/generate", json={"inputs": ["hello world"], "adapter": "mt-new"},
                           timeout=30).json()
        out_b = httpx.post(f"{b.url}/v1/models/{MT}/generate", json={"inputs": ["hello world"], "adapter": "mt-new"},
                           timeout=30).json()
        assert out_a == out_b

        proc = sync("--targets", targets, "unload", MT, "mt-new")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for server in (a, b):
            assert "mt-new" not in resident(server.url, MT) or resident(server.url, MT)["mt-new"] is None
        # Unloading again is not an error (nothing to unload), a model nobody serves is.
        assert sync("--targets", targets, "unload", MT, "mt-new").returncode == 0
        assert sync("--targets", targets, "unload", "no-such-model", "mt-new").returncode == 1

        # Name resolution: every address of the name is a replica (here one, 127.0.0.1).
        port = a.url.rsplit(":", 1)[1]
        proc = sync("--host", "localhost", "--port", port, "load", MT, "mt-a")
        assert proc.returncode == 0 and "1 of 1 replicas" in proc.stdout, proc.stdout + proc.stderr
        assert sync("--targets", "127.0.0.1:9", "load", MT, "mt-a").returncode == 1  # unreachable replica
