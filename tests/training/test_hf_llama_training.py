"""Training on an imported Llama base, as on GPT-2 (tests/training/test_lora_hf.py, test_init_from.py).

`python -m training lora --base <Hugging Face Llama directory, or our checkpoint `import --from hf` made of it>`:
an adapter on every projection of the LlamaForCausalLM (the gated FFN's ``up`` included), trained a few steps by
the real command and written in the Llama's module names (model/hf/llama_adapters.py). PeftModel.from_pretrained
takes every tensor it holds (none missing, none left over) and gives the logits of the model the command trained,
in float32, as does our own loading of the file; the adapter changes them; the base's valid loss the command
reports is transformers' loss. `train causal_lm --init-from <the directory>` fine-tunes the whole model: the
checkpoint it writes holds the trained weights and keeps the Llama's tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.lora import use_adapters
from model.lora_io import load_adapter
from tests.hf_compare import ATOL
from tests.hf_directories import llama_directory
from tests.service.fixtures import run_training
from tests.training.conftest import parse_run
from tests.training.hf_bases import LORA_LOOP, batch, check_in_peft, write_data
from tests.training.test_init_from import fine_tune, prompts
from training.lora_run import lora
from training.runs import LoRARun

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = "q_proj,k_proj,v_proj,out_proj,fc1,up,fc2"
HF_NAMES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj"]


@pytest.mark.parametrize("imported", [False, True], ids=["hf-directory", "imported-checkpoint"])
def test_a_lora_trained_on_an_hf_llama_loads_in_peft_with_the_trained_logits(tmp_path, imported):
    directory = base = llama_directory(tmp_path / "llama")
    if imported:
        base = tmp_path / "imported"
        run_training("import", "--from", "hf", str(directory), "--out", str(base))
    (train_file, valid), out = write_data(tmp_path, "causal_lm"), tmp_path / "adapter"
    trained = lora(parse_run(LoRARun, "lora", "--base", str(base), "--train", str(train_file), "--valid", str(valid),
                             "--out", str(out), "--targets", TARGETS, *LORA_LOOP)).eval()
    checkpoint = load_checkpoint(base, device="cpu", dtype=torch.float32)
    ours, theirs = batch(checkpoint)
    with torch.no_grad(), use_adapters(trained, "default"):
        expected = trained(*ours)

    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["task_type"], config["r"], config["lora_alpha"]) == ("CAUSAL_LM", 2, 4.0)
    assert config["target_modules"] == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in HF_NAMES)
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    check_in_peft(hf, directory, out, "causal_lm", valid, theirs, expected)

    load_adapter(checkpoint.model, out, "again", layout=checkpoint.adapter_layout)
    with torch.no_grad(), use_adapters(checkpoint.model, "again"):
        assert (checkpoint.model(*ours) - expected).abs().max() < ATOL


def test_init_from_an_hf_llama_fine_tunes_it_and_keeps_its_tokenizer(tmp_path):
    base = llama_directory(tmp_path / "llama")
    out, trained = fine_tune(tmp_path, base, "causal_lm")
    original = load_checkpoint(base, device="cpu", dtype=torch.float32)
    tuned = load_checkpoint(out, device="cpu", dtype=torch.float32)
    assert tuned.config == original.config and prompts(tuned) == prompts(original)
    ours, _ = batch(original)
    with torch.no_grad():
        before, after, expected = original.model(*ours), tuned.model(*ours), trained(*ours)
    assert (after - expected).abs().max() < ATOL  # the saved weights are the trained ones
    assert (after - before).abs().max() > 1e-3  # which moved away from the directory's
