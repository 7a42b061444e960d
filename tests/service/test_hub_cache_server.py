"""``--models`` names Hugging Face repo ids found in the local cache (service/model_sources.py): the rules, the errors
that stop start-up (exit 2, naming where it looked), and a real server serving repos beside a models directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from service.__main__ import main, parse_settings
from service.engine.engine import Engine
from service.engine.errors import InvalidRequest
from service.engine.types import EngineSettings
from service.model_sources import ModelSources, model_sources
from service.settings import SettingsError
from tests.hf_directories import gpt2_directory
from tests.model.test_hub_cache import COMMIT, OLD_COMMIT, hub_cache_layout
from tests.service.server import running_server

REPO = "openai-community/gpt2"
SNAPSHOTS = "models--openai-community--gpt2/snapshots"


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Path:
    """root/cache: REPO at COMMIT (refs main) and OLD_COMMIT, and org/broken (config.json not JSON); root/models/local:
    a plain copy of REPO's files; root/more and root/org/broken: other directories."""
    root = tmp_path_factory.mktemp("hub-server")
    source = gpt2_directory(root / "source")
    hub_cache_layout(root / "cache", REPO, source, COMMIT)
    hub_cache_layout(root / "cache", REPO, source, OLD_COMMIT, refs=())
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    hub_cache_layout(root / "cache", "org/broken", broken, COMMIT)
    shutil.copytree(source, root / "models" / "local")
    (root / "more").mkdir()
    (root / "org" / "broken").mkdir(parents=True)  # a directory spelled as a repo id
    return root


@pytest.fixture
def in_layout(layout, monkeypatch) -> Path:
    monkeypatch.chdir(layout)
    monkeypatch.setenv("HF_HUB_CACHE", str(layout / "cache"))
    return layout


@pytest.mark.parametrize(("value", "directory", "snapshots"), [
    ("models", "models", {}),
    ("missing", "missing", {}),  # the engine says "not found", as for any missing models directory
    ("org/broken", "org/broken", {}),  # an existing directory wins over a repo id of the same spelling
    (f"{REPO}@main", None, {"gpt2": f"{SNAPSHOTS}/{COMMIT}"}),
    (f"models, {REPO},old={REPO}@{OLD_COMMIT}", "models", {"gpt2": f"{SNAPSHOTS}/{COMMIT}",
                                                           "old": f"{SNAPSHOTS}/{OLD_COMMIT}"}),
])  # fmt: skip
def test_models_names_a_directory_and_repos_in_the_cache(in_layout, value, directory, snapshots):
    expected = ModelSources(Path(directory) if directory else None,
                            {name: in_layout / "cache" / path for name, path in snapshots.items()})
    assert model_sources(value) == expected


@pytest.mark.parametrize(("value", "says"), [
    ("org/missing", "org/missing is not in the Hugging Face cache: no directory {cache}/models--org--missing"),
    (f"{REPO}@v9", f"revision 'v9' of {REPO} is not in the Hugging Face cache: no {{cache}}/models--openai-community"
                   f"--gpt2/refs/v9"),
    (f"{REPO},org/gpt2", f"{REPO} and org/gpt2 would both be served as 'gpt2': name one with NAME=org/gpt2"),
    (f"bad name={REPO}", "the model name 'bad name' is invalid"),
    ("models,more", "'more' is neither a directory nor a repo id"),
    ("x=models", "'x=models' is neither a directory nor a repo id"),
])  # fmt: skip
def test_what_cannot_be_served_stops_start_up_naming_why(in_layout, capsys, value, says):
    says = says.format(cache=in_layout / "cache")
    with pytest.raises(SettingsError, match="^models \\(TSERVE_MODELS\\): ") as caught:
        parse_settings(["--models", value], {})
    assert says in str(caught.value)
    assert main(["--models", value]) == 2  # python -m service exits 2, the message on stderr
    assert says in capsys.readouterr().err


def test_a_server_serves_repos_from_the_cache_beside_a_models_directory(layout):
    models = f"{layout / 'models'},{REPO},old={REPO}@{OLD_COMMIT},org/broken"
    # PyTorch ops, not the C++ kernels: what is checked here is where the models come from, and a first generate
    # would otherwise wait for the kernels' build whenever their sources changed
    env = {"HF_HUB_CACHE": str(layout / "cache"), "TSERVE_WARMUP": "false", "TSERVE_DECODE_KERNELS": "off"}
    with running_server(models, None, **env) as server, server.client() as client:
        listing = client.get("/v1/models").json()
        assert [m["name"] for m in listing["data"]] == ["gpt2", "local", "old"]
        assert {m["format"] for m in listing["data"]} == {"hf"}
        [failed] = listing["failed"]
        assert failed["name"] == "broken" and failed["error"].startswith("CheckpointError: broken/config.json: ")
        assert str(layout) not in str(listing)  # the cache's paths stay on the server
        body = {"inputs": ["def add(", "the quick"], "max_new_tokens": 6, "strategy": "greedy"}
        outputs = {name: client.post(f"/v1/models/{name}/generate", json=body) for name in ("gpt2", "old", "local")}
        assert {r.status_code for r in outputs.values()} == {200}, outputs["gpt2"].text
        tokens = {name: [o["tokens"] for o in r.json()["outputs"]] for name, r in outputs.items()}
        assert tokens["gpt2"] == tokens["old"] == tokens["local"] and all(tokens["gpt2"])


def test_without_a_models_directory_run_time_loads_are_refused_by_name(in_layout):
    sources = model_sources(REPO)
    engine = Engine(EngineSettings(device="cpu"), sources.directory, None, sources.snapshots)
    with pytest.raises(InvalidRequest, match="no models directory is configured"):
        engine.model_directory("local")
