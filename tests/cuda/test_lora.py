"""LoRA on each target: merged equals unmerged, and a batch mixing adapters per row equals each row alone."""

from __future__ import annotations

import pytest
import torch

from model.decoding import GenerationConfig
from model.lora import LoRAConfig, add_adapter, merge_adapter, unmerge_adapter, use_adapters
from tests.cuda.conftest import FAMILIES, assert_close, assert_same_tokens, targets
from tests.model.conftest import random_ids, tiny_causal_lm
from tests.model.helpers import PROMPTS

CONFIG = LoRAConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "fc1"))


def with_adapters(make, names: tuple[str, ...] = ("a", "b")) -> torch.nn.Module:
    """A tiny model (float32, CPU) with adapters whose B is random, so that they change outputs (as in
    tests/model/test_generation.py)."""
    model = make()
    for i, name in enumerate(names):
        add_adapter(model, name, CONFIG, seed=i)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "lora_B") and name in m.lora_B:
                    m.lora_B[name].weight.normal_(std=0.5)  # seeded by make()
    return model


def logits(model: torch.nn.Module, ids: torch.Tensor, adapters) -> torch.Tensor:
    with torch.inference_mode(), use_adapters(model, adapters):
        return model(ids)


@pytest.mark.parametrize("target", targets())
def test_merged_equals_unmerged(target):
    ids = random_ids(4, 10)
    reference = with_adapters(tiny_causal_lm).double()
    model = target.place(with_adapters(tiny_causal_lm))
    x = target.tensor(ids)
    selections = ["a", None, "b", ["a", None, "b", "a"]]
    before = [logits(model, x, s) for s in selections]
    for s, got in zip(selections, before, strict=True):
        assert_close(got, logits(reference, ids, s), target.tol, f"unmerged {s} vs float64")
    assert (before[0] - before[1]).abs().max() > target.tol * before[1].abs().max()  # "a" changes logits

    merge_adapter(model, "a")
    for s, want in zip(selections, before, strict=True):
        assert_close(logits(model, x, s), want, target.tol, f"merged 'a', selecting {s}")
    unmerge_adapter(model)
    for s, want in zip(selections, before, strict=True):
        assert_close(logits(model, x, s), want, target.tol, f"unmerged again, selecting {s}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target", targets())
def test_mixed_adapter_batch_equals_each_row_alone(target, family):
    make, generate, logits_at = FAMILIES[family]
    model = target.place(with_adapters(make))
    rows = ["a", None, "b", "a"]
    config = GenerationConfig(strategy="beam", num_beams=2, max_new_tokens=8)
    batched = generate(model, PROMPTS, config, adapters=rows)
    changed = 0
    for prompt, row, hyps in zip(PROMPTS, rows, batched, strict=True):
        alone = generate(model, [prompt], config, adapters=row)[0]
        with use_adapters(model, row):
            step_logits = logits_at(model, prompt)
            for got, want in zip(hyps, alone, strict=True):
                assert_same_tokens(target, got.tokens, want.tokens, model.config.eos_id, step_logits)
        changed += generate(model, [prompt], config)[0][0].tokens != alone[0].tokens
    assert changed > 0  # the adapters really change some outputs
