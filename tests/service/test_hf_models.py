"""Hugging Face model directories served next to our checkpoints (issue 16), by a real `python -m service`.

The GPT-2 directory is what `transformers` writes: a random GPT2LMHeadModel and a byte-level BPE trained
here in GPT-2's layout (<|endoftext|> last), both through save_pretrained; its adapters are what `peft`
writes (random non-zero A and B on c_attn / c_proj / c_fc, Conv1D's fan_in_fan_out, one rank-stabilised).
The service must answer what `tokenizer(text)` + `generate()` in `transformers` (and `peft`) give, token
for token, also with the adapters mixed in one batch.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.hf_compare import randomize
from tests.service.fixtures import LM
from tests.service.server import running_server

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EOT = "<|endoftext|>"
CORPUS = ["def add(x, y):\n    return x + y\n", "the quick brown fox jumps over the lazy dog", "print('hello')",
          "for i in range(10):\n    total += i\n"] * 20
PROMPTS = ["def add(", "the quick", "for i in"]
NEW_TOKENS = 8
ADAPTERS = {  # name -> PEFT LoraConfig fields
    "all-projections": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"]),
    "attention-rslora": dict(r=2, lora_alpha=4, target_modules=["c_attn"], use_rslora=True),
}


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


def peft_adapter(base: Path, directory: Path, seed: int, **fields) -> Path:
    """A PEFT LoRA adapter on the GPT-2 at ``base``, with random non-zero A and B, saved by peft."""
    model = transformers.GPT2LMHeadModel.from_pretrained(base)
    adapted = peft.get_peft_model(model, peft.LoraConfig(fan_in_fan_out=True, **fields))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    adapted.save_pretrained(directory)
    return directory


def hf_generate(directory: Path, adapter: Path | None, prompt: str, **kwargs) -> list[int]:
    """transformers' (and peft's) greedy or beam continuation of ``prompt``, cut at EOS."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.GPT2LMHeadModel.from_pretrained(directory)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # one prompt at a time: no padding involved
    with torch.no_grad():
        new = model.eval().generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    new = new[0, ids.shape[1]:].tolist()
    return new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new


@pytest.fixture(scope="module")
def served(models_dir, tmp_path_factory):
    """A server over our tiny-lm, a GPT-2 directory with two PEFT adapters and a broken HF directory; the
    GPT-2 directory and its adapters' directory."""
    root = tmp_path_factory.mktemp("hf-models")
    gpt2 = gpt2_directory(root / "models" / "gpt2-hf")
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        peft_adapter(gpt2, root / "adapters" / "gpt2-hf" / name, seed, **fields)
    os.symlink(models_dir / LM, root / "models" / LM)
    broken = root / "models" / "broken-hf"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with running_server(root / "models", root / "adapters") as server, server.client() as client:
        yield client, gpt2, root / "adapters" / "gpt2-hf"


def test_an_hf_directory_is_listed_as_hf_beside_our_checkpoints(served):
    client, _, _ = served
    listing = client.get("/v1/models").json()
    formats = {m["name"]: (m["format"], m["family"]) for m in listing["data"]}
    assert formats == {"gpt2-hf": ("hf", "causal_lm"), LM: ("tserve", "causal_lm")}
    (failed,) = listing["failed"]
    assert failed["name"] == "broken-hf" and "model_type='llama' is not supported" in failed["error"]


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_an_hf_gpt2_generates_what_transformers_generates(served, strategy):
    client, directory, _ = served
    body = {"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS, "strategy": strategy}
    if strategy == "beam":
        body |= {"num_beams": 4, "length_penalty": 0.0}
    response = client.post("/v1/models/gpt2-hf/generate", json=body)
    assert response.status_code == 200, response.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    beam = dict(num_beams=4, length_penalty=0.0, early_stopping=True) if strategy == "beam" else {}
    outputs = response.json()["outputs"]
    assert sum(len(o["tokens"]) for o in outputs) > len(PROMPTS)  # real continuations, not bare EOS
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        new = hf_generate(directory, None, prompt, **beam)
        assert output["tokens"] == new, prompt
        assert output["text"] == tokenizer.decode(new, skip_special_tokens=True)


def test_peft_adapters_of_an_hf_gpt2_give_peft_outputs_mixed_in_one_batch(served):
    """Each PEFT adapter, discovered at start-up, answers what PeftModel.generate answers; sent together with
    the base model they share batches, and each row still gets its own adapter's output."""
    client, directory, adapters = served
    listed = {a["name"]: a for a in client.get("/v1/models/gpt2-hf/adapters").json()["adapters"]}
    assert set(listed) == set(ADAPTERS)
    wanted = {name: [hf_generate(directory, adapters / name, p) for p in PROMPTS] for name in ADAPTERS}
    wanted[None] = [hf_generate(directory, None, p) for p in PROMPTS]
    assert len({json.dumps(w) for w in wanted.values()}) == 3  # the adapters change the outputs

    def generate(adapter: str | None) -> list[list[int]]:
        body = {"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS, "adapter": adapter}
        response = client.post("/v1/models/gpt2-hf/generate", json=body)
        assert response.status_code == 200, response.text
        return [o["tokens"] for o in response.json()["outputs"]]

    adapters_sent = [*wanted, *wanted]
    with ThreadPoolExecutor(len(adapters_sent)) as pool:
        got = list(pool.map(generate, adapters_sent))
    assert got == [wanted[a] for a in adapters_sent]
