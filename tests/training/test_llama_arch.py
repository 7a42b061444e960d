"""`train causal_lm --arch llama [--kv-heads N]`: a Llama-style decoder of our own blocks (RMSNorm, rotary
positions, SwiGLU, grouped-query attention, no biases) that learns, serves, and takes a LoRA adapter on every
projection, the gated FFN's `up` included. Other families refuse the preset by name."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint
from model.generation import GenerationConfig, generate_causal
from tests.reliability.helpers import inprocess_server
from tests.training.conftest import TINY, call_command, log_rows, run_cli, train_args
from training.errors import UserError
from training.state import state_dir_for

LLAMA = {"norm": "pre", "norm_type": "rms", "positions": "rope", "ffn": "gated", "activation": "silu", "bias": False,
         "scale_embeddings": False, "tie_embeddings": True, "final_norm": True, "n_kv_heads": 2}
TARGETS = "q_proj,k_proj,v_proj,out_proj,fc1,fc2,up"
PROMPTS = ["the", "a cat"]


def test_a_llama_arch_lm_learns_serves_and_takes_lora_on_every_projection(data, tmp_path):
    base, adapter = tmp_path / "models" / "llama", tmp_path / "adapters" / "llama" / "mine"
    run_cli(*train_args("causal_lm", data, base, "--max-steps", "30", "--arch", "llama", "--kv-heads", "2"))
    config = json.loads((base / "config.json").read_text())
    assert {k: config[k] for k in LLAMA} == LLAMA
    losses = [float(r["loss"]) for r in log_rows(state_dir_for(base))]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5

    ckpt = load_checkpoint(base, device="cpu")
    attention = ckpt.model.decoder.layers[0].self_attn
    assert attention.k_proj.out_features == 2 * attention.q_proj.out_features // 4  # 2 K/V heads for 4 queries
    prompts = [ckpt.tokenizer.encode(p, add_bos=True) for p in PROMPTS]
    greedy = GenerationConfig(strategy="greedy", max_new_tokens=6)
    offline = [h[0].tokens for h in generate_causal(ckpt.model, prompts, greedy)]
    assert offline == [h[0].tokens for h in generate_causal(ckpt.model, prompts, greedy, use_cache=False)]

    loop = TINY[TINY.index("--batch-tokens"):]
    run_cli("lora", "--base", str(base), "--train", str(data["lm_train"]), "--valid", str(data["lm_valid"]),
            "--out", str(adapter), "--rank", "4", "--alpha", "8", "--targets", TARGETS, "--max-steps", "5",
            *loop)  # fmt: skip
    adapted = {key.split(".lora_")[0].rpartition(".")[2] for key in load_file(adapter / "adapter_model.safetensors")}
    assert adapted == set(TARGETS.split(","))

    with inprocess_server(tmp_path / "models", tmp_path / "adapters") as server, server.client() as client:
        answers = [client.post("/v1/models/llama/generate", json={"inputs": PROMPTS, "strategy": "greedy",
                                                                   "max_new_tokens": 6, **extra})
                   for extra in ({}, {"adapter": "mine"})]  # fmt: skip
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert [o["tokens"] for o in answers[0].json()["outputs"]] == offline


@pytest.mark.parametrize("family", ["seq2seq", "classifier"])
def test_other_families_refuse_the_llama_arch_by_name(data, tmp_path, family):
    with pytest.raises(UserError, match=f"--arch llama is for causal_lm only: {family} models use the original "
                                        r"blocks \(--arch default, paper, gpt2, bert\)"):
        call_command(*train_args(family, data, tmp_path / "out", "--max-steps", "1", "--arch", "llama"))
    assert not (tmp_path / "out").exists()


def test_kv_heads_must_divide_heads(data, tmp_path):
    with pytest.raises(UserError, match="n_kv_heads must divide n_heads=4"):
        call_command(*train_args("causal_lm", data, tmp_path / "out", "--arch", "llama", "--kv-heads", "3"))
