"""`lora`: only adapter weights change, PEFT layout and metrics, resume, and evaluate --adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint
from model.lora import use_adapters
from model.lora_io import load_adapter
from tests.training.conftest import TINY, log_rows, parse_run, run_cli, train_args
from training.lora_run import lora
from training.runs import LoRARun
from training.state import StateStore, state_dir_for


@pytest.fixture(scope="module")
def base(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "ckpt"
    run_cli(*train_args("seq2seq", data, out, "--max-steps", "10"))
    return out


def _lora_args(base, data, out, *extra: str) -> list[str]:
    loop = TINY[TINY.index("--batch-tokens") :]  # loop flags only: no model sizes
    return ["lora", "--base", str(base), "--train", str(data["s2s_train"]), "--valid", str(data["s2s_valid"]),
            "--out", str(out), "--rank", "4", "--alpha", "8", *loop, *extra]  # fmt: skip


def test_lora_trains_only_the_adapter(base, data, tmp_path):
    out = tmp_path / "adapter"
    argv = _lora_args(base, data, out, "--max-steps", "12", "--targets", "q_proj,v_proj,fc1")
    trained = lora(parse_run(LoRARun, *argv))

    before = load_checkpoint(base, device="cpu").model.state_dict()
    after = trained.state_dict()
    base_keys = {k: k.replace(".base.", ".") for k in after if ".lora_" not in k}  # LoRALinear keeps .base
    assert set(base_keys.values()) == set(before)
    for name, original in base_keys.items():
        assert torch.equal(after[name], before[original]), name

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert set(config["target_modules"]) == {"q_proj", "v_proj", "fc1"}
    keys = load_file(str(out / "adapter_model.safetensors"))
    assert keys and all(k.startswith("base_model.model.") and ".lora_" in k for k in keys)
    assert any(".fc1.lora_B" in k for k in keys) and not any("k_proj" in k for k in keys)
    state = StateStore(state_dir_for(out)).load()
    assert set(state.trainable) == {k for k in after if ".lora_" in k}

    metrics = json.loads((out / "metrics.json").read_text())
    assert {"valid_loss", "valid_bleu", "base", "best_step", "trainable_parameters"} <= set(metrics)
    assert {"valid_loss", "valid_bleu", "valid_chrf"} <= set(metrics["base"])
    assert metrics["valid_loss"] < metrics["base"]["valid_loss"]  # the adapter learned something
    assert (out / "train_log.csv").is_file() and (out / "loss.png").is_file()

    ckpt = load_checkpoint(base, device="cpu")
    load_adapter(ckpt.model, out, "a")
    src, tgt = torch.tensor([[10, 11, 12]]), torch.tensor([[1, 13]])
    with use_adapters(ckpt.model, "a"):
        adapted = ckpt.model(src, tgt)
    assert not torch.allclose(adapted, ckpt.model(src, tgt))


def test_lora_resume_and_evaluate(base, data, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    run_cli(*_lora_args(base, data, full, "--max-steps", "8", "--dropout", "0.1"))
    run_cli(*_lora_args(base, data, split, "--max-steps", "4", "--dropout", "0.1"))
    run_cli(*_lora_args(base, data, split, "--max-steps", "8", "--dropout", "0.1", "--resume"))
    losses = [[float(r["loss"]) for r in log_rows(state_dir_for(d))] for d in (full, split)]
    assert losses[1] == pytest.approx(losses[0], abs=1e-6, rel=0)

    run_cli("evaluate", "--model", str(base), "--adapter", str(full), "--test", str(data["s2s_valid"]), "--beams", "1",
            "--max-new-tokens", "8")  # fmt: skip
    metrics = json.loads((full / "metrics.json").read_text())
    assert {"bleu", "chrf", "base", "valid_bleu"} <= set(metrics) and metrics["beams"] == 1
    assert "bleu" not in json.loads((base / "metrics.json").read_text())
