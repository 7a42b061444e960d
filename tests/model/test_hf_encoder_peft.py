"""PEFT LoRA adapters on RoBERTa, XLM-RoBERTa and DistilBERT (model/hf/encoder_adapters.py), built and saved by `peft`.

Random models saved by transformers (tests/model/hf_encoders.py), adapters with random non-zero A and B (and, for
SEQ_CLS ones, head copies moved off the base's) saved by peft: loaded onto our model from load_hf_checkpoint, each
gives PeftModel's logits in float32, two mixed per batch row give each row its own adapter's, and ours saved back
in the architecture's names load in PEFT with the same logits. The token classification heads (BERT's among them)
alike with TOKEN_CLS adapters (their own ``classifier``): every real token's logits, in float32 and float64.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_hf_checkpoint
from model.lora import AdapterError, adapter_names, layers_with, use_adapters
from model.lora_io import check_adapter, load_adapter, save_adapter
from model.lora_layers import HeadCopies
from tests.hf_compare import ATOL, peft_adapter
from tests.hf_directories import TEXTS
from tests.model.hf_encoders import encoder_directory

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# architecture -> two adapters' PEFT targets: every adapted Linear of a layer (by name, and "dense": RoBERTa's head
# dense too), and some of them by path suffix or a regex
TARGETS = {
    "roberta": (["query", "key", "value", "dense"], ["attention.self.value", "intermediate.dense"]),
    "xlm-roberta": (["query", "value"], r".*layer\.1\.(attention\.output\.dense|output\.dense)"),
    "distilbert": (["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"], r".*layer\.0\.attention\.(k_lin|v_lin)"),
}
TEXTS4 = [*TEXTS, "the lazy dog"]


@pytest.fixture(scope="module", params=TARGETS)
def encoder(request, tmp_path_factory) -> tuple[str, Path]:
    """(architecture, directory of its random *ForSequenceClassification with a tokenizer)."""
    return request.param, encoder_directory(tmp_path_factory.mktemp(request.param), request.param, "single")


def hf_logits(directory: Path, adapter: Path | None) -> torch.Tensor:
    """transformers' (with PeftModel's ``adapter``) logits on TEXTS4, padded."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    batch = transformers.AutoTokenizer.from_pretrained(directory)(TEXTS4, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def adapters(directory: Path, root: Path, targets: tuple, auto: str = "AutoModelForSequenceClassification", **fields
             ) -> dict[str, Path]:
    """Adapters "a" and "b" on ``targets`` (PEFT LoraConfig ``fields`` besides) of ``auto``'s model, saved by peft."""
    base = getattr(transformers, auto).from_pretrained
    return {name: peft_adapter(base(directory), root / name, seed=i, r=2 + i, lora_alpha=4, target_modules=t,
                               **fields)
            for i, (name, t) in enumerate(zip("ab", targets, strict=True))}


def ours_with(directory: Path, paths: dict[str, Path], dtype: torch.dtype | None = None):
    """Our model of ``directory`` with the adapters loaded, its layout, and TEXTS4's ids as the service pads them."""
    checkpoint = load_hf_checkpoint(directory, device="cpu", dtype=dtype)
    for name, path in paths.items():
        load_adapter(checkpoint.model, path, name, layout=checkpoint.adapter_layout)
    ids = transformers.AutoTokenizer.from_pretrained(directory)(TEXTS4, padding=True, return_tensors="pt")["input_ids"]
    return checkpoint, ids


def assert_alone_and_mixed(model, ids: torch.Tensor, expected: dict[str | None, torch.Tensor], logits=None,
                           tolerance: float = ATOL) -> None:
    """``logits`` (default: ``model``) of ``ids`` with each adapter alone, and mixed per row, equal ``expected``."""
    logits = logits or model
    with torch.no_grad():
        for name, want in expected.items():
            with use_adapters(model, name):
                assert (logits(ids) - want).abs().max() < tolerance, name
        rows = ["a", "b", None, "a"]
        with use_adapters(model, rows):
            mixed = logits(ids)
    for i, name in enumerate(rows):
        assert (mixed[i] - expected[name][i]).abs().max() < tolerance, (i, name)


def test_lora_adapters_give_peft_logits_alone_and_mixed_and_save_back(encoder, tmp_path):
    architecture, directory = encoder
    paths = adapters(directory, tmp_path, TARGETS[architecture])
    checkpoint, ids = ours_with(directory, paths)
    expected = {name: hf_logits(directory, paths.get(name)) for name in ("a", "b", None)}
    assert (expected["a"] - expected[None]).abs().max() > 1e-2 and (expected["b"] - expected[None]).abs().max() > 1e-2
    if architecture == "roberta":  # "dense" adapts the head's dense (our pooler) as PEFT does
        assert "pooler" in layers_with(checkpoint.model, "a")
    assert_alone_and_mixed(checkpoint.model, ids, expected)
    save_adapter(checkpoint.model, "b", tmp_path / "saved", layout=checkpoint.adapter_layout)
    assert (hf_logits(directory, tmp_path / "saved") - expected["b"]).abs().max() < ATOL


