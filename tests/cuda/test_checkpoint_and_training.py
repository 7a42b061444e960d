"""Checkpoints loaded onto each target, and a few training steps on each device (bf16 autocast on CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from model.checkpoint import Checkpoint, load_checkpoint
from model.tokenizer import pad_batch
from tests.cuda.conftest import Target, assert_close, targets
from tests.service.conftest import CLS, LM, MT, TEXTS
from tests.service.fixtures import BASE_LOOP, FAMILIES, LOOP, MAX_LEN, SIZES, run_training, write_data
from tests.training.conftest import log_rows
from training.state import state_dir_for


def _probe(ckpt: Checkpoint) -> torch.Tensor:
    """The model's logits for TEXTS (a padded batch), on its own device."""
    device = next(ckpt.model.parameters()).device
    if ckpt.family == "classifier":
        pairs = [ckpt.tokenizer.encode_pair(text) for text in TEXTS]
        ids, _ = pad_batch([ids for ids, _ in pairs], ckpt.config.pad_id)
        segments, _ = pad_batch([seg for _, seg in pairs], 0)
        return ckpt.model(ids.to(device), segments.to(device))
    ids, _ = pad_batch(ckpt.encode_prompts(TEXTS), ckpt.config.pad_id)
    if ckpt.family == "causal_lm":
        return ckpt.model(ids.to(device))
    tgt = torch.tensor([[ckpt.config.bos_id, *ckpt.tokenizer.encode("borrar archivo 7")]] * len(TEXTS))
    return ckpt.model(ids.to(device), tgt.to(device))


@pytest.mark.parametrize("name", [LM, MT, CLS])
@pytest.mark.parametrize("target", targets())
def test_checkpoint_loads_onto_the_device(target, name, models_dir: Path):
    ckpt = load_checkpoint(models_dir / name, device=target.device, dtype=target.dtype)
    assert {(p.device.type, p.dtype) for p in ckpt.model.parameters()} == {(target.device, target.dtype)}
    reference = load_checkpoint(models_dir / name, device="cpu", dtype=torch.float64)
    with torch.inference_mode():
        assert_close(_probe(ckpt), _probe(reference), target.tol, f"{name} logits")
    # dtype "auto": bfloat16 on CUDA (float16 where the GPU has no bfloat16), float32 on the CPU
    auto = next(load_checkpoint(models_dir / name, device=target.device).model.parameters()).dtype
    if target.device == "cuda":
        assert auto == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    else:
        assert auto == torch.float32


@pytest.mark.parametrize("family", ["causal_lm", "seq2seq", "classifier"])
@pytest.mark.parametrize("target", targets(torch.float32))
def test_a_few_training_steps_lower_the_loss(target: Target, family: str, tmp_path: Path):
    """float32 weights; on CUDA the trainer's forwards run under bfloat16 autocast (seen in the Linears' outputs)."""
    name = next(n for n, f in FAMILIES.items() if f == family)
    train, valid = write_data(tmp_path / "data", name)
    out = tmp_path / "ckpt"
    seen: set[torch.dtype] = set()

    def record(module: nn.Module, args, output) -> None:
        if module.training and isinstance(module, nn.Linear):
            seen.add(output.dtype)

    handle = nn.modules.module.register_module_forward_hook(record)
    try:
        run_training("train", family, "--train", str(train), "--valid", str(valid), "--out", str(out), *SIZES,
                     "--max-len", MAX_LEN[name], "--max-steps", "30", *BASE_LOOP, *LOOP, "--device", target.device)
    finally:
        handle.remove()

    losses = [float(row["loss"]) for row in log_rows(state_dir_for(out))]
    assert len(losses) == 30
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    assert seen == ({torch.bfloat16} if target.device == "cuda" else {torch.float32})
    ckpt = load_checkpoint(out, device="cpu")
    assert all(torch.isfinite(p).all() for p in ckpt.model.parameters())
