"""Hugging Face model directories served next to our checkpoints (issue 16), by a real `python -m service`.

The GPT-2 directory is what `transformers` writes: a random GPT2LMHeadModel and a byte-level BPE trained
here in GPT-2's layout (<|endoftext|> last), both through save_pretrained. The service must answer what
`tokenizer(text)` + `generate()` in `transformers` give, token for token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.hf_compare import randomize
from tests.service.fixtures import LM
from tests.service.server import running_server

transformers = pytest.importorskip("transformers")

EOT = "<|endoftext|>"
CORPUS = ["def add(x, y):\n    return x + y\n", "the quick brown fox jumps over the lazy dog", "print('hello')",
          "for i in range(10):\n    total += i\n"] * 20
PROMPTS = ["def add(", "the quick", "for i in"]
NEW_TOKENS = 8


def gpt2_directory(directory: Path) -> Path:
    """A random GPT-2 and its tokenizer, as transformers saves them."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet,
                                                            show_progress=False))
    backend.add_special_tokens([EOT])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOT, eos_token=EOT,
                                                     unk_token=EOT)
    tokenizer.save_pretrained(directory)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=eot, eos_token_id=eot)
    randomize(transformers.GPT2LMHeadModel(config), seed=5, eos_id=eot, eos_boost=2.5).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def served(models_dir, tmp_path_factory):
    """A server over our tiny-lm, a GPT-2 directory and a broken HF directory; the GPT-2 directory."""
    root = tmp_path_factory.mktemp("hf-models")
    gpt2 = gpt2_directory(root / "models" / "gpt2-hf")
    os.symlink(models_dir / LM, root / "models" / LM)
    broken = root / "models" / "broken-hf"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with running_server(root / "models") as server, server.client() as client:
        yield client, gpt2


def test_an_hf_directory_is_listed_as_hf_beside_our_checkpoints(served):
    client, _ = served
    listing = client.get("/v1/models").json()
    formats = {m["name"]: (m["format"], m["family"]) for m in listing["data"]}
    assert formats == {"gpt2-hf": ("hf", "causal_lm"), LM: ("tserve", "causal_lm")}
    (failed,) = listing["failed"]
    assert failed["name"] == "broken-hf" and "model_type='llama' is not supported" in failed["error"]


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_an_hf_gpt2_generates_what_transformers_generates(served, strategy):
    client, directory = served
    body = {"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS, "strategy": strategy}
    if strategy == "beam":
        body |= {"num_beams": 4, "length_penalty": 0.0}
    response = client.post("/v1/models/gpt2-hf/generate", json=body)
    assert response.status_code == 200, response.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    beam = dict(num_beams=4, length_penalty=0.0, early_stopping=True) if strategy == "beam" else {}
    outputs = response.json()["outputs"]
    assert sum(len(o["tokens"]) for o in outputs) > len(PROMPTS)  # real continuations, not bare EOS
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # one prompt at a time: no padding involved
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **beam)[0, ids.shape[1]:].tolist()
        new = new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new
        assert output["tokens"] == new, prompt
        assert output["text"] == tokenizer.decode(new, skip_special_tokens=True)
