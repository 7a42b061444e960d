"""PEFT adapters on ModernBERT whose modules_to_save names ``head`` (dense -> activation -> LayerNorm): a copy of our
pooler and one of head_norm per adapter (model.lora_layers.HeadCopies, norms included), beside the SEQ_CLS /
TOKEN_CLS adapter's own ``classifier``.

On the sequence head without biases in the head (``classifier_bias`` / ``norm_bias`` False: copies without a bias),
with them (mean pooling), and on the token head: PeftModel's logits (each real token's for the token head) in float32
within 1e-4 and float64 within 1e-9, alone and mixed per row with an adapter that copies only ``classifier`` and has
a LoRA on the head's dense (loaded before or after: the LoRA sits inside the head's copies) and the base, also with
that adapter merged; ours saved back name ``head`` and load in PEFT with the same logits, and deleting the adapters
unwraps the head. A model quantised to int8 takes the copies (float) with the logits of one quantised after loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_hf_checkpoint
from model.int8_linear import Int8Linear
from model.lora import delete_adapter, layers_with, merge_adapter, unmerge_adapter, use_adapters
from model.lora_io import load_adapter, save_adapter
from model.lora_layers import HeadCopies, LoRALinear
from model.quantize import QuantizeError, quantize
from tests.hf_compare import ATOL, peft_adapter
from tests.model.hf_modernbert import modernbert_directory
from tests.model.test_hf_encoder_peft import assert_alone_and_mixed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TEXTS = ["the quick brown fox", "jumps over the lazy dog again and again and again", "hello", "a b c d e f"]
TOLERANCES = {torch.float32: ATOL, torch.float64: 1e-9}
# head (tests/model/hf_modernbert.HEADS) -> its Auto class and PEFT task type
KINDS = {"cls": ("AutoModelForSequenceClassification", "SEQ_CLS"),
         "mean": ("AutoModelForSequenceClassification", "SEQ_CLS"),
         "token": ("AutoModelForTokenClassification", "TOKEN_CLS")}


@pytest.fixture(scope="module", params=list(KINDS))
def adapted(request, tmp_path_factory) -> tuple[str, Path, dict[str, Path]]:
    """(head, the ModernBERT directory, adapters): "a" LoRAs on Wqkv, Wo, Wi and its own ``head`` and ``classifier``;
    "b" LoRAs on Wi and the head's dense (our pooler) and its own ``classifier`` only."""
    head = request.param
    root = tmp_path_factory.mktemp(f"modernbert-{head}")
    directory = modernbert_directory(root / "hf", head, seed=7)
    auto, task = KINDS[head]
    base = getattr(transformers, auto).from_pretrained
    paths = {"a": peft_adapter(base(directory), root / "a", seed=1, r=2, lora_alpha=4, task_type=task,
                               target_modules=["Wqkv", "Wo", "Wi"], modules_to_save=["head"]),
             "b": peft_adapter(base(directory), root / "b", seed=2, r=3, lora_alpha=4, task_type=task,
                               target_modules=["Wi", "dense"])}
    return head, directory, paths


def hf_logits(head: str, directory: Path, adapter: Path | None, dtype: torch.dtype) -> torch.Tensor:
    """transformers' (with PeftModel's ``adapter``) logits on TEXTS in ``dtype``, padded; pad tokens' zero."""
    model = getattr(transformers, KINDS[head][0]).from_pretrained(directory)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model = model.to(dtype).eval()
    batch = transformers.AutoTokenizer.from_pretrained(directory)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits if head != "token" else logits.masked_fill(batch["attention_mask"].unsqueeze(-1) == 0, 0.0)


def our_logits(head: str, model, ids: torch.Tensor) -> torch.Tensor:
    if head != "token":
        return model(ids)
    return model.token_logits(ids).masked_fill((ids == model.config.pad_id).unsqueeze(-1), 0.0)


