"""Input-major weights (model.layout) change strides only: same outputs, same checkpoints, LoRA still merges."""

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from model.checkpoint import load_checkpoint, save_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.layout import use_input_major_weights
from model.lora import LoRAConfig, add_adapter, merge_adapter, unmerge_adapter, use_adapters
from model.quantize import quantize_int8
from model.tokenizer import Tokenizer
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_classifier, tiny_seq2seq

SOURCES = [[9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21]]
CONFIGS = [
    GenerationConfig(max_new_tokens=8),
    GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=8),
]


def untied_linears(model: nn.Module) -> list[nn.Linear]:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [m for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) not in embeddings]


def relaid(model: nn.Module) -> nn.Module:
    other = copy.deepcopy(model)
    assert use_input_major_weights(other) == len(untied_linears(other))
    return other


def test_every_untied_linear_weight_is_input_major_with_its_shape_and_values():
    model = tiny_causal_lm()
    other = relaid(model)
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name
    linears = untied_linears(other)
    assert len(linears) == sum(isinstance(m, nn.Linear) for m in other.modules()) - 1  # all but the tied head
    assert all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert other.lm_head.weight is other.embed.tokens.weight  # the tie survives
    assert other.lm_head.weight.is_contiguous()  # embedding lookups read its rows
    assert use_input_major_weights(other) == 0  # idempotent


@pytest.mark.parametrize("config", CONFIGS, ids=["greedy", "beam"])
def test_generation_is_unchanged(config):
    lm, mt = tiny_causal_lm().double(), tiny_seq2seq().double()
    prompts = [s[:3] for s in SOURCES]
    want = (generate_causal(lm, prompts, config), generate_seq2seq(mt, SOURCES, config))
    got = (generate_causal(relaid(lm), prompts, config), generate_seq2seq(relaid(mt), SOURCES, config))
    for g, w in zip(got, want, strict=True):
        assert [[h.tokens for h in hs] for hs in g] == [[h.tokens for h in hs] for hs in w]
        assert [h.score for hs in g for h in hs] == pytest.approx([h.score for hs in w for h in hs], abs=1e-9)


def test_logits_match_the_float64_reference():
    ids = random_ids(5, 12)
    reference = tiny_classifier().double()(ids)
    got = relaid(tiny_classifier())(ids)
    torch.testing.assert_close(got.double(), reference, atol=1e-5, rtol=0)


def test_saved_checkpoint_is_byte_identical_and_loads(tmp_path):
    tokenizer = Tokenizer.train(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)
    model = tiny_causal_lm(vocab_size=tokenizer.vocab_size)
    plain = save_checkpoint(tmp_path / "plain", model, tokenizer)
    other = save_checkpoint(tmp_path / "relaid", relaid(model), tokenizer)
    a, b = load_file(str(plain / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded = load_checkpoint(other, device="cpu").model
    use_input_major_weights(loaded)
    ids = random_ids(2, 6)
    torch.testing.assert_close(loaded(ids), model(ids), atol=1e-6, rtol=0)


def test_lora_merge_and_unmerge_on_input_major_weights():
    base = tiny_causal_lm().double()
    add_adapter(base, "x", LoRAConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "fc1")), seed=3)
    for p in base.parameters():  # a non-zero B so the adapter changes the output
        if p.shape[-1] == 4:
            torch.nn.init.normal_(p, std=0.5)
    model = relaid(base)
    ids = random_ids(3, 7)
    with torch.no_grad():
        plain = model(ids)
        with use_adapters(model, "x"):
            unmerged = model(ids)
        q_proj = model.decoder.layers[0].self_attn.q_proj
        before = q_proj.base.weight.clone()
        merge_adapter(model, "x")
        assert not torch.equal(q_proj.base.weight, before) and q_proj.base.weight.t().is_contiguous()
        with use_adapters(model, "x"):
            merged = model(ids)
        unmerge_adapter(model)
        restored = model(ids)
    assert not torch.allclose(unmerged, plain)
    torch.testing.assert_close(merged, unmerged, atol=1e-10, rtol=0)
    torch.testing.assert_close(restored, plain, atol=1e-10, rtol=0)


def test_quantised_layers_and_other_devices_are_left_alone():
    model = tiny_seq2seq()
    quantize_int8(model)
    assert use_input_major_weights(model) == 0
    meta = nn.Linear(4, 4, device="meta")
    assert use_input_major_weights(meta) == 0
