"""Hostile model directories, round two (issue 33, items 8-10): an operator's directory that is wrong fails its own
load with the reason, at once and in bounded memory, and never takes the server or its other models down.

8. Marian's sinusoidal table was sized from ``max_position_embeddings`` alone (4,000,000 loaded in 2.6 s with a
   2.2 GB peak; 10^9 tried to allocate 8 GB): refused above model.layers.MAX_POSITIONS, by name.
9. A FIFO as tokenizer.json or 1_Pooling/config.json hung start-up forever: every file of a model directory is
   opened non-blocking and read only when fstat says it is a regular file of bounded size
   (model.files.read_regular); a load that hangs anyway fails at its deadline (service.engine.engine), its thread left
   behind as a daemon, so the other models serve and SIGTERM still ends the server.
10. tokenizer.json's ``"decoder": null`` (token strings are then the pieces, as transformers'
   convert_ids_to_tokens gives them); WordPiece's ``max_input_chars_per_word`` and a vocabulary piece's length
   are bounded (model.tokenizer.MAX_WORD_CHARS, MAX_PIECE_BYTES), so ``max_token_bytes`` bounds the encoding
   work again; generation_config.json's ``length_penalty`` is validated at load; a tokenizer.json too large for
   its model's vocabulary is refused by its size before a byte is parsed.

Run as ``python -m tests.reliability.test_round_two_model_dirs MARKERS DEADLINE_S -- <python -m service args>``,
this module is the server with a fault hook (see :func:`install_hanging_loads`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from model.checkpoint import load_checkpoint
from model.files import UnreadableFile, read_regular
from model.layers import MAX_POSITIONS
from model.tokenizer import MAX_PIECE_BYTES, MAX_WORD_CHARS
from tests.reliability.helpers import inprocess_server
from tests.service.server import ROOT, free_port, running_server

transformers = pytest.importorskip("transformers")
from tests.hf_directories import (  # noqa: E402 (needs transformers)
    TEXTS,
    bert_directory,
    gpt2_directory,
    opus_mt_directory,
    sentence_transformers_layout,
)

HANG_FILE = "hang.fifo"  # a model directory holding it hangs in its load (the fault hook below)
PROMPT = {"inputs": ["def add("], "max_new_tokens": 4}
EXIT_BOUND_S = 120.0  # failure bound: a server that hangs instead of exiting fails here
# The load deadline of the hang tests: the hung model always reaches it; the good one, a tiny model that loads in
# well under a second, must not, even on a busy machine (a 2 s deadline could fail it at load average 5).
HANG_DEADLINE_S = 10


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """Good directories as transformers writes them: gpt2, bert (classifier), embed (sentence-transformers), marian."""
    root = tmp_path_factory.mktemp("good")
    gpt2_directory(root / "gpt2")
    bert_directory(root / "bert", head=True)
    sentence_transformers_layout(bert_directory(root / "embed", head=False))
    opus_mt_directory(root / "marian")
    return root


def _edit(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _fifo(name: str) -> Callable[[Path], None]:
    def make(directory: Path) -> None:
        (directory / name).unlink(missing_ok=True)
        os.mkfifo(directory / name)
    return make


def _long_piece(directory: Path) -> None:
    """A vocabulary piece of 4 KiB (in place of one, so the vocabulary still fits the model)."""
    def change(t: dict) -> None:
        vocab = t["model"]["vocab"]
        vocab["x" * 4096] = vocab.pop(max(vocab, key=vocab.get))
    _edit(directory / "tokenizer.json", change)


def _padded(size: int) -> Callable[[Path], None]:
    """tokenizer.json grown to ``size`` bytes with whitespace (still valid JSON, still the same tokenizer)."""
    def grow(directory: Path) -> None:
        path = directory / "tokenizer.json"
        with path.open("a") as f:
            f.write(" " * (size - path.stat().st_size))
    return grow


# name -> (good directory, how it breaks, what the refusal says)
BREAKS: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "marian-positions-4e6": ("marian", lambda d: _edit(d / "config.json", lambda c: c.update(
        max_position_embeddings=4_000_000)), f"max_position_embeddings=4000000 is outside [1, {MAX_POSITIONS}]"),
    "marian-positions-1e9": ("marian", lambda d: _edit(d / "config.json", lambda c: c.update(
        max_position_embeddings=10**9)), f"max_position_embeddings=1000000000 is outside [1, {MAX_POSITIONS}]"),
    "marian-d-model-1e7": ("marian", lambda d: _edit(d / "config.json", lambda c: c.update(d_model=10**7)),
                           "expected (61, 10000000)"),  # the weights' shapes first: nothing sized by it before
    "fifo-tokenizer": ("bert", _fifo("tokenizer.json"), "tokenizer.json: a FIFO, not a regular file"),
    "fifo-pooling": ("embed", _fifo("1_Pooling/config.json"), "config.json: a FIFO, not a regular file"),
    "fifo-weights": ("gpt2", _fifo("model.safetensors"), "model.safetensors: not a regular file"),
    "fifo-config": ("gpt2", _fifo("config.json"), "config.json: a FIFO, not a regular file"),
    "wordpiece-word-chars": ("bert", lambda d: _edit(d / "tokenizer.json", lambda t: t["model"].update(
        max_input_chars_per_word=10**9)), f"max_input_chars_per_word=1000000000 is over the limit of {MAX_WORD_CHARS}"),
    "long-piece": ("bert", _long_piece, f"is 4096 bytes long, over the limit of {MAX_PIECE_BYTES}"),
    "piece-8mb": ("bert", lambda d: _edit(d / "tokenizer.json", lambda t: t["model"]["vocab"].update(
        {"x" * (8 << 20): 5})), "bytes, over the limit of"),  # refused by its size, before the piece is parsed
    "tokenizer-34mb": ("gpt2", _padded(34 << 20), "tokenizer.json: 35651584 bytes, over the limit of"),
    "length-penalty-1e308": ("marian", lambda d: _edit(d / "generation_config.json", lambda g: g.update(
        length_penalty=1e308)), "generation_config.json: length_penalty must be in [-10, 10], got 1e+308"),
}


def broken(good: Path, root: Path, name: str) -> Path:
    """A copy of BREAKS[name]'s good directory, broken as it says, at ``root / name``."""
    source, breaks, _ = BREAKS[name]
    shutil.copytree(good / source, root / name)
    breaks(root / name)
    return root / name


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_hostile_directory_fails_its_load_with_the_reason(good, tmp_path, name):
    with pytest.raises(ValueError) as caught:
        load_checkpoint(broken(good, tmp_path, name), "cpu")
    assert BREAKS[name][2] in str(caught.value), str(caught.value)