@pytest.mark.parametrize("order", ["ab", "ba"])
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_a_copy_of_the_head_gives_peft_logits_alone_and_mixed_per_row(adapted, dtype, order):
    head, directory, paths = adapted
    checkpoint = load_hf_checkpoint(directory, device="cpu", dtype=dtype)
    model = checkpoint.model
    for name in order:
        load_adapter(model, paths[name], name, layout=checkpoint.adapter_layout)
    assert list(model.pooler.copies) == list(model.head_norm.copies) == ["a"]
    assert sorted(model.classifier.copies) == ["a", "b"]
    assert isinstance(model.pooler.base, LoRALinear) and "pooler.base" in layers_with(model, "b")
    biased = head == "mean"  # classifier_bias and norm_bias: the copies have biases as theirs
    assert all((m.copies["a"].bias is not None) == biased for m in (model.pooler, model.head_norm))
    ids = transformers.AutoTokenizer.from_pretrained(directory)(TEXTS, padding=True, return_tensors="pt")["input_ids"]
    expected = {name: hf_logits(head, directory, paths.get(name), dtype) for name in ("a", "b", None)}
    assert all((expected[n] - expected[None]).abs().max() > 1e-2 for n in "ab")
    assert_alone_and_mixed(model, ids, expected, lambda x: our_logits(head, model, x), TOLERANCES[dtype])
    merge_adapter(model, "b")
    assert_alone_and_mixed(model, ids, expected, lambda x: our_logits(head, model, x), TOLERANCES[dtype])
    unmerge_adapter(model)
    with torch.no_grad(), use_adapters(model, "a"):
        model.head_norm.copies["a"].weight.copy_(model.head_norm.base.weight)  # the norm's copy matters
        assert (our_logits(head, model, ids) - expected["a"]).abs().max() > 1e-3


def test_ours_saved_back_names_head_and_loads_in_peft(adapted, tmp_path):
    head, directory, paths = adapted
    checkpoint = load_hf_checkpoint(directory, device="cpu", dtype=torch.float64)
    model = checkpoint.model
    for name, path in paths.items():
        load_adapter(model, path, name, layout=checkpoint.adapter_layout)
    save_adapter(model, "a", tmp_path / "saved", layout=checkpoint.adapter_layout)
    saved = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == ["classifier", "head"]
    want = hf_logits(head, directory, paths["a"], torch.float64)
    assert (hf_logits(head, directory, tmp_path / "saved", torch.float64) - want).abs().max() < 1e-9
    delete_adapter(model, "b")  # its LoRA inside a's copies of the pooler goes, the copies stay
    assert isinstance(model.pooler, HeadCopies) and isinstance(model.pooler.base, torch.nn.Linear)
    delete_adapter(model, "a")
    assert not any(isinstance(m, HeadCopies | LoRALinear) for m in model.modules())


def test_an_int8_model_takes_a_copy_of_the_head_as_when_loaded_before_quantising(adapted):
    """Loaded after model.quantize (its heads then Int8Linear) or before it, the adapter's copies stay float: the same
    logits for each adapter and the base."""
    head, directory, paths = adapted
    models = []
    for after in (False, True):
        checkpoint = load_hf_checkpoint(directory, device="cpu")
        if after:
            quantize(checkpoint.model, "int8")
        for name, path in paths.items():
            load_adapter(checkpoint.model, path, name, layout=checkpoint.adapter_layout)
        if not after:
            try:
                quantize(checkpoint.model, "int8")
            except QuantizeError as exc:
                pytest.skip(str(exc))
        models.append(checkpoint.model)
    assert all(isinstance(m.pooler.base.base, Int8Linear) and list(m.head_norm.copies) == ["a"] for m in models)
    ids = transformers.AutoTokenizer.from_pretrained(directory)(TEXTS, padding=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for name in ("a", "b", None):
            with use_adapters(models[0], name), use_adapters(models[1], name):
                before, after = (our_logits(head, m, ids) for m in models)
            assert (before - after).abs().max() < 1e-5, name
