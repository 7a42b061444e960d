"""Served PEFT adapters on ModernBERT with their own copy of ``head`` (modules_to_save: dense -> act -> LayerNorm), on a
real server: /classify gives PeftModel's probabilities and /entities the token-classification pipeline's entities
over the PeftModel, each request its own, sent at once with the base and with an adapter whose LoRA is on the head's
dense (one batch mixes them per row).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.hf_compare import peft_adapter
from tests.hf_directories import TEXTS
from tests.model.hf_modernbert import modernbert_directory
from tests.service.server import running_server

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HEAD_COPY, HEAD_LORA = "head-copy", "head-lora"  # modules_to_save ["head"]; a LoRA on head.dense
# model -> its Auto class, PEFT task type, head (tests/model/hf_modernbert.HEADS)
MODELS = {"cls-modernbert": ("AutoModelForSequenceClassification", "SEQ_CLS", "cls"),
          "ner-modernbert": ("AutoModelForTokenClassification", "TOKEN_CLS", "token")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-copies")
    for i, (model, (auto, task, head)) in enumerate(MODELS.items()):
        directory = modernbert_directory(root / "models" / model, head, seed=10 + i)
        base = getattr(transformers, auto).from_pretrained
        peft_adapter(base(directory), root / "adapters" / model / HEAD_COPY, 20 + i, r=2, lora_alpha=4,
                     task_type=task, target_modules=["Wqkv", "Wi"], modules_to_save=["head"])
        peft_adapter(base(directory), root / "adapters" / model / HEAD_LORA, 30 + i, r=2, lora_alpha=4,
                     task_type=task, target_modules=["Wo", "dense"])
    with running_server(root / "models", root / "adapters", TSERVE_WARMUP="false") as server, \
            server.client() as client:
        yield client, root


def hf_model(root, model: str, adapter: str | None):
    directory = root / "models" / model
    hf = getattr(transformers, MODELS[model][0]).from_pretrained(directory).eval()
    return hf if adapter is None else peft.PeftModel.from_pretrained(hf, root / "adapters" / model / adapter).eval()


def at_once(post, adapters: list[str | None]) -> list:
    with ThreadPoolExecutor(len(adapters)) as pool:
        return list(pool.map(post, adapters))


SENT = [HEAD_COPY, None, HEAD_LORA, HEAD_COPY]


def test_classify_gives_peft_probabilities_with_a_copy_of_the_head(served):
    client, root = served
    model = "cls-modernbert"
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "models" / model)
    labels = transformers.AutoConfig.from_pretrained(root / "models" / model).id2label
    wanted = {}
    for adapter in dict.fromkeys(SENT):
        with torch.no_grad():
            logits = hf_model(root, model, adapter)(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits
        wanted[adapter] = torch.softmax(logits, -1)
    assert (wanted[HEAD_COPY] - wanted[None]).abs().max() > 1e-2

    def classify(adapter: str | None) -> list[dict]:
        response = client.post(f"/v1/models/{model}/classify", json={"inputs": TEXTS, "adapter": adapter})
        assert response.status_code == 200, response.text
        return response.json()["outputs"]

    for adapter, outputs in zip(SENT, at_once(classify, SENT), strict=True):
        for out, want in zip(outputs, wanted[adapter], strict=True):
            got = torch.tensor([out["probabilities"][labels[i]] for i in range(len(labels))])
            assert (got - want).abs().max() < 1e-5, adapter


def test_entities_are_the_pipeline_s_over_the_peft_model_with_a_copy_of_the_head(served):
    client, root = served
    model = "ner-modernbert"
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "models" / model)
    wanted = {}
    for adapter in dict.fromkeys(SENT):
        pipe = transformers.pipeline("token-classification", model=hf_model(root, model, adapter), tokenizer=tokenizer,
                                     aggregation_strategy="simple")
        wanted[adapter] = [pipe(text) for text in TEXTS]
    assert wanted[HEAD_COPY] != wanted[None]
    assert all(sum(map(len, w)) >= len(TEXTS) for w in wanted.values())  # entities found, not all "O"

    def entities(adapter: str | None) -> list[list[dict]]:
        body = {"inputs": TEXTS, "aggregation_strategy": "simple", "adapter": adapter}
        response = client.post(f"/v1/models/{model}/entities", json=body)
        assert response.status_code == 200, response.text
        return response.json()["outputs"]

    for adapter, outputs in zip(SENT, at_once(entities, SENT), strict=True):
        for text, got, want in zip(TEXTS, outputs, wanted[adapter], strict=True):
            assert [{**e, "score": None} for e in got] == [{**w, "score": None} for w in want], (adapter, text)
            assert all(abs(e["score"] - float(w["score"])) < 1e-5 for e, w in zip(got, want, strict=True)), text
