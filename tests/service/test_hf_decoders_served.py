"""One real server (uvicorn on 127.0.0.1) serving a directory of every Llama-family architecture (Llama, Mistral,
Qwen2, Qwen3, Phi-3, Gemma 3: random tiny models and tokenizers in each one's own layout, saved by transformers)
beside one of our own trained checkpoints, with engine features on: each answers the tokens of offline greedy
decoding with transformers' decoded text, n-gram speculation gives the same tokens, a repeated prompt is served from
the prefix cache (not the sliding-window ones, which decline it), logprobs are transformers' log-softmax, and a JSON
schema holds on byte-level tokenizers (a SentencePiece one is a 422 that says why)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, processors

from model.generation import GenerationConfig, generate_causal
from model.hf import load_hf_model
from tests.hf_compare import randomize
from tests.hf_tokenizers import byte_level_bpe, sentencepiece_bpe, write_directory
from tests.reliability.helpers import inprocess_server
from tests.service.conftest import LM

transformers = pytest.importorskip("transformers")



def with_bos(backend: Tokenizer) -> Tokenizer:
    """``backend`` with Llama's template: <s> before every input."""
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", 1)])
    return backend


TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
# name -> (config class, model class, tokenizer builder, tokenizer_config.json, end token, config fields)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", lambda: byte_level_bpe(digits=True),
              {"tokenizer_class": "GPT2Tokenizer"}, "<|endoftext|>", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", lambda: with_bos(sentencepiece_bpe(legacy=True)),
                {"tokenizer_class": "LlamaTokenizer"}, "</s>", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", lambda: byte_level_bpe(qwen=True),
              {"tokenizer_class": "Qwen2Tokenizer"}, "<|im_end|>", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", lambda: byte_level_bpe(qwen=True),
              {"tokenizer_class": "Qwen2Tokenizer"}, "<|im_end|>", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", lambda: with_bos(sentencepiece_bpe(legacy=True)),
             {"tokenizer_class": "LlamaTokenizer"}, "</s>", {"partial_rotary_factor": 0.5}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               lambda: with_bos(sentencepiece_bpe(legacy=True, prefix=False)),
               {"tokenizer_class": "GemmaTokenizer"}, "</s>",
               {"num_hidden_layers": 3, "head_dim": 8, "sliding_window": 4, "sliding_window_pattern": 2,
                "query_pre_attn_scalar": 6}),
}
WINDOWED = {"mistral", "gemma3"}  # every or some layers attend within a window: no prefix cache
BYTE_LEVEL = {"llama", "qwen2", "qwen3"}
PROMPTS = ["the quick brown fox jumps over the lazy dog and the quick brown fox", "print('hello world')"]
NEW_TOKENS = 10


def save_architecture(directory: Path, name: str) -> Path:
    """A random tiny ``name`` model and its tokenizer, as transformers saves them."""
    config_class, model_class, build, settings, end, fields = ARCHITECTURES[name]
    backend = build()
    write_directory(directory, backend, settings, name)
    end_id = backend.token_to_id(end)
    config = getattr(transformers, config_class)(vocab_size=backend.get_vocab_size(), bos_token_id=end_id,
                                                 eos_token_id=end_id, pad_token_id=end_id, **{**TINY, **fields})
    randomize(getattr(transformers, model_class)(config), seed=7, eos_id=end_id, eos_boost=1.5).save_pretrained(
        directory)
    return directory


@pytest.fixture(scope="module")
def served(tmp_path_factory, models_dir) -> Path:
    root = tmp_path_factory.mktemp("decoders") / "models"
    for name in ARCHITECTURES:
        save_architecture(root / name, name)
    shutil.copytree(models_dir / LM, root / LM)
    return root


def offline_greedy(directory: Path) -> tuple[list[list[int]], list[str], list[list[int]]]:
    """Each prompt's greedy tokens from our model offline, transformers' decoded text of them, and the prompt ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    model, config = load_hf_model(directory)
    results = generate_causal(model, ids, GenerationConfig(strategy="greedy", max_new_tokens=NEW_TOKENS,
                                                           eos_token_id=config.eos_id))
    tokens = [r[0].tokens for r in results]
    return tokens, [tokenizer.decode(t, skip_special_tokens=True) for t in tokens], ids


def prefix_cache_hits(client, model: str) -> float:
    lines = client.get("/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("tserve_prefix_cache_hits_total") and f'model="{model}"' in line)


def test_every_architecture_is_served_beside_our_own_with_engine_features(served):
    expected = {name: offline_greedy(served / name) for name in ARCHITECTURES}
    assert any(len(t) > 1 for tokens, _, _ in expected.values() for t in tokens)  # real continuations
    with inprocess_server(served, prefix_cache_mb=64) as server, server.client() as client:
        catalog = client.get("/v1/models").json()
        assert not catalog["failed"], catalog["failed"]
        listed = {m["name"] for m in catalog["data"]}
        assert listed == {*ARCHITECTURES, LM}
        ours = client.post(f"/v1/models/{LM}/generate", json={"inputs": ["hello"], "max_new_tokens": 4})
        assert ours.status_code == 200, ours.text
        for name, (tokens, texts, prompt_ids) in expected.items():
            url = f"/v1/models/{name}/generate"
            body = {"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS, "strategy": "greedy"}
            hits_before = prefix_cache_hits(client, name)
            for _ in range(2):  # the second time the prompts' blocks are cached
                response = client.post(url, json=body)
                assert response.status_code == 200, (name, response.text)
                outputs = response.json()["outputs"]
                assert [o["tokens"] for o in outputs] == tokens, name
                assert [o["text"] for o in outputs] == texts, name
            hits = prefix_cache_hits(client, name) - hits_before
            assert (hits == 0) if name in WINDOWED else (hits > 0), (name, hits)

            for prompt, want in zip(PROMPTS, tokens, strict=True):
                drafted = client.post(url, json={**body, "inputs": [prompt],
                                                 "speculative": {"method": "ngram", "num_tokens": 3}})
                assert drafted.status_code == 200, (name, drafted.text)
                assert drafted.json()["outputs"][0]["tokens"] == want, name

            scored = client.post(url, json={**body, "inputs": PROMPTS[:1], "logprobs": 2}).json()["outputs"][0]
            hf = transformers.AutoModelForCausalLM.from_pretrained(served / name).eval()
            with torch.no_grad():
                first = hf(torch.tensor([prompt_ids[0]])).logits[0, -1].log_softmax(-1)
            entry = scored["logprobs"][0]
            assert entry["token"] == tokens[0][0]
            assert abs(entry["logprob"] - first[entry["token"]].item()) < 1e-4
            assert [a["token"] for a in entry["top_logprobs"]] == first.topk(2).indices.tolist()

            constrained = client.post(url, json={**body, "inputs": PROMPTS[:1],
                                                 "constraint": {"json_schema": {"type": "boolean"}}})
            if name in BYTE_LEVEL:
                assert constrained.status_code == 200, (name, constrained.text)
                output = constrained.json()["outputs"][0]
                assert output["constraint_satisfied"] and json.loads(output["text"]) in (True, False), output
            else:
                assert constrained.status_code == 422, (name, constrained.text)
                assert "tokenizer" in constrained.text, constrained.text
