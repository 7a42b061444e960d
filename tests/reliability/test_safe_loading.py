"""Safe loading: adapters and checkpoints are read only from the configured directories and only as
safetensors + JSON; a pickle, a truncated file, wrong dtypes or shapes, NaN weights or a symlink out of
the directory are each refused with an error naming the problem, and what was serving keeps serving
with the same results. (Uploads' archive rules and size limits: tests/service/test_errors.py.)
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import WEIGHTS_FILE as MODEL_WEIGHTS
from model.lora_io import CONFIG_FILE, PICKLE_FILE, WEIGHTS_FILE
from tests.helpers import error_of
from tests.reliability.helpers import inprocess_server
from tests.service.conftest import ADAPTERS, CLS, LM, MT
from tests.service.server import running_server


class _Trap:
    """Unpickling this creates the file it names: proof that nobody unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _rewrite(path: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    save_file(change(load_file(str(path))), str(path))


def _first(tensors: dict[str, torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    key = sorted(tensors)[0]
    return {**tensors, key: fn(tensors[key])}


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _huge_header(path: Path) -> None:
    path.write_bytes((2**60).to_bytes(8, "little") + b"{}")  # claims an exabyte header


# kind -> (how to break a copy of a good directory's weights file, what the error says)
BREAKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (_truncate, "safetensors"),
    "huge-header": (_huge_header, "safetensors"),
    "int-dtype": (lambda p: _rewrite(p, lambda t: _first(t, lambda x: x.to(torch.int32))), "dtype"),
    "wrong-shape": (
        lambda p: _rewrite(p, lambda t: _first(t, lambda x: torch.zeros(x.shape[0] + 1, *x.shape[1:]))),
        "shape",
    ),
    "nan": (lambda p: _rewrite(p, lambda t: _first(t, lambda x: torch.full_like(x, float("nan")))), "NaN|non-finite"),
}


def _pickle_only(directory: Path, weights: str, pickle_name: str, marker: Path) -> None:
    (directory / weights).unlink()
    (directory / pickle_name).write_bytes(pickle.dumps({"weights": _Trap(marker)}))


# ---- adapters ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_server(models_dir: Path, adapters_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("safe")
    adapters = root / "adapters"
    shutil.copytree(adapters_dir, adapters)
    good = adapters_dir / LM / ADAPTERS[LM]
    broken = root / "broken"  # built here, copied into the adapters directory by each test
    for kind, (breaks, _) in BREAKS.items():
        shutil.copytree(good, broken / kind)
        breaks(broken / kind / WEIGHTS_FILE)
    shutil.copytree(good, broken / "pickle")
    _pickle_only(broken / "pickle", WEIGHTS_FILE, PICKLE_FILE, root / "unpickled")
    outside = root / "outside"
    shutil.copytree(good, outside)
    (adapters / LM / "link-out").symlink_to(outside, target_is_directory=True)
    (adapters / LM / "file-link-out").mkdir()
    shutil.copy(good / CONFIG_FILE, adapters / LM / "file-link-out" / CONFIG_FILE)
    (adapters / LM / "file-link-out" / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
    with running_server(models_dir, adapters, TSERVE_WARMUP="false") as s:
        yield s, adapters, broken, root / "unpickled"


def _outputs(client, adapter: str | None) -> list:
    r = client.post(
        f"/v1/models/{LM}/generate", json={"inputs": ["hello", "the cat"], "max_new_tokens": 8, "adapter": adapter}
    )
    assert r.status_code == 200, r.text
    return r.json()["outputs"]


def _archive(directory: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(directory.iterdir()):
            tar.add(path, arcname=path.name)
    return buf.getvalue()


@pytest.mark.parametrize("kind", [*BREAKS, "pickle"])
def test_broken_adapter_directory_is_refused(adapter_server, kind):
    server, adapters, broken, unpickled = adapter_server
    shutil.copytree(broken / kind, adapters / LM / kind)
    with server.client() as c:
        before = {a: _outputs(c, a) for a in (None, ADAPTERS[LM])}
        error = error_of(c.put(f"/v1/models/{LM}/adapters/{kind}"), 422, "invalid_request")
        says = "pickle" if kind == "pickle" else BREAKS[kind][1]
        assert any(word in error["message"] for word in says.split("|")), error
        assert kind in error["message"]  # names the adapter (and file)
        assert not unpickled.exists()
        assert kind not in {a["name"] for a in c.get(f"/v1/models/{LM}/adapters").json()["adapters"]}
        assert {a: _outputs(c, a) for a in (None, ADAPTERS[LM])} == before  # the model serves as it did


@pytest.mark.parametrize("kind", list(BREAKS))
def test_broken_upload_leaves_the_adapter_it_would_replace(adapter_server, kind):
    server, _, broken, _ = adapter_server
    with server.client() as c:
        before = _outputs(c, ADAPTERS[LM])
        r = c.put(
            f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}",
            content=_archive(broken / kind),
            headers={"Content-Type": "application/gzip"},
        )
        says = BREAKS[kind][1]
        assert any(word in error_of(r, 422)["message"] for word in says.split("|"))
        assert _outputs(c, ADAPTERS[LM]) == before


@pytest.mark.parametrize(
    ("name", "says"),
    [("link-out", "outside the adapters directory"), ("file-link-out", "links outside the adapters directory")],
)
def test_symlinks_out_of_the_adapters_directory_are_refused(adapter_server, name, says):
    server, _, _, _ = adapter_server
    with server.client() as c:
        assert name not in {a["name"] for a in c.get(f"/v1/models/{LM}/adapters").json()["adapters"]}
        before = _outputs(c, ADAPTERS[LM])
        assert says in error_of(c.put(f"/v1/models/{LM}/adapters/{name}"), 422)["message"]
        error_of(c.post(f"/v1/models/{LM}/generate", json={"inputs": ["x"], "adapter": name}), 404)
        assert _outputs(c, ADAPTERS[LM]) == before
    assert "outside the adapters directory" in server.log()  # skipped at start-up, and said so


# ---- checkpoints -------------------------------------------------------------------------------------


def test_broken_checkpoints_are_refused_and_the_others_serve(models_dir, tmp_path):
    root = tmp_path / "models"
    for name in (LM, MT, CLS):
        shutil.copytree(models_dir / name, root / name)
    for kind, (breaks, _) in BREAKS.items():
        shutil.copytree(models_dir / LM, root / kind)
        breaks(root / kind / MODEL_WEIGHTS)
    shutil.copytree(models_dir / LM, root / "pickle")
    _pickle_only(root / "pickle", MODEL_WEIGHTS, "pytorch_model.bin", tmp_path / "unpickled")
    shutil.copytree(models_dir / LM, root / "no-tokenizer")
    os.unlink(root / "no-tokenizer" / "tokenizer.json")

    with inprocess_server(root) as s, s.client() as c:
        errors = s.engine.load_errors
        assert set(errors) == {*BREAKS, "pickle", "no-tokenizer"}, errors
        for kind, (_, says) in BREAKS.items():
            assert kind in errors[kind] and any(w in errors[kind] for w in says.split("|")), errors[kind]
        assert "model.safetensors" in errors["pickle"] and "not found" in errors["pickle"]
        assert "tokenizer.json" in errors["no-tokenizer"]
        assert not (tmp_path / "unpickled").exists()
        assert c.get("/ready").json()["models"] == [CLS, LM, MT]
        r = c.post(f"/v1/models/{LM}/generate", json={"inputs": ["hello"], "max_new_tokens": 4})
        assert r.status_code == 200
        error_of(c.post("/v1/models/nan/generate", json={"inputs": ["hello"]}), 404, "not_found")
