"""A PEFT adapter uploaded at run time to a served Hugging Face Llama (model/hf/llama_adapters.py), by a real
in-process uvicorn: requests with and without it, taken into one batch (the worker held by events), each answer
what PeftModel.generate (or the bare LlamaForCausalLM) gives. The adapter adapts every projection and carries its
own lm_head and embed_tokens (modules_to_save), so the batch mixes LoRA deltas and per-row head and embedding
copies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import StepGate, block_worker, wait_until
from tests.hf_compare import peft_adapter
from tests.hf_directories import llama_directory
from tests.reliability.helpers import adapter_archive, inprocess_server

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MODEL = "llama-hf"
PROMPTS = ["def add(", "the quick"]
NEW_TOKENS = 8
FIELDS = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"], modules_to_save=["lm_head", "embed_tokens"])


def hf_generate(directory: Path, adapter: Path | None, prompt: str) -> list[int]:
    """transformers' (and peft's) greedy continuation of ``prompt`` alone, cut at EOS."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.LlamaForCausalLM.from_pretrained(directory)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        new = model.eval().generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    return new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new


def test_an_uploaded_peft_adapter_and_the_base_share_a_batch_and_give_peft_tokens(tmp_path):
    directory = llama_directory(tmp_path / "models" / MODEL)
    (tmp_path / "adapters").mkdir()
    adapter = peft_adapter(transformers.LlamaForCausalLM.from_pretrained(directory), tmp_path / "uploaded", seed=7,
                           **FIELDS)
    wanted = {name: [hf_generate(directory, path, p) for p in PROMPTS] for name, path in (("up", adapter),
                                                                                         (None, None))}
    assert wanted["up"] != wanted[None]  # the adapter changes the tokens

    with inprocess_server(tmp_path / "models", tmp_path / "adapters") as server, server.client(timeout=300) as client:
        put = client.put(f"/v1/models/{MODEL}/adapters/up", content=adapter_archive(adapter),
                         headers={"Content-Type": "application/gzip"})
        assert put.status_code == 200, put.text
        worker = server.engine.get(MODEL)

        async def both() -> tuple[list[httpx.Response], list[str]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                release = block_worker(worker)  # the requests only queue
                sent = [asyncio.ensure_future(c.post(f"/v1/models/{MODEL}/generate", headers={"X-Request-ID": rid},
                                                     json={"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS,
                                                           "strategy": "greedy", "adapter": name}))
                        for rid, name in (("with", "up"), ("without", None))]
                await wait_until(lambda: worker.scheduler.num_waiting == 2 or any(t.done() for t in sent))
                gate = StepGate(worker.scheduler)
                release.set()
                await gate.until_parked()  # the first model call: the prefill of the first batch
                first_batch = list(gate.ids)
                gate.release()
                return list(await asyncio.gather(*sent)), first_batch

        responses, first_batch = asyncio.run(both())
    assert sorted(first_batch) == ["with", "without"]  # one batch: rows of the adapter and of the base
    for response, name in zip(responses, ("up", None), strict=True):
        assert response.status_code == 200, response.text
        assert [o["tokens"] for o in response.json()["outputs"]] == wanted[name], name
