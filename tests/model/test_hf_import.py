"""Hugging Face directories as our models (model/hf): GPT-2 built and saved by `transformers` itself.

Random weights (tests.hf_compare.randomize: LayerNorms included, so a transposed or misplaced tensor shows),
then logits equal to `transformers` in float32 and float64, greedy and beam-4 generation token for token on
a padded batch, and the config fields we cannot express refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

from model.generation import generate_causal
from model.hf import HFImportError, is_hf_directory, load_hf_model
from tests.hf_compare import (
    ATOL,
    DECODINGS,
    assert_varied,
    best_tokens,
    decoding,
    repeats_ngram,
    strip,
)
from tests.model.hf_gpt2 import EOS, GPT2, PROMPTS, hf_model, save_gpt2

transformers = pytest.importorskip("transformers")

GPT2_VARIANTS = {
    "tied-gelu_new": {},
    "untied-gelu-inner": {"tie_word_embeddings": False, "activation_function": "gelu", "n_inner": 40},
    "relu-eps": {"activation_function": "relu", "layer_norm_epsilon": 1e-6},
}


@pytest.mark.parametrize("overrides", GPT2_VARIANTS.values(), ids=GPT2_VARIANTS.keys())
def test_gpt2_logits_equal_transformers(tmp_path, overrides):
    directory = save_gpt2(tmp_path / "gpt2", **overrides)
    assert is_hf_directory(directory)
    ids = torch.tensor([PROMPTS[1] * 6])  # 42 positions
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, config = load_hf_model(directory, dtype)
        with torch.no_grad():
            diff = (ours(ids) - hf_model(directory, dtype)(input_ids=ids).logits).abs().max()
        assert diff < tolerance, (dtype, float(diff))
    assert (config.family, config.eos_id, config.max_len) == ("causal_lm", EOS, GPT2["n_positions"])


def test_a_gpt2_base_model_saved_alone_loads_with_its_tied_head(tmp_path):
    """GPT2Model has no lm_head and no "transformer." prefix; its head is the token embedding."""
    directory = save_gpt2(tmp_path / "base", head=False)
    ours, _ = load_hf_model(directory)
    lm = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()  # ties lm_head to wte as it loads
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert (ours(ids) - lm(input_ids=ids).logits).abs().max() < ATOL


@pytest.mark.parametrize("strategy", DECODINGS)
def test_gpt2_generation_equals_transformers_on_a_padded_batch(tmp_path, strategy):
    directory = save_gpt2(tmp_path / "gpt2", seed=5, eos_boost=2.5)  # both endings: EOS and the length limit
    ours_config, hf_kwargs = decoding(strategy)
    ours, _ = load_hf_model(directory)
    mine = best_tokens(generate_causal(ours, PROMPTS, ours_config))
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[EOS] * (width - len(p)) + p for p in PROMPTS])  # left padding, as generate() wants
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        theirs = hf_model(directory).generate(input_ids=ids, attention_mask=mask, pad_token_id=EOS, **hf_kwargs)
    assert [strip(seq, width, EOS) for seq in theirs.tolist()] == mine
    assert_varied(mine)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
        ({"scale_attn_weights": False}, "scale_attn_weights=False is not supported"),
        ({"add_cross_attention": True}, "add_cross_attention=True is not supported"),
        ({"activation_function": "quick_gelu"}, "activation_function='quick_gelu' is not supported"),
        ({"eos_token_id": 500}, "eos_token_id=500 is outside the vocabulary"),
    ],
)
def test_gpt2_config_fields_we_cannot_express_are_refused_by_name(tmp_path, overrides, says):
    directory = save_gpt2(tmp_path / "gpt2")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(HFImportError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_hf_model(directory)


class _Payload:
    """Unpickling this creates a file: proof that nobody unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def test_other_directories_are_refused_with_the_reason(tmp_path):
    directory = save_gpt2(tmp_path / "gpt2")
    config = json.loads((directory / "config.json").read_text())
    cases = {
        "model_type='falcon' is not supported": {**config, "model_type": "falcon"},
        r"architectures=\['GPT2ForSequenceClassification'\] are not supported": {
            **config, "architectures": ["GPT2ForSequenceClassification"]},
    }
    for says, changed in cases.items():
        (directory / "config.json").write_text(json.dumps(changed))
        with pytest.raises(HFImportError, match=says):
            load_hf_model(directory)
    (directory / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "marker"
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(HFImportError, match="pytorch_model.bin: pickle weights are not loaded; convert them"):
        load_hf_model(directory)
    assert not marker.exists()
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(HFImportError, match="model.safetensors"):
        load_hf_model(directory)
    (directory / "config.json").write_text("[" * 100_000)
    with pytest.raises(HFImportError, match="config.json: not valid JSON"):
        load_hf_model(directory)


def test_sharded_weights_load_as_their_index_maps_them(tmp_path):
    """save_pretrained's shards (model-0000k-of-0000n.safetensors + the index) give the unsharded model's logits;
    an index naming a file outside the directory, a tensor in another shard, or a missing one is refused."""
    whole = save_gpt2(tmp_path / "whole", seed=3)
    sharded = tmp_path / "sharded"
    hf_model(whole).save_pretrained(sharded, max_shard_size="40KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(load_hf_model(sharded)[0](ids), load_hf_model(whole)[0](ids))
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    for change, says in [({first: "../whole/model.safetensors"}, "is not a .safetensors file of this directory"),
                         ({first: shards[-1] if index["weight_map"][first] != shards[-1] else shards[0]},
                          "which model.safetensors.index.json places elsewhere"),
                         ({"transformer.extra.weight": index["weight_map"][first]}, "1 tensors are in no shard")]:
        index_path.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], **change}}))
        with pytest.raises(HFImportError, match=says):
            load_hf_model(sharded)


