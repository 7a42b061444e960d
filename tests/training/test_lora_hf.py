"""`python -m training lora --base <Hugging Face directory>` (issue 16): an adapter PEFT loads on the HF model.

GPT-2, OPUS-MT and a BERT classifier as transformers saves them (tests/hf_directories.py) get an adapter
trained for a few steps by the real command. PeftModel.from_pretrained on the HF model must take every tensor
it holds (none missing, none left over: PEFT's own state dict is the file's) and give the logits of the model
the command trained, in float32, as must our own loading of the file (lora_io.load_adapter with the checkpoint's
AdapterLayout); the adapter must change them. The GPT-2 adapter is on q and v but not k: c_attn's rank-3r LoRA
with a zero block. The command must encode its data as the model's own tokenizer in transformers does, with the
model's special ids (GPT-2's EOS, Marian's EOS 0 and pad start): the base's valid loss it reports is
transformers' loss on the valid file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from model.checkpoint import load_checkpoint
from model.lora import use_adapters
from model.lora_io import load_adapter
from tests.hf_compare import ATOL
from tests.training.conftest import parse_run
from tests.training.hf_bases import CASES, LORA_LOOP, batch, check_in_peft, write_data
from training.lora_run import lora
from training.runs import LoRARun

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def train(tmp_path: Path, base: Path, family: str, targets: str) -> tuple[Path, Path, nn.Module]:
    """The valid file, the adapter directory ``python -m training lora`` writes and the model it trained (adapter
    "default")."""
    (train_file, valid), out = write_data(tmp_path, family), tmp_path / "adapter"
    trained = lora(parse_run(LoRARun, "lora", "--base", str(base), "--train", str(train_file), "--valid", str(valid),
                             "--out", str(out), "--targets", targets, *LORA_LOOP))
    return valid, out, trained.eval()


def check_gpt2_config(out: Path, base: Path) -> None:
    """q and v (not k) in c_attn's rank 3r with alpha 3x (the scaling kept), Conv1D's fan_in_fan_out, the
    adapted modules' paths as targets."""
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (6, 12.0, True)
    assert (config["task_type"], config["base_model_name_or_path"]) == ("CAUSAL_LM", str(base.resolve()))
    assert config["target_modules"] == [f"transformer.h.{i}.{m}" for i in range(2)
                                        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    b = load_file(out / "adapter_model.safetensors")["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    assert b.shape == (96, 6) and not b[32:64].any() and b[:32, :2].any() and not b[:32, 2:].any()


@pytest.mark.parametrize("family", CASES)
def test_a_lora_trained_on_an_hf_base_loads_in_peft_with_the_trained_logits(tmp_path, family):
    build, model_class, targets = CASES[family]
    base = build(tmp_path / "base")
    valid, out, trained = train(tmp_path, base, family, targets)
    checkpoint = load_checkpoint(base, device="cpu", dtype=torch.float32)
    ours, theirs = batch(checkpoint)
    with torch.no_grad(), use_adapters(trained, "default"):
        expected = trained(*ours)

    hf = getattr(transformers, model_class).from_pretrained(base)
    check_in_peft(hf, base, out, family, valid, theirs, expected)

    if family == "causal_lm":
        check_gpt2_config(out, base)
    load_adapter(checkpoint.model, out, "again", layout=checkpoint.adapter_layout)
    with torch.no_grad(), use_adapters(checkpoint.model, "again"):
        assert (checkpoint.model(*ours) - expected).abs().max() < ATOL

