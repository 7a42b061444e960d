"""Tiny Hugging Face bases (tests/hf_directories.py) and a task each, for `lora --base` and `train --init-from`.

The data files of each family's task, the batch our model and the HF model take for the same inputs, and
transformers' loss on the valid file as the model's own tokenizer encodes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from model.checkpoint import Checkpoint
from model.tokenizer import pad_batch
from tests.hf_compare import ATOL
from tests.hf_directories import LABELS, bert_directory, gpt2_directory, opus_mt_directory

transformers = pytest.importorskip("transformers")

TEXTS = ["the quick brown fox jumps over the lazy dog", "def add(x, y):", "print('hello')", "for i in range(10):"]
PAIRS = [("the file could not be opened", "no se pudo abrir el archivo"), ("print('hello world')", "Grüße aus Köln"),
         ("emoji 😀", "日本語のテキスト"), ("copy %s files", "déjà vu")]
TEXT_LABELS = ["negative", "positive", "neutral", "negative"]  # of TEXTS, for the BERT classifier
LORA_LOOP = ["--rank", "2", "--alpha", "4", "--max-steps", "4", "--lr", "5e-2", "--warmup", "1",  # `lora`'s loop
             "--batch-tokens", "512", "--label-smoothing", "0", "--device", "cpu", "--eval-every", "1000",
             "--save-every", "1000", "--quiet"]


def write_data(directory: Path, family: str) -> tuple[Path, Path]:
    """Tiny (train, valid) files of ``family``'s task; valid holds the first two examples (under 64 GPT-2 tokens:
    one block)."""
    if family == "causal_lm":
        lines = [f"{t}\n" for t in TEXTS]
    elif family == "seq2seq":
        lines = [f"{s}\t{t}\n" for s, t in PAIRS]
    else:
        lines = [json.dumps({"text": t, "label": label}) + "\n" for t, label in zip(TEXTS, TEXT_LABELS, strict=True)]
    suffix = {"causal_lm": ".txt", "seq2seq": ".tsv", "classifier": ".jsonl"}[family]
    train_file, valid = directory / f"train{suffix}", directory / f"valid{suffix}"
    train_file.write_text("".join(lines * 4), encoding="utf-8")
    valid.write_text("".join(lines[:2]), encoding="utf-8")
    return train_file, valid


def hf_loss(family: str, base: Path, model: nn.Module, valid: Path) -> float:
    """transformers' mean loss on the valid file as its tokenizer encodes it (an LM document then EOS)."""
    if family == "seq2seq":
        tokenizer = transformers.MarianTokenizer.from_pretrained(base)
        sources, targets = zip(*(line.split("\t") for line in valid.read_text().splitlines()), strict=True)
        enc = tokenizer(list(sources), text_target=list(targets), padding=True, return_tensors="pt")
        enc["labels"] = enc["labels"].masked_fill(enc["labels"] == tokenizer.pad_token_id, -100)
    elif family == "causal_lm":
        tokenizer = transformers.AutoTokenizer.from_pretrained(base)
        ids = torch.tensor([[*tokenizer(valid.read_text()).input_ids, tokenizer.eos_token_id]])  # the file: a document
        enc = {"input_ids": ids, "labels": ids}
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(base)
        rows = [json.loads(line) for line in valid.read_text().splitlines()]
        enc = tokenizer([r["text"] for r in rows], padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor([LABELS.index(r["label"]) for r in rows])
    with torch.no_grad():
        return model(**enc).loss.item()


def padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the attention mask transformers takes."""
    ids, lengths = pad_batch(rows, pad_id)
    return ids, (torch.arange(ids.shape[1]) < lengths[:, None]).long()


def batch(checkpoint: Checkpoint) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Our model's inputs and the HF model's keyword arguments for the same batch."""
    pad = checkpoint.config.pad_id
    if checkpoint.family == "causal_lm":
        ids = torch.tensor(checkpoint.encode_prompts(TEXTS[:1]))  # one row: a causal LM needs no padding
        return (ids,), {"input_ids": ids}
    if checkpoint.family == "seq2seq":
        src, mask = padded(checkpoint.encode_prompts([s for s, _ in PAIRS]), pad)
        tgt = torch.tensor([[checkpoint.config.bos_id, *checkpoint.tokenizer.encode(PAIRS[0][1])]] * len(PAIRS))
        return (src, tgt), {"input_ids": src, "attention_mask": mask, "decoder_input_ids": tgt}
    pairs = [checkpoint.tokenizer.encode_pair(t) for t in TEXTS[:2]]
    ids, mask = padded([p[0] for p in pairs], pad)
    segments, _ = padded([p[1] for p in pairs], 0)
    return (ids, segments), {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}


CASES = {  # family -> (HF directory builder, HF model class, --targets)
    "causal_lm": (gpt2_directory, "GPT2LMHeadModel", "q_proj,v_proj,out_proj,fc1,fc2"),
    "seq2seq": (opus_mt_directory, "MarianMTModel", "q_proj,k_proj,v_proj,out_proj,fc1,fc2"),
    "classifier": (lambda d: bert_directory(d, head=True), "BertForSequenceClassification",
                   "q_proj,k_proj,v_proj,out_proj,fc1,fc2"),
}


def check_in_peft(hf: nn.Module, base: Path, adapter: Path, family: str, valid: Path,
                  theirs: dict[str, torch.Tensor], expected: torch.Tensor) -> None:
    """The adapter ``python -m training lora`` wrote in ``adapter`` loads on the HF model ``hf`` of ``base``:
    PeftModel takes every tensor it holds (none missing, none left over: PEFT's own state dict is the file's) and
    gives the logits of the model the command trained (``expected``), which differ from the base's; the base's
    valid loss the command reported is transformers' (its data encoded as the HF tokenizer does)."""
    peft = pytest.importorskip("peft")
    base_loss = json.loads((adapter / "metrics.json").read_text())["base"]["valid_loss"]
    assert base_loss == pytest.approx(hf_loss(family, base, hf, valid), abs=ATOL)
    with torch.no_grad():
        base_logits = hf(**theirs).logits
    adapted = peft.PeftModel.from_pretrained(hf, adapter).eval()
    saved = load_file(adapter / "adapter_model.safetensors")
    loaded = peft.get_peft_model_state_dict(adapted)
    assert sorted(loaded) == sorted(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    with torch.no_grad():
        got = adapted(**theirs).logits
    assert (got - expected).abs().max() < ATOL
    assert (base_logits - expected).abs().max() > 1e-3  # the adapter changes them