@pytest.mark.parametrize("strategy", DECODINGS)
def test_gpt2_repetition_penalty_gives_generates_tokens(tmp_path, strategy):
    """generation_config.json's repetition_penalty (with and without the n-gram rule) over prompt + output, as
    generate() applies it to greedy's logits and to beam search's log-probabilities; the penalty changes outputs."""
    from model.hf.generation import generation_rules

    directory = save_gpt2(tmp_path / "gpt2", seed=5, eos_boost=1.5)
    model, config = load_hf_model(directory)
    ours_config, hf_kwargs = decoding(strategy)
    changed = 0
    for rules in ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3}):
        (directory / "generation_config.json").write_text(json.dumps({**rules, "bos_token_id": 1, "eos_token_id": EOS}))
        ruled = dataclasses.replace(ours_config, **generation_rules(directory, config).imposed())
        assert ruled.repetition_penalty == rules["repetition_penalty"]
        for prompt in PROMPTS:
            (mine,) = best_tokens(generate_causal(model, [prompt], ruled))
            with torch.no_grad():
                theirs = hf_model(directory).generate(input_ids=torch.tensor([prompt]), pad_token_id=EOS, **hf_kwargs)
            assert strip(theirs[0].tolist(), len(prompt), EOS) == mine
            (plain,) = best_tokens(generate_causal(model, [prompt], ours_config))
            changed += plain != mine
    assert changed > 0


@pytest.mark.parametrize("strategy", DECODINGS)
def test_gpt2_no_repeat_ngram_size_counts_the_prompt_as_generate_does(tmp_path, strategy):
    """generation_config.json's no_repeat_ngram_size bans n-grams of prompt + output; one prompt at a time,
    since generate() counts a left-padded batch's padding too."""
    from model.hf.generation import generation_rules

    directory = save_gpt2(tmp_path / "gpt2", seed=5, eos_boost=1.5)
    rules = {"no_repeat_ngram_size": 2, "bos_token_id": 1, "eos_token_id": EOS}
    (directory / "generation_config.json").write_text(json.dumps(rules))
    model, config = load_hf_model(directory)
    ours_config, hf_kwargs = decoding(strategy)
    ours_config = dataclasses.replace(ours_config, **generation_rules(directory, config).imposed())
    repeats = 0
    for prompt in PROMPTS:
        (mine,) = best_tokens(generate_causal(model, [prompt], ours_config))
        with torch.no_grad():
            theirs = hf_model(directory).generate(input_ids=torch.tensor([prompt]), pad_token_id=EOS, **hf_kwargs)
        assert strip(theirs[0].tolist(), len(prompt), EOS) == mine
        (unruled,) = best_tokens(generate_causal(model, [prompt],
                                                 dataclasses.replace(ours_config, no_repeat_ngram_size=0)))
        repeats += repeats_ngram(prompt + unruled, 2)
    assert repeats > 0  # the rule changes something
