"""PEFT SEQ_CLS adapters on BertForSequenceClassification carry their own classifier (modules_to_save).

Two adapters with random non-zero A and B and a perturbed head copy, saved by peft: each gives PeftModel's
logits, mixed per row in one forward each row gets its own adapter's head, deleting one leaves the other,
and saving ours writes the copy PEFT loads back (test_hf_adapters: other modules_to_save are refused by name).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_hf_checkpoint
from model.lora import adapter_names, delete_adapter, use_adapters
from model.lora_io import check_adapter, load_adapter, save_adapter
from model.lora_layers import HeadCopies
from tests.hf_compare import ATOL, peft_adapter
from tests.hf_directories import with_tokenizer
from tests.model import hf_bert

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture
def bert(tmp_path) -> Path:
    directory = tmp_path / "bert"
    hf_bert.save_bert(directory)
    return with_tokenizer(directory, hf_bert.BERT["vocab_size"])


def hf_model(directory: Path) -> torch.nn.Module:
    return transformers.BertForSequenceClassification.from_pretrained(directory).eval()


def seq_cls_adapter(directory: Path, out: Path, seed: int, **fields) -> Path:
    """A PEFT adapter on the BERT at ``directory``: random A and B, its head copy moved off the base's."""
    return peft_adapter(hf_model(directory), out, seed, r=2, lora_alpha=4, **fields)


def peft_logits(directory: Path, adapter: Path | None) -> torch.Tensor:
    model = hf_model(directory)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return hf_bert.hf_outputs(model, torch.float32, *hf_bert.batch()).logits


def test_each_adapter_uses_its_own_head_alone_and_mixed_per_row(bert, tmp_path):
    adapters = {n: seq_cls_adapter(bert, tmp_path / n, seed=i, task_type="SEQ_CLS", target_modules=["query", "value"])
                for i, n in enumerate(("a", "b"))}
    assert json.loads((adapters["a"] / "adapter_config.json").read_text())["modules_to_save"] == ["classifier", "score"]
    checkpoint = load_hf_checkpoint(bert, device="cpu")
    ours = checkpoint.model
    for name, path in adapters.items():
        assert check_adapter(ours, path, name, checkpoint.adapter_layout).modules_to_save == ("classifier", "score")
        load_adapter(ours, path, name, layout=checkpoint.adapter_layout)
    assert isinstance(ours.classifier, HeadCopies) and list(ours.classifier.copies) == ["a", "b"]
    expected = {n: peft_logits(bert, adapters.get(n)) for n in ("a", "b", None)}
    ids, types = hf_bert.batch()
    with torch.no_grad():
        for name in ("a", "b", None):
            with use_adapters(ours, name):
                assert (ours(ids, types) - expected[name]).abs().max() < ATOL, name
        rows = ["a", "b", None, "a"]
        with use_adapters(ours, rows):
            mixed = ours(ids, types)
        for i, name in enumerate(rows):
            assert (mixed[i] - expected[name][i]).abs().max() < ATOL, (i, name)
        with use_adapters(ours, "a"):
            ours.classifier.copies["a"].weight.copy_(ours.classifier.base.weight)
            ours.classifier.copies["a"].bias.copy_(ours.classifier.base.bias)
            assert (ours(ids, types) - expected["a"]).abs().max() > 1e-2  # the head copy matters

        delete_adapter(ours, "a")
        assert adapter_names(ours) == ["b"] and list(ours.classifier.copies) == ["b"]
        with use_adapters(ours, ["b", None, "b", None]):
            mixed = ours(ids, types)
        for i, name in enumerate(["b", None, "b", None]):
            assert (mixed[i] - expected[name][i]).abs().max() < ATOL, (i, name)
        delete_adapter(ours, "b")
    assert isinstance(ours.classifier, torch.nn.Linear) and adapter_names(ours) == []


def test_a_saved_adapter_keeps_its_head(bert, tmp_path):
    """Ours saved in BERT's names: PEFT's own files again, which we and PEFT load with the same head."""
    adapter = seq_cls_adapter(bert, tmp_path / "a", seed=5, task_type="SEQ_CLS", target_modules=["key"])
    checkpoint = load_hf_checkpoint(bert, device="cpu")
    load_adapter(checkpoint.model, adapter, "a", layout=checkpoint.adapter_layout)
    save_adapter(checkpoint.model, "a", tmp_path / "saved", layout=checkpoint.adapter_layout)
    fresh = load_hf_checkpoint(bert, device="cpu")
    load_adapter(fresh.model, tmp_path / "saved", "a", layout=fresh.adapter_layout)
    expected = peft_logits(bert, adapter)
    with torch.no_grad(), use_adapters(fresh.model, "a"):
        assert (fresh.model(*hf_bert.batch()) - expected).abs().max() < ATOL
    assert (peft_logits(bert, tmp_path / "saved") - expected).abs().max() < ATOL

