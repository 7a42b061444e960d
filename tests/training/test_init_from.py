"""`train --init-from DIR` fine-tunes a whole model, `evaluate` takes a Hugging Face base (issue 16).

Tiny HF directories as transformers saves them (tests/hf_directories.py) are fine-tuned for a few steps by
the real command: the checkpoint it writes loads with the HF tokenizer kept (prompts encode as DIR's), holds the
weights the command trained (not DIR's), and a --resume from the state (which keeps the HF files) finishes it.
`evaluate` encodes with the model's tokenizer and special ids (its loss on GPT-2 is transformers') and loads a
PEFT adapter made by `lora --base DIR` in the HF layout (the loss the adapter's run reported).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from model.checkpoint import load_checkpoint
from tests.hf_compare import ATOL
from tests.service.fixtures import run_training
from tests.training.conftest import TINY, parse_run, write_text
from tests.training.hf_bases import CASES, LORA_LOOP, TEXTS, batch, hf_loss, write_data
from training.errors import UserError
from training.runs import TrainRun
from training.train_run import train

transformers = pytest.importorskip("transformers")

LOOP = ["--max-steps", "4", "--lr", "5e-2", "--warmup", "1", "--batch-tokens", "512", "--label-smoothing", "0",
        "--device", "cpu", "--eval-every", "2", "--save-every", "2", "--quiet"]


def fine_tune(tmp_path: Path, base: Path, family: str, *extra: str) -> tuple[Path, nn.Module]:
    """The checkpoint `train FAMILY --init-from base` writes and the model it trained."""
    train_file, valid = write_data(tmp_path, family)
    out = tmp_path / "tuned"
    trained = train(parse_run(TrainRun, "train", family, "--train", str(train_file), "--valid", str(valid), "--out",
                              str(out), "--init-from", str(base), *LOOP, *extra))
    return out, trained.eval()


def prompts(checkpoint) -> list[list[int]]:
    if checkpoint.family == "classifier":
        return [checkpoint.tokenizer.encode_pair(t)[0] for t in TEXTS]
    return checkpoint.encode_prompts(TEXTS)


@pytest.mark.parametrize("family", CASES)
def test_init_from_an_hf_directory_fine_tunes_it_and_keeps_its_tokenizer(tmp_path, family):
    base = CASES[family][0](tmp_path / "base")
    out, trained = fine_tune(tmp_path, base, family)
    original = load_checkpoint(base, device="cpu", dtype=torch.float32)
    tuned = load_checkpoint(out, device="cpu", dtype=torch.float32)
    assert (out / "hf" / "config.json").is_file() and tuned.labels == original.labels
    assert prompts(tuned) == prompts(original)
    ours, _ = batch(original)
    with torch.no_grad():
        before, after, expected = original.model(*ours), tuned.model(*ours), trained(*ours)
    assert (after - expected).abs().max() < ATOL  # the saved weights are the trained ones
    assert (after - before).abs().max() > 1e-3  # which moved away from DIR's
    assert json.loads((out / "metrics.json").read_text())["best_step"] in (2, 4)


def test_a_resumed_init_from_run_keeps_the_hf_files(tmp_path):
    base = CASES["causal_lm"][0](tmp_path / "base")
    fine_tune(tmp_path, base, "causal_lm", "--max-steps", "2")
    assert (tmp_path / "tuned.state").is_dir()
    out, _ = fine_tune(tmp_path, base, "causal_lm", "--resume")
    assert json.loads((out / "metrics.json").read_text())["steps_trained"] == 4
    tuned, original = (load_checkpoint(d, device="cpu") for d in (out, base))
    assert prompts(tuned) == prompts(original)


def test_init_from_our_checkpoint_continues_it(tmp_path):
    text = write_text(tmp_path / "text.txt", 40, seed=1)
    ours = tmp_path / "ours"
    run_training("train", "causal_lm", "--train", str(text), "--valid", str(text), "--out", str(ours), *TINY,
                 "--max-steps", "2", "--device", "cpu")
    out, trained = fine_tune(tmp_path, ours, "causal_lm")
    original, tuned = (load_checkpoint(d, device="cpu") for d in (ours, out))
    assert tuned.config == original.config and prompts(tuned) == prompts(original)
    assert not (out / "hf").exists()
    assert any(not torch.equal(a, b) for a, b in zip(tuned.model.state_dict().values(),
                                                     original.model.state_dict().values(), strict=True))


def test_init_from_refuses_another_family_and_a_tokenizer(tmp_path):
    base = CASES["causal_lm"][0](tmp_path / "base")
    train_file, valid = write_data(tmp_path, "classifier")
    common = ["--train", str(train_file), "--valid", str(valid), "--out", str(tmp_path / "o"), "--init-from", str(base)]
    with pytest.raises(UserError, match="causal_lm model, not classifier"):
        run_training("train", "classifier", *common, *LOOP)
    with pytest.raises(UserError, match="--tokenizer"):
        run_training("train", "classifier", *common, "--tokenizer", str(base / "tokenizer.json"), *LOOP)


def test_evaluate_an_hf_gpt2_with_its_peft_adapter(tmp_path):
    build, model_class, targets = CASES["causal_lm"]
    base = build(tmp_path / "base")
    train_file, valid = write_data(tmp_path, "causal_lm")
    adapter = tmp_path / "adapter"
    run_training("lora", "--base", str(base), "--train", str(train_file), "--valid", str(valid), "--out",
                 str(adapter), "--targets", targets, *LORA_LOOP)
    reported = json.loads((adapter / "metrics.json").read_text())
    evaluate = ["evaluate", "--model", str(base), "--test", str(valid), "--device", "cpu"]
    run_training(*evaluate)
    plain = json.loads((base / "metrics.json").read_text())
    hf = getattr(transformers, model_class).from_pretrained(base)
    assert plain["nll"] == pytest.approx(hf_loss("causal_lm", base, hf, valid), abs=ATOL)  # encoded as HF does
    run_training(*evaluate, "--adapter", str(adapter))
    adapted = json.loads((adapter / "metrics.json").read_text())
    assert adapted["nll"] == pytest.approx(reported["valid_loss"], abs=ATOL)
    assert abs(adapted["nll"] - plain["nll"]) > 1e-3
