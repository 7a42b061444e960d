"""`python -m training lora --base <Hugging Face directory>` (issue 16): an adapter PEFT loads on the HF model.

GPT-2, OPUS-MT and a BERT classifier as transformers saves them (tests.service.test_hf_models) get an adapter
trained for a few steps by the real command. PeftModel.from_pretrained on the HF model must take every tensor
it holds (none missing, none left over: PEFT's own state dict is the file's) and give the logits of the model
the command trained, in float32, as must our own loading of the file (lora_io.load_adapter with the checkpoint's
AdapterLayout); the adapter must change them. The GPT-2 adapter is on q and v but not k: c_attn's rank-3r LoRA
with a zero block. The command must encode its data as the model's own tokenizer in transformers does, with the
model's special ids (GPT-2's EOS, Marian's EOS 0 and pad start): the base's valid loss it reports is
transformers' loss on the valid file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from model.checkpoint import Checkpoint, load_checkpoint
from model.lora import use_adapters
from model.lora_io import load_adapter
from model.tokenizer import pad_batch
from tests.hf_compare import ATOL
from tests.service import test_hf_models as hf_models
from tests.training.conftest import run_cli
from training import lora_run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TEXTS = ["the quick brown fox jumps over the lazy dog", "def add(x, y):", "print('hello')", "for i in range(10):"]
PAIRS = [("the file could not be opened", "no se pudo abrir el archivo"), ("print('hello world')", "Grüße aus Köln"),
         ("emoji 😀", "日本語のテキスト"), ("copy %s files", "déjà vu")]
TEXT_LABELS = ["negative", "positive", "neutral", "negative"]  # of TEXTS, for the BERT classifier
LOOP = ["--rank", "2", "--alpha", "4", "--max-steps", "4", "--lr", "5e-2", "--warmup", "1", "--batch-tokens", "512",
        "--label-smoothing", "0", "--device", "cpu", "--eval-every", "1000", "--save-every", "1000", "--quiet"]


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
        enc["labels"] = torch.tensor([hf_models.LABELS.index(r["label"]) for r in rows])
    with torch.no_grad():
        return model(**enc).loss.item()


def train(tmp_path: Path, base: Path, family: str, targets: str, monkeypatch) -> tuple[Path, Path, nn.Module]:
    """The valid file, the adapter directory ``python -m training lora`` writes and the model it trained (adapter
    "default")."""
    trained = {}
    monkeypatch.setattr(lora_run, "write_param_digest", lambda model, ctx: trained.setdefault("model", model))
    (train_file, valid), out = write_data(tmp_path, family), tmp_path / "adapter"
    run_cli("lora", "--base", str(base), "--train", str(train_file), "--valid", str(valid), "--out", str(out),
            "--targets", targets, *LOOP)
    return valid, out, trained["model"].eval()


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


def check_gpt2_config(out: Path, base: Path) -> None:
    """q and v (not k) in c_attn's rank 3r with alpha 3x (the scaling kept), Conv1D's fan_in_fan_out, the
    adapted modules' paths as targets."""
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (6, 12.0, True)
    assert (config["task_type"], config["base_model_name_or_path"]) == ("CAUSAL_LM", str(base.resolve()))
    assert config["target_modules"] == [f"transformer.h.{i}.{m}" for i in range(2)
                                        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    b = load_file(out / "adapter_model.safetensors")["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    assert b.shape == (96, 6) and not b[32:64].any() and b[:32, :2].any() and not b[:32, 2:].any()


CASES = {  # family -> (HF directory builder, HF model class, --targets)
    "causal_lm": (hf_models.gpt2_directory, "GPT2LMHeadModel", "q_proj,v_proj,out_proj,fc1,fc2"),
    "seq2seq": (hf_models.opus_mt_directory, "MarianMTModel", "q_proj,k_proj,v_proj,out_proj,fc1,fc2"),
    "classifier": (lambda d: hf_models.bert_directory(d, head=True), "BertForSequenceClassification",
                   "q_proj,k_proj,v_proj,out_proj,fc1,fc2"),
}


@pytest.mark.parametrize("family", CASES)
def test_a_lora_trained_on_an_hf_base_loads_in_peft_with_the_trained_logits(tmp_path, monkeypatch, family):
    build, model_class, targets = CASES[family]
    base = build(tmp_path / "base")
    valid, out, trained = train(tmp_path, base, family, targets, monkeypatch)
    checkpoint = load_checkpoint(base, device="cpu", dtype=torch.float32)
    ours, theirs = batch(checkpoint)
    with torch.no_grad(), use_adapters(trained, "default"):
        expected = trained(*ours)

    hf = getattr(transformers, model_class).from_pretrained(base)
    base_loss = json.loads((out / "metrics.json").read_text())["base"]["valid_loss"]
    assert base_loss == pytest.approx(hf_loss(family, base, hf, valid), abs=ATOL)  # data as HF encodes it
    with torch.no_grad():
        base_logits = hf(**theirs).logits
    adapted = peft.PeftModel.from_pretrained(hf, out).eval()
    saved = load_file(out / "adapter_model.safetensors")
    loaded = peft.get_peft_model_state_dict(adapted)
    assert sorted(loaded) == sorted(saved)  # every LoRA PEFT made has its tensors, and no tensor is left over
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    with torch.no_grad():
        got = adapted(**theirs).logits
    assert (got - expected).abs().max() < ATOL
    assert (base_logits - expected).abs().max() > 1e-3  # the adapter changes them

    if family == "causal_lm":
        check_gpt2_config(out, base)
    load_adapter(checkpoint.model, out, "again", layout=checkpoint.adapter_layout)
    with torch.no_grad(), use_adapters(checkpoint.model, "again"):
        assert (checkpoint.model(*ours) - expected).abs().max() < ATOL

