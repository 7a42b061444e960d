"""Start-up with models that fail to load (issue 16): nothing loaded is a failed start, some is a partial one.

``python -m service`` runs in a subprocess. With no model to serve (every directory broken, none at all, or
no models directory) it exits 3, uvicorn's start-up failure status, and its log names each model and why;
with some loaded it reports ready, serves them and lists the others under ``failed`` in ``GET /v1/models``.
Outcomes are events: the process's exit, HTTP answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import LM, MT
from tests.service.server import ROOT, free_port, running_server

EXIT_BOUND_S = 120.0  # failure bound: a server that starts instead of exiting fails here


def broken_copy(source: Path, target: Path) -> Path:
    """A copy of checkpoint ``source`` whose config.json is not JSON."""
    shutil.copytree(source, target)
    (target / "config.json").write_text("{not json")
    return target


def garbage(target: Path) -> Path:
    """A directory of files that are no checkpoint."""
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(os.urandom(64))
    (target / "notes.txt").write_text("not a model")
    return target


def start_up(models: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -m service`` on ``models`` until it exits."""
    args = [sys.executable, "-m", "service", "--models", str(models), "--host", "127.0.0.1", "--port", str(free_port())]
    env = {**os.environ, "TSERVE_THREADS": "1", "TSERVE_LOG_LEVEL": "info"}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=EXIT_BOUND_S)


def test_no_model_loaded_exits_3_naming_each_model_and_its_reason(models_dir, tmp_path):
    root = tmp_path / "models"
    broken_copy(models_dir / LM, root / "broken")
    garbage(root / "garbage")
    done = start_up(root)
    assert done.returncode == 3, done.stderr[-4000:]
    log = done.stdout + done.stderr
    assert "Application startup failed" in log and "NoModelsLoaded" in log
    assert "broken: CheckpointError: broken/config.json: invalid JSON" in log, log[-4000:]
    assert "garbage: CheckpointError: garbage/config.json: file not found" in log, log[-4000:]
    assert "Uvicorn running" not in log  # never listened, so never reported ready


@pytest.mark.parametrize(("layout", "says"), [("empty", "holds no model directories"), ("missing", "not found")])
def test_no_model_directory_exits_3(tmp_path, layout, says):
    root = tmp_path / "models"
    if layout == "empty":
        root.mkdir()
        (root / "README").write_text("a file, not a model directory")
    done = start_up(root)
    assert done.returncode == 3, done.stderr[-4000:]
    assert f"models directory {root} {says}" in done.stderr, done.stderr[-4000:]


def test_some_loaded_serve_and_the_failed_ones_are_listed_with_why(models_dir, tmp_path):
    root = tmp_path / "models"
    (root / LM).parent.mkdir()
    (root / LM).symlink_to(models_dir / LM, target_is_directory=True)
    broken_copy(models_dir / MT, root / "broken")
    with running_server(root, None, TSERVE_WARMUP="false") as server, server.client() as c:
        assert c.get("/ready").json() == {"status": "ready", "models": [LM]}
        r = c.get("/v1/models")
        assert r.status_code == 200
        listing = r.json()
        assert [m["name"] for m in listing["data"]] == [LM]
        [failed] = listing["failed"]
        assert failed["name"] == "broken"
        assert failed["error"].startswith("CheckpointError: broken/config.json: invalid JSON"), failed
        assert str(tmp_path) not in r.text and str(models_dir) not in r.text  # no server path
        out = c.post(f"/v1/models/{LM}/generate", json={"inputs": ["hello"], "max_new_tokens": 4})
        assert out.status_code == 200 and out.json()["outputs"][0]["tokens"], out.text
        assert c.post("/v1/models/broken/generate", json={"inputs": ["hello"]}).status_code == 404
        schema = c.get("/openapi.json").json()["components"]["schemas"]
        assert schema["ModelList"]["properties"]["failed"]["items"] == {"$ref": "#/components/schemas/ModelLoadFailure"}
        assert set(schema["ModelLoadFailure"]["required"]) == {"name", "error"}