def test_seq_cls_adapters_carry_their_own_head(encoder, tmp_path):
    """modules_to_save ``classifier``: RoBERTa's whole head (dense and out_proj), DistilBERT's classifier and, by
    PEFT's suffix match, its pre_classifier: our pooler and classifier, copied per adapter."""
    architecture, directory = encoder
    paths = adapters(directory, tmp_path, TARGETS[architecture], task_type="SEQ_CLS")
    checkpoint, ids = ours_with(directory, paths)
    model = checkpoint.model
    assert isinstance(model.pooler, HeadCopies) and isinstance(model.classifier, HeadCopies)
    assert list(model.pooler.copies) == list(model.classifier.copies) == ["a", "b"]
    assert_alone_and_mixed(model, ids, {name: hf_logits(directory, paths.get(name)) for name in ("a", "b", None)})
    save_adapter(model, "a", tmp_path / "saved", layout=checkpoint.adapter_layout)
    assert (hf_logits(directory, tmp_path / "saved") - hf_logits(directory, paths["a"])).abs().max() < ATOL


# architecture -> two adapters' PEFT targets on its token classification head
TOKEN_TARGETS = {
    "bert": (["query", "value", "dense"], r".*layer\.1\.(attention\.output\.dense|output\.dense)"),
    "roberta": (["key", "dense"], ["attention.self.value"]),
    "xlm-roberta": (["query", "value"], r".*layer\.0\.intermediate\.dense"),
    "distilbert": (["q_lin", "out_lin", "lin2"], r".*layer\.1\.attention\.(k_lin|v_lin)"),
}


@pytest.fixture(scope="module", params=TOKEN_TARGETS)
def token_encoder(request, tmp_path_factory) -> tuple[str, Path]:
    """(architecture, directory of its random *ForTokenClassification with a tokenizer)."""
    return request.param, encoder_directory(tmp_path_factory.mktemp(request.param), request.param, "token")


def hf_token_logits(directory: Path, adapter: Path | None, dtype: torch.dtype, texts: list[str] = TEXTS4
                    ) -> torch.Tensor:
    """transformers' (with PeftModel's ``adapter``) token logits on ``texts`` in ``dtype``, padded, pad tokens' zero."""
    model = transformers.AutoModelForTokenClassification.from_pretrained(directory)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model = model.to(dtype).eval()
    batch = transformers.AutoTokenizer.from_pretrained(directory)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits.masked_fill(batch["attention_mask"].unsqueeze(-1) == 0, 0.0)


def real_token_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Our token logits of ``ids``, pad tokens' zero."""
    return model.token_logits(ids).masked_fill((ids == model.config.pad_id).unsqueeze(-1), 0.0)


def test_token_head_adapters_give_peft_token_logits_alone_and_mixed_and_save_back(token_encoder, tmp_path):
    """TOKEN_CLS adapters (LoRAs and their own ``classifier``): each real token's logits are PeftModel's in float32
    and float64, alone and mixed per row (the row's head copy on every token); ours saved back load in PEFT."""
    architecture, directory = token_encoder
    paths = adapters(directory, tmp_path, TOKEN_TARGETS[architecture], auto="AutoModelForTokenClassification",
                     task_type="TOKEN_CLS")
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        checkpoint, ids = ours_with(directory, paths, dtype)
        model = checkpoint.model
        assert isinstance(model.classifier, HeadCopies) and list(model.classifier.copies) == ["a", "b"]
        assert model.pooler is None
        expected = {name: hf_token_logits(directory, paths.get(name), dtype) for name in ("a", "b", None)}
        assert all((expected[n] - expected[None]).abs().max() > 1e-2 for n in "ab")
        assert_alone_and_mixed(model, ids, expected, partial(real_token_logits, model), tolerance)
    save_adapter(model, "b", tmp_path / "saved", layout=checkpoint.adapter_layout)
    assert (hf_token_logits(directory, tmp_path / "saved", torch.float64) - expected["b"]).abs().max() < 1e-9


@pytest.mark.parametrize(("architecture", "targets", "says"), [
    ("distilbert", ["q_lin", "classifier"], r"target_modules \['classifier'\] are not DistilBERT projections we adapt "
                                            r"\(attention\.k_lin, "),
    ("roberta", r".*layer\.0\.attention\.self\.query|.*out_proj",
     r"tensor 'base_model\.model\.classifier\.out_proj\.lora_A\.weight' is not a LoRA tensor of a RoBERTa "
     r"projection we adapt"),
], ids=["name", "regex"])
def test_what_we_cannot_adapt_is_refused_by_name(tmp_path, architecture, targets, says):
    """A LoRA on the classification head's output Linear has no place in ours: refused before the model changes."""
    directory = encoder_directory(tmp_path / "hf", architecture, "single")
    base = transformers.AutoModelForSequenceClassification.from_pretrained(directory)
    adapter = peft_adapter(base, tmp_path / "adapter", seed=4, r=2, lora_alpha=4, target_modules=targets)
    checkpoint = load_hf_checkpoint(directory, device="cpu")
    with pytest.raises(AdapterError, match=says):
        check_adapter(checkpoint.model, adapter, "a", checkpoint.adapter_layout)
    with pytest.raises(AdapterError, match=says):
        load_adapter(checkpoint.model, adapter, "a", layout=checkpoint.adapter_layout)
    assert adapter_names(checkpoint.model) == []
