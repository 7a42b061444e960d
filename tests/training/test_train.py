"""End-to-end `train` and `evaluate` runs per family on tiny data: learning, loading, resuming, metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from tests.training.conftest import call_command, log_rows, run_cli, train_args, write_text
from training.arch import ModelSizes, build_config
from training.errors import UserError
from training.state import StateStore, state_dir_for

FAMILIES = ("seq2seq", "classifier", "causal_lm")


def _losses(state_dir: Path) -> list[float]:
    return [float(r["loss"]) for r in log_rows(state_dir)]


@pytest.mark.parametrize("family", FAMILIES)
def test_train_learns_and_checkpoint_loads(family, data, tmp_path):
    out = tmp_path / "ckpt"
    run_cli(*train_args(family, data, out, "--max-steps", "40"))

    losses = _losses(state_dir_for(out))
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.json", "train_log.csv", "loss.png"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"valid_loss", "best_step", "wall_time_s", "tokens_per_s", "parameters", "sizes", "steps_trained"} <= set(
        metrics
    )
    assert metrics["steps_trained"] == 40

    ckpt = load_checkpoint(out, device="cpu")
    tok = ckpt.tokenizer
    if family == "seq2seq":
        [[hyp]] = generate_seq2seq(
            ckpt.model, [tok.encode("the cat", add_eos=True)], GenerationConfig(max_new_tokens=8)
        )
        assert isinstance(tok.decode(hyp.tokens), str)
    elif family == "classifier":
        assert ckpt.labels == ["animal", "thing"]
        ids, segments = tok.encode_pair("the dog runs")
        logits = ckpt.model(torch.tensor([ids]), torch.tensor([segments]))
        assert logits.shape == (1, 2)
    else:
        [[hyp]] = generate_causal(ckpt.model, [tok.encode("the", add_bos=True)], GenerationConfig(max_new_tokens=8))
        assert len(hyp.tokens) <= 8


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_continues_with_identical_losses(family, data, tmp_path):
    """N steps in one go == N/2 steps, then --resume for the rest (dropout on)."""
    extra = ("--dropout", "0.1", "--save-every", "7")
    full, split = tmp_path / "full", tmp_path / "split"
    run_cli(*train_args(family, data, full, "--max-steps", "16", *extra))
    run_cli(*train_args(family, data, split, "--max-steps", "9", *extra))
    assert StateStore(state_dir_for(split)).load().meta["step"] == 9
    run_cli(*train_args(family, data, split, "--max-steps", "16", "--resume", *extra))

    expected, got = _losses(state_dir_for(full)), _losses(state_dir_for(split))
    assert len(got) == 16
    assert got == pytest.approx(expected, abs=1e-6, rel=0)
    rows = log_rows(state_dir_for(split))
    assert [int(r["step"]) for r in rows] == list(range(1, 17))


def test_classifier_pretraining_then_resume(data, tmp_path):
    """MLM + sentence-order pre-training runs first; a resume after it gives the same fine-tuning losses."""
    text = write_text(tmp_path / "pretrain.txt", 80, 9)
    extra = ("--pretrain-mlm", str(text), "--pretrain-steps", "6", "--dropout", "0.1")
    full, split = tmp_path / "full", tmp_path / "split"
    run_cli(*train_args("classifier", data, full, "--max-steps", "8", *extra))
    pre = log_rows(state_dir_for(full) / "pretrain")
    assert len(pre) == 6 and all(float(r["loss"]) > 0 for r in pre)

    run_cli(*train_args("classifier", data, split, "--max-steps", "3", *extra))
    run_cli(*train_args("classifier", data, split, "--max-steps", "8", "--resume", *extra))
    assert _losses(state_dir_for(split)) == pytest.approx(_losses(state_dir_for(full)), abs=1e-6, rel=0)


def test_same_seed_same_losses_other_seed_differs(data, tmp_path):
    runs = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        run_cli(*train_args("causal_lm", data, tmp_path / name, "--max-steps", "5", "--seed", seed))
        runs[name] = _losses(state_dir_for(tmp_path / name))
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_existing_state_needs_resume(data, tmp_path):
    out = tmp_path / "ckpt"
    run_cli(*train_args("causal_lm", data, out, "--max-steps", "2"))
    with pytest.raises(UserError, match="--resume"):
        call_command(*train_args("causal_lm", data, out, "--max-steps", "4"))


@pytest.mark.parametrize("family", FAMILIES)
def test_evaluate_writes_metrics(family, data, tmp_path):
    out = tmp_path / "ckpt"
    run_cli(*train_args(family, data, out, "--max-steps", "4"))
    prefix = {"seq2seq": "s2s", "classifier": "cls", "causal_lm": "lm"}[family]
    run_cli("evaluate", "--model", str(out), "--test", str(data[f"{prefix}_valid"]), "--beams", "2",
            "--max-examples", "5", "--max-new-tokens", "8")  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    expected = {"seq2seq": {"bleu", "chrf"}, "classifier": {"accuracy", "macro_f1"}, "causal_lm": {"perplexity"}}
    assert expected[family] <= set(metrics)
    assert metrics["test_examples"] == 5
    assert "valid_loss" in metrics  # training's keys are kept
    if family == "causal_lm":
        assert metrics["perplexity"] > 1.0
    run_cli("evaluate", "--model", str(out), "--test", str(data[f"{prefix}_valid"]), "--beams", "2",
            "--max-examples", "5", "--max-new-tokens", "8", "--quantize", "int8")  # fmt: skip
    after = json.loads((out / "metrics.json").read_text())
    assert after["int8"]["quantize"] == "int8" and expected[family] <= set(after["int8"])
    assert {k: after[k] for k in metrics} == metrics  # the fp32 metrics stay as they were
    run_cli("evaluate", "--model", str(out), "--test", str(data[f"{prefix}_valid"]), "--beams", "1",
            "--max-examples", "3", "--max-new-tokens", "8", "--metrics-key", "test-heldout")  # fmt: skip
    keyed = json.loads((out / "metrics.json").read_text())
    assert keyed["test-heldout"]["test_examples"] == 3 and expected[family] <= set(keyed["test-heldout"])
    assert {k: keyed[k] for k in after} == after  # another split's metrics, apart from the top level's


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ("paper", dict(norm="post", positions="sinusoidal", activation="relu", scale_embeddings=True)),
        ("gpt2", dict(norm="pre", positions="learned", activation="gelu_tanh", scale_embeddings=False)),
        ("bert", dict(norm="post", positions="learned", activation="gelu", embedding_norm=True, layer_norm_eps=1e-12)),
    ],
)
def test_arch_presets(arch, expected):
    config = build_config("classifier", ModelSizes(arch=arch, layers=2, d_model=32, heads=4, ffn=64), 300, num_labels=2)
    assert {k: getattr(config, k) for k in expected} == expected
    seq2seq = build_config("seq2seq", ModelSizes(arch=arch, layers=2, decoder_layers=1), 300)
    assert (seq2seq.n_encoder_layers, seq2seq.n_decoder_layers, seq2seq.tie_embeddings) == (2, 1, True)


def test_reuse_tokenizer_and_bert_arch(data, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run_cli(*train_args("classifier", data, first, "--max-steps", "2"))
    run_cli(*train_args("classifier", data, second, "--max-steps", "2", "--arch", "bert",
                        "--tokenizer", str(first / "tokenizer.json")))  # fmt: skip
    assert (second / "tokenizer.json").read_text() == (first / "tokenizer.json").read_text()
    config = json.loads((second / "config.json").read_text())
    assert (config["norm"], config["embedding_norm"], config["layer_norm_eps"]) == ("post", True, 1e-12)
