"""PEFT-layout adapter files (model.lora_io): round trip, and every malformed file refused cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.lora import AdapterError, get_adapter_config
from model.lora_io import load_adapter, lora_state_dict, save_adapter
from tests.model.lora_toy import ROWS, assert_unchanged, inputs, run, snapshot, toy, with_adapters

# ---- save / load -----------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = with_adapters("a", "b")
    save_adapter(model, "b", tmp_path / "b", base_model_name_or_path="toy")
    save_adapter(model, "b", tmp_path / "b", base_model_name_or_path="toy")  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "b", *(tmp_path / "b").iterdir()]}
    assert modes == {"b": 0o755, "adapter_config.json": 0o644, "adapter_model.safetensors": 0o644}  # others read it
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    for key in (
        "peft_type",
        "r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "bias",
        "task_type",
        "base_model_name_or_path",
        "fan_in_fan_out",
        "inference_mode",
        "modules_to_save",
    ):
        assert key in config, key
    assert config["base_model_name_or_path"] == "toy" and config["r"] == 2
    saved = load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert "base_model.model.layers.1.ffn.fc2.lora_B.weight" in saved and len(saved) == 2 * 6

    fresh = with_adapters("a")
    loaded = load_adapter(fresh, tmp_path / "b", "b2")
    assert loaded == get_adapter_config(fresh, "b2") and loaded.base_model_name_or_path == "toy"
    original, reloaded = lora_state_dict(model, "b"), lora_state_dict(fresh, "b2")
    assert original.keys() == reloaded.keys() == saved.keys()
    assert all(torch.equal(original[k], reloaded[k]) for k in original)
    x = inputs(3)
    assert torch.equal(run(fresh, x, "b2"), run(model, x, "b"))
    assert torch.equal(run(fresh, x, ["a", None, "b2", "a"]), run(model, x, ROWS))

    single = toy().float()  # loads into the model's dtype
    load_adapter(single, tmp_path / "b", "b")
    assert single.layers[0].ffn.fc1.lora_A["b"].weight.dtype == torch.float32


def _edit_tensors(directory: Path, edit) -> None:
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


A0 = "base_model.model.layers.0.self_attn.q_proj.lora_A.weight"
B1 = "base_model.model.layers.1.self_attn.v_proj.lora_B.weight"


def _truncate(d: Path) -> None:
    path = d / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-40])


def _pickle_only(d: Path) -> None:
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")


CORRUPTIONS = {
    "wrong_rank": (lambda d: _edit_config(d, r=2), "shape \\(4, 8\\), expected \\(2, 8\\)"),
    "wrong_shape": (lambda d: _edit_tensors(d, lambda t: t.update({A0: torch.zeros(4, 9)})), "expected \\(4, 8\\)"),
    "unknown_module": (
        lambda d: _edit_tensors(d, lambda t: t.update({A0.replace("q_proj", "fc1"): t[A0].clone()})),
        "not a target nn.Linear",
    ),
    "unknown_layer": (
        lambda d: _edit_tensors(d, lambda t: t.update({A0.replace(".0.", ".9."): t[A0].clone()})),
        "not a target nn.Linear",
    ),
    "bad_key": (lambda d: _edit_tensors(d, lambda t: t.update({"lora_A": t[A0].clone()})), "unexpected tensor"),
    "missing_tensor": (lambda d: _edit_tensors(d, lambda t: t.pop(B1)), "missing tensor.*v_proj.lora_B"),
    "nan": (lambda d: _edit_tensors(d, lambda t: t[B1].__setitem__((0, 0), float("nan"))), "non-finite"),
    "int_dtype": (lambda d: _edit_tensors(d, lambda t: t.update({B1: t[B1].long()})), "dtype torch.int64"),
    "truncated": (_truncate, "adapter_model.safetensors is not a readable safetensors file"),
    "pickle_only": (_pickle_only, "pickle files are not loaded"),
    "bad_json": (lambda d: (d / "adapter_config.json").write_text("{"), "cannot read.*adapter_config.json"),
    "no_config": (lambda d: (d / "adapter_config.json").unlink(), "cannot read.*adapter_config.json"),
    "unsupported": (lambda d: _edit_config(d, use_dora=True), "unsupported PEFT options"),
    "bad_config_type": (lambda d: _edit_config(d, lora_alpha="16"), "lora_alpha='16'"),
    "no_targets": (lambda d: _edit_config(d, target_modules=["nope"]), "no nn.Linear named"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_load_rejects_mismatched_adapters_and_leaves_model_unchanged(tmp_path: Path, case: str) -> None:
    source = with_adapters("a")
    save_adapter(source, "a", tmp_path / "a")
    corrupt, match = CORRUPTIONS[case]
    corrupt(tmp_path / "a")
    model = with_adapters("keep")
    snap = snapshot(model)
    with pytest.raises(AdapterError, match=match) as err:
        load_adapter(model, tmp_path / "a", "new")
    assert "'new'" in str(err.value)
    assert_unchanged(model, snap)


def test_load_rejects_bad_or_taken_names(tmp_path: Path) -> None:
    source = with_adapters("a")
    save_adapter(source, "a", tmp_path / "a")
    model = toy()
    snap = snapshot(model)
    with pytest.raises(AdapterError, match="invalid adapter name '../x'"):
        load_adapter(model, tmp_path / "a", "../x")
    with pytest.raises(AdapterError, match="not found"):
        load_adapter(model, tmp_path / "missing", "m")
    assert_unchanged(model, snap)
    load_adapter(model, tmp_path / "a", "a")
    with pytest.raises(AdapterError, match="already exists"):
        load_adapter(model, tmp_path / "a", "a")