def _special_file(kind: str, path: Path) -> Path:
    if kind == "fifo":
        os.mkfifo(path)  # a blocking open would wait for a writer forever
    elif kind == "directory":
        path.mkdir()
    elif kind == "too large":
        path.write_bytes(b"x" * 11)
    return {"device": Path("/dev/zero"), "grows": Path("/proc/self/environ")}.get(kind, path)


@pytest.mark.parametrize(("kind", "says"), [("fifo", "a FIFO"), ("directory", "a directory"),
                                            ("device", "a character device"), ("too large", "11 bytes, over the limit"),
                                            ("grows", "over the limit of 10 bytes (it grew")])
def test_only_regular_files_within_their_limit_are_read(tmp_path, kind, says):
    path = _special_file(kind, tmp_path / "file")
    with pytest.raises(UnreadableFile, match=re.escape(says)):
        read_regular(path, 10)
    environ = Path("/proc/self/environ")  # fstat says 0 bytes: read to the limit, not to the size
    assert read_regular(environ, 1 << 20) == environ.read_bytes()
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 10)


def test_a_hostile_directory_is_listed_under_failed_while_the_good_ones_serve(good, tmp_path):
    """One real server over every broken directory, a good GPT-2, a good OPUS-MT and a BERT whose tokenizer.json
    has no decoder: it is ready (no FIFO hangs it), lists each broken one with its reason, and serves the rest: the
    decoder-less tokenizer's token strings (500 before) are the pieces transformers gives."""
    models = tmp_path / "models"
    for name in BREAKS:
        broken(good, models, name)
    for name in ("gpt2", "marian"):
        shutil.copytree(good / name, models / name)
    shutil.copytree(good / "bert", models / "bert-no-decoder")
    _edit(models / "bert-no-decoder" / "tokenizer.json", lambda t: t.update(decoder=None))
    with running_server(models) as server, server.client() as client:
        listing = client.get("/v1/models").json()
        assert sorted(m["name"] for m in listing["data"]) == ["bert-no-decoder", "gpt2", "marian"]
        failed = {f["name"]: f["error"] for f in listing["failed"]}
        assert failed.keys() == BREAKS.keys()
        for name, (_, _, says) in BREAKS.items():
            assert says in failed[name], (name, failed[name])
        beam = client.post("/v1/models/marian/generate", json={"inputs": ["the file"], "strategy": "beam",
                                                                "max_new_tokens": 8})
        assert beam.status_code == 200, beam.text
        assert client.post("/v1/models/gpt2/generate", json=PROMPT).status_code == 200
        answer = client.post("/v1/tokenize", json={"model": "bert-no-decoder", "prompt": TEXTS[0],
                                                   "return_token_strs": True})
        assert answer.status_code == 200, answer.text
        reference = transformers.AutoTokenizer.from_pretrained(models / "bert-no-decoder")
        assert answer.json()["token_strs"] == reference.convert_ids_to_tokens(answer.json()["tokens"])


