"""model/hf/hub_cache.py: repo ids resolved in a Hugging Face cache laid out here as huggingface_hub lays it out
(refs/, snapshots/<hash>/ of links into blobs/), checked against huggingface_hub's own reading of the same cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from model.checkpoint import CheckpointError, load_checkpoint
from model.files import UnreadableFile, read_regular
from model.hf.hub_cache import HubCacheError, RepoRef, hub_cache_dir, parse_repo_ref, snapshot_directory
from tests.hf_directories import gpt2_directory

huggingface_hub = pytest.importorskip("huggingface_hub")

REPO = "openai-community/gpt2"
COMMIT, OLD_COMMIT = "a" * 40, "b" * 40


def hub_cache_layout(cache: Path, repo_id: str, source: Path, commit: str, refs: Sequence[str] = ("main",)) -> Path:
    """``source``'s files cached as huggingface_hub caches repo ``repo_id`` at ``commit``: blobs/<sha256>, links to
    them under snapshots/<commit>/, and a refs/<ref> file holding ``commit`` for each of ``refs``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """REPO at COMMIT (refs main and v1) and at OLD_COMMIT (no ref: reachable by its hash only)."""
    root = tmp_path_factory.mktemp("hub")
    source = gpt2_directory(root / "source")
    hub_cache_layout(root / "cache", REPO, source, COMMIT, refs=("main", "v1"))
    hub_cache_layout(root / "cache", REPO, source, OLD_COMMIT, refs=())
    return root / "cache"


@pytest.mark.parametrize(("text", "expected"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", RepoRef("HuggingFaceTB/SmolLM2-135M-Instruct")),
    ("Qwen/Qwen2.5-0.5B@v1.0", RepoRef("Qwen/Qwen2.5-0.5B", "v1.0")),
    (f"org/name@{COMMIT}", RepoRef("org/name", COMMIT)),
    ("org/name@refs/pr/1", RepoRef("org/name", "refs/pr/1")),
    ("gpt2", None),  # no organisation: read as a directory name
    ("./org/name", None), ("/abs/name", None), ("org/name/", None), ("a/b/c", None), ("org--x/name", None),
    ("org/na..me", None), ("org/-name", None), ("org/name.git", None), ("org/name@", None), ("org/name@../x", None),
    ("org/name@main/../../x", None), ("org/" + "n" * 93, None), ("org/naïve", None),
])  # fmt: skip
def test_repo_ids_are_spelled_as_huggingface_hub_spells_them(text, expected):
    assert parse_repo_ref(text) == expected
    if expected is not None:
        assert str(expected) == text.removesuffix("@main")
        huggingface_hub.utils.validate_repo_id(expected.repo_id)  # the Hub's own rule agrees


@pytest.mark.parametrize("env", [
    {"HF_HUB_CACHE": "/x/hub-cache", "HF_HOME": "/x/home"},
    {"HUGGINGFACE_HUB_CACHE": "/x/legacy", "HF_HOME": "/x/home"},
    {"HF_HOME": "/x/home", "XDG_CACHE_HOME": "/x/xdg"},
    {"XDG_CACHE_HOME": "/x/xdg"},
    {"HOME": "/x/user"},
])  # fmt: skip
def test_the_cache_directory_is_the_one_huggingface_hub_uses(env, monkeypatch):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "XDG_"))}
    environ = {**base, **env}
    theirs = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"],
                            env=environ, capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setenv("HOME", environ["HOME"])  # expanduser reads HOME from the process environment
    assert str(hub_cache_dir(environ)) == theirs


@pytest.mark.parametrize(("revision", "commit"), [("main", COMMIT), ("v1", COMMIT), (OLD_COMMIT, OLD_COMMIT)])
def test_a_revision_resolves_to_the_snapshot_huggingface_hub_reads(cache, revision, commit):
    snapshot = snapshot_directory(RepoRef(REPO, revision), cache)
    assert snapshot == cache / "models--openai-community--gpt2" / "snapshots" / commit
    theirs = huggingface_hub.try_to_load_from_cache(REPO, "config.json", cache_dir=cache, revision=revision)
    assert Path(theirs).parent == snapshot
    (info,) = huggingface_hub.scan_cache_dir(cache).repos  # the layout built here is one the Hub library reads
    assert info.repo_id == REPO and {r.commit_hash for r in info.revisions} == {COMMIT, OLD_COMMIT}


def test_a_snapshot_of_links_into_blobs_loads_as_its_directory(cache, tmp_path):
    snapshot = snapshot_directory(RepoRef(REPO), cache)
    assert (snapshot / "model.safetensors").is_symlink()
    source = gpt2_directory(tmp_path / "source")
    cached, plain = load_checkpoint(snapshot, "cpu"), load_checkpoint(source, "cpu")
    assert cached.format == "hf" and cached.tokenizer.encode("def add(") == plain.tokenizer.encode("def add(")
    for (name, a), (_, b) in zip(cached.model.state_dict().items(), plain.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_link_in_the_cache_to_a_fifo_is_refused_without_blocking(tmp_path):
    blob = tmp_path / "blobs" / "fifo"
    blob.parent.mkdir()
    os.mkfifo(blob)
    snapshot = tmp_path / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
    with pytest.raises(UnreadableFile, match="FIFO"):
        read_regular(snapshot / "config.json", 1 << 20)
    with pytest.raises(CheckpointError, match="a FIFO, not a regular file"):
        load_checkpoint(snapshot, "cpu")


@pytest.mark.parametrize(("ref", "says"), [
    (RepoRef("HuggingFaceTB/SmolLM2-135M"), "no directory {cache}/models--HuggingFaceTB--SmolLM2-135M (nothing is "
                                            "downloaded"),
    (RepoRef(REPO, "v2"), f"no {{cache}}/models--openai-community--gpt2/refs/v2 nor {{cache}}/models--openai-community"
                          f"--gpt2/snapshots/v2 (snapshots there: {COMMIT}, {OLD_COMMIT})"),
])  # fmt: skip
def test_what_is_not_in_the_cache_is_an_error_naming_where_it_looked(cache, ref, says):
    with pytest.raises(HubCacheError) as caught:
        snapshot_directory(ref, cache)
    assert says.format(cache=cache) in str(caught.value)
