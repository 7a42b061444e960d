"""A Hugging Face LlamaForCausalLM directory (tests/hf_directories.py: GQA, untied head, byte-level BPE) served by a
real in-process server: /generate answers the tokens of offline greedy decoding (ours, and transformers')."""

from __future__ import annotations

import pytest
import torch

from model.generation import GenerationConfig, generate_causal
from model.hf import load_hf_model
from tests.hf_directories import llama_directory
from tests.reliability.helpers import inprocess_server

transformers = pytest.importorskip("transformers")

PROMPTS = ["def add(", "the quick", "for i in range"]
NEW_TOKENS = 8


def test_an_hf_llama_is_served_with_the_tokens_of_offline_greedy(tmp_path):
    directory = llama_directory(tmp_path / "models" / "llama-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ours, config = load_hf_model(directory)
    offline = [h[0].tokens for h in generate_causal(ours, ids, GenerationConfig(strategy="greedy",
                                                                                max_new_tokens=NEW_TOKENS))]
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    for prompt_ids, mine in zip(ids, offline, strict=True):
        with torch.no_grad():
            new = hf.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=config.eos_id)[0, len(prompt_ids):].tolist()
        assert mine == (new[: new.index(config.eos_id)] if config.eos_id in new else new)
    assert sum(map(len, offline)) > len(PROMPTS)  # real continuations
    with inprocess_server(tmp_path / "models") as server, server.client() as client:
        body = {"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS, "strategy": "greedy"}
        response = client.post("/v1/models/llama-hf/generate", json=body)
        assert response.status_code == 200, response.text
        outputs = response.json()["outputs"]
    assert [o["tokens"] for o in outputs] == offline
    assert [o["text"] for o in outputs] == [tokenizer.decode(t, skip_special_tokens=True) for t in offline]
