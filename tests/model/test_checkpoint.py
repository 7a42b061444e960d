"""Checkpoint round trips and the named errors for missing, corrupt or mismatched files."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.tokenizer import Tokenizer
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_classifier, tiny_seq2seq

TEXTS = ["hello world %s", "the cat sat on the mat", "print('hi')", "hola mundo {name}"] * 20


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(TEXTS, vocab_size=300)


@pytest.mark.parametrize("make", [tiny_causal_lm, tiny_seq2seq, tiny_classifier])
def test_round_trip_is_bit_exact(tmp_path, tokenizer, make):
    model = make(vocab_size=320)
    labels = ["a", "b", "c"] if model.config.family == "classifier" else None
    save_checkpoint(tmp_path / "ckpt", model, tokenizer, labels=labels, metrics={"bleu": 1.5})
    loaded = load_checkpoint(tmp_path / "ckpt", device="cpu")
    assert loaded.config == model.config
    assert loaded.labels == labels and loaded.metrics == {"bleu": 1.5}
    original, restored = model.state_dict(), loaded.model.state_dict()
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    if hasattr(loaded.model, "lm_head") and model.config.tie_embeddings:
        assert (
            loaded.model.lm_head.weight.data_ptr()
            == next(m.tokens.weight for m in loaded.model.modules() if hasattr(m, "tokens")).data_ptr()
        )
    assert loaded.tokenizer.encode("hello world") == tokenizer.encode("hello world")


def test_overwrite_is_atomic_and_leaves_no_temp_dirs(tmp_path, tokenizer):
    model = tiny_causal_lm(vocab_size=320)
    save_checkpoint(tmp_path / "ckpt", model, tokenizer)
    save_checkpoint(tmp_path / "ckpt", model, tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_saved_checkpoint_is_readable_by_other_users(tmp_path, tokenizer):
    """A server running as another user (the image's uid 10001) reads what training wrote: no 0700 directory or
    0600 file (mkdtemp's and safetensors' modes) is left in the published checkpoint."""
    model = tiny_seq2seq(vocab_size=320)
    path = save_checkpoint(tmp_path / "ckpt", model, tokenizer, extra_files={"hf/deep/file.json": b"{}"})
    for entry in [path, *path.rglob("*")]:
        mode = entry.stat().st_mode & 0o777
        assert mode == (0o755 if entry.is_dir() else 0o644), (entry, oct(mode))


@pytest.fixture
def saved(tmp_path, tokenizer):
    path = tmp_path / "ckpt"
    save_checkpoint(path, tiny_causal_lm(vocab_size=320), tokenizer)
    return path


def test_missing_files_are_named(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(saved, device="cpu")


def test_missing_directory_and_config(tmp_path, saved):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope", device="cpu")
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(saved, device="cpu")


def test_truncated_weights_are_named(saved):
    data = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(saved, device="cpu")


def test_mismatched_tensor_shape_and_missing_tensor_are_named(saved):
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["decoder.layers.0.ffn.fc1.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"decoder\.layers\.0\.ffn\.fc1\.weight.*shape"):
        load_checkpoint(saved, device="cpu")
    del tensors["decoder.layers.0.ffn.fc1.weight"]
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'decoder\.layers\.0\.ffn\.fc1\.weight'"):
        load_checkpoint(saved, device="cpu")


def test_nan_weights_and_bad_config_are_refused(saved):
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["lm_head.weight" if "lm_head.weight" in tensors else "embed.tokens.weight"][0, 0] = float("nan")
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match="NaN"):
        load_checkpoint(saved, device="cpu")
    config = json.loads((saved / "config.json").read_text())
    config["d_model"] = 30  # not divisible by n_heads=4
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="d_model"):
        load_checkpoint(saved, device="cpu")
    (saved / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        load_checkpoint(saved, device="cpu")


def test_loaded_model_computes_the_same_logits(saved, tokenizer):
    loaded = load_checkpoint(saved, device="auto", dtype="float32")
    ids = random_ids(2, 5)
    assert torch.equal(loaded.model(ids), tiny_causal_lm(vocab_size=320)(ids))