# --- a load that hangs anyway: the per-model deadline -------------------------------------------------------------


def install_hanging_loads(markers: Path) -> None:
    """Fault hook: the load of a model directory holding HANG_FILE (a FIFO) first reads it with a blocking open, as
    a read of a hung file system would block (``markers/hanging-<name>`` says it started)."""
    import service.engine.engine as engine

    real = engine.load_checkpoint

    def load(directory: Path, *args, **kwargs):
        hang = Path(directory) / HANG_FILE
        if hang.exists():
            (markers / f"hanging-{Path(directory).name}").touch()
            with open(hang, "rb") as f:  # blocks until a writer opens it
                f.read()
        return real(directory, *args, **kwargs)

    engine.load_checkpoint = load


def _release(fifo: Path) -> None:
    """Let a reader blocked on ``fifo`` go (it reads EOF); nothing when none waits."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        assert exc.errno == errno.ENXIO  # no reader


def test_a_load_that_hangs_fails_at_its_deadline_and_the_others_serve(good, tmp_path, monkeypatch):
    models = tmp_path / "models"
    shutil.copytree(good / "gpt2", models / "gpt2")
    shutil.copytree(good / "bert", models / "hung")
    os.mkfifo(models / "hung" / HANG_FILE)
    import service.engine.engine as engine

    monkeypatch.setattr(engine, "load_checkpoint", engine.load_checkpoint)  # restored after the test
    install_hanging_loads(tmp_path)
    try:
        with inprocess_server(models, model_load_timeout_s=HANG_DEADLINE_S) as server, server.client() as client:
            assert (tmp_path / "hanging-hung").exists()
            listing = client.get("/v1/models").json()
            assert [m["name"] for m in listing["data"]] == ["gpt2"]
            timed_out = f"LoadTimeout: did not load within {HANG_DEADLINE_S} s"
            assert listing["failed"] == [{"name": "hung", "error": timed_out}]
            assert client.post("/v1/models/gpt2/generate", json=PROMPT).status_code == 200
    finally:
        _release(models / "hung" / HANG_FILE)


def test_sigterm_ends_a_start_up_whose_load_hangs(good, tmp_path):
    """SIGTERM while a model's load hangs: the server exits (its load fails at the deadline; the hung thread, a
    daemon, does not hold the exit). Before, the start-up thread was joined at exit and the process never ended."""
    models = tmp_path / "models"
    shutil.copytree(good / "gpt2", models / "gpt2")
    shutil.copytree(good / "bert", models / "hung")
    os.mkfifo(models / "hung" / HANG_FILE)
    port = free_port()
    args = [sys.executable, "-m", __name__, str(tmp_path), "--", "--models", str(models), "--host", "127.0.0.1",
            "--port", str(port), "--model-load-timeout-s", str(HANG_DEADLINE_S)]
    env = {**os.environ, "TSERVE_THREADS": "1", "TSERVE_LOG_LEVEL": "info"}
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        marker = tmp_path / "hanging-hung"
        while not marker.exists():  # the event: the load is in its blocking open
            assert process.poll() is None, process.communicate()[0][-4000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        log, _ = process.communicate(timeout=EXIT_BOUND_S)
    finally:
        if process.poll() is None:
            process.kill()
        _release(models / "hung" / HANG_FILE)
    assert process.returncode == 0, log[-4000:]
    assert "model 'hung'" in log and f"LoadTimeout: did not load within {HANG_DEADLINE_S} s" in log, log[-4000:]


if __name__ == "__main__":
    from service.__main__ import main

    markers, separator, *argv = sys.argv[1:]
    assert separator == "--", sys.argv
    install_hanging_loads(Path(markers))
    sys.exit(main(argv))
