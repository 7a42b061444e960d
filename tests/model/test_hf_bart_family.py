"""BART, mBART, M2M100 and NLLB-200 directories (model/hf/bart.py, mbart.py, m2m100.py) as our seq2seq, built and
saved by `transformers` itself.

Random weights of each class and config variant (tests/model/hf_bart.py): logits equal to `transformers` in float32
and float64 on a right-padded batch; greedy and beam-4 under each generation_config.json's defaults (BART's as
bart-large-cnn's: min_length, no_repeat_ngram_size, length_penalty, early_stopping, forced BOS and EOS) token for
token equal to generate() on a padded batch, with a forced first token per row (mixed target languages) through
the path that serves the model (the native decoding step where the kernels are built); the service's loader
(load_hf_checkpoint); and the config fields we cannot express refused by name.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import native
from model.checkpoint import load_checkpoint, load_hf_checkpoint
from model.config import CausalLMConfig
from model.fast_step import plan_for
from model.generation import generate_seq2seq
from model.generation_config import GenerationConfig
from model.hf import HFImportError, load_hf_model
from model.hf.generation import GENERATION_FILE, generation_rules
from tests.hf_compare import ATOL, best_tokens, strip
from tests.hf_directories import with_tokenizer
from tests.model.hf_bart import (
    BOS,
    EOS,
    LANGUAGES,
    PAD,
    SOURCES,
    VARIANTS,
    VOCAB,
    ForcedFirstPerRow,
    hf_model,
    padded_sources,
    save_variant,
)
from training.import_cmd import import_hf

transformers = pytest.importorskip("transformers")

# each variant's generation_config.json beyond transformers' own: BART's is bart-large-cnn's (scaled down)
# (seed, EOS boost) per variant: outputs that end both by EOS and at the length limit
ENDINGS = {"bart": (2, 3.0), "bart-scaled-untied": (0, 3.0), "mbart": (0, 3.0), "mbart-bos-start-untied": (0, 2.0),
           "m2m100": (0, 3.0), "nllb": (2, 3.0)}
RULES = {"num_beams": 4, "max_length": 14, "forced_eos_token_id": EOS}
GENERATION = {
    "bart": {"min_length": 6, "no_repeat_ngram_size": 3, "length_penalty": 2.0, "early_stopping": True,
             "forced_bos_token_id": BOS},
    "bart-scaled-untied": {"min_length": 3, "length_penalty": 1.0, "forced_bos_token_id": BOS},
    "mbart": {"length_penalty": 0.6, "early_stopping": "never"},
    "mbart-bos-start-untied": {"no_repeat_ngram_size": 2, "min_length": 4},
    "m2m100": {},
    "nllb": {"length_penalty": 1.5, "min_length": 3},
}


def _start(directory) -> int:
    config = json.loads((directory / "config.json").read_text())
    return config["decoder_start_token_id"] if config.get("decoder_start_token_id") is not None else BOS


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(tmp_path, variant):
    directory = save_variant(tmp_path / variant, variant)
    src, mask = padded_sources()
    tokens = torch.randint(3, VOCAB, (len(SOURCES), 9), generator=torch.Generator().manual_seed(0))
    tgt = torch.cat([torch.full((len(SOURCES), 1), _start(directory)), tokens], dim=1)
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, config = load_hf_model(directory, dtype)
        with torch.no_grad():
            theirs = hf_model(directory, variant, dtype)(input_ids=src, attention_mask=mask,
                                                         decoder_input_ids=tgt).logits
            diff = float((ours(src, tgt) - theirs).abs().max())
        assert diff < tolerance, (dtype, diff)
    tied = VARIANTS[variant][2].get("tie_word_embeddings", True)
    assert (config.bos_id, config.eos_id, config.pad_id) == (_start(directory), EOS, PAD)
    assert config.src_vocab_size == (None if tied else VOCAB)
    assert config.shared_positions == variant.startswith(("m2m100", "nllb"))  # BART's: a table per stack


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_generation_equals_generate_with_forced_first_tokens(tmp_path, variant, strategy):
    """generation_config.json's defaults on both sides; BART forces <s> on every row (its forced_bos_token_id), the
    multilingual ones a target language per row, mixed in one padded batch."""
    directory = save_variant(tmp_path / variant, variant, *ENDINGS[variant])
    saved = json.loads((directory / GENERATION_FILE).read_text())
    (directory / GENERATION_FILE).write_text(json.dumps({**saved, **RULES, **GENERATION[variant]}))
    ours, config = load_hf_model(directory)
    assert plan_for(ours.decoder).native is not None or native.kernels() is None  # the path that serves it
    rules = generation_rules(directory, config)
    greedy = {"strategy": "greedy"} if strategy == "greedy" else {}
    ours_config = GenerationConfig(**rules.imposed(), **(rules.defaults | greedy), eos_token_id=EOS)
    src, mask = padded_sources()
    hf_kwargs = {"num_beams": 1} if strategy == "greedy" else {}
    if rules.forced_bos is not None:
        forced = [rules.forced_bos] * len(SOURCES)
    else:
        forced = [LANGUAGES[i % len(LANGUAGES)] for i in range(len(SOURCES))]
        hf_kwargs["logits_processor"] = transformers.LogitsProcessorList(
            [ForcedFirstPerRow(forced, 1 if strategy == "greedy" else 4)])
    mine = best_tokens(generate_seq2seq(ours, SOURCES, ours_config, forced_first=forced))
    with torch.no_grad():
        theirs = hf_model(directory, variant).generate(input_ids=src, attention_mask=mask, **hf_kwargs).tolist()
    assert all(seq[0] == config.bos_id for seq in theirs)
    assert [strip(seq, 1, EOS) for seq in theirs] == mine
    assert [o[0] for o in mine] == forced
    assert len({len(o) for o in mine}) > 1 and ours_config.max_new_tokens - 1 in map(len, mine)  # both endings


def test_the_service_loaders_read_the_model_and_its_generation_rules(tmp_path):
    """load_hf_checkpoint (the service's path) and an imported checkpoint (python -m training import, then
    load_checkpoint: one token embedding, a position table per stack): bart-large-cnn's generation_config.json as
    request defaults, its forced <s> as the rows' forced first token, the logits those of load_hf_model's model."""
    directory = with_tokenizer(save_variant(tmp_path / "bart", "bart"), VOCAB)
    saved = json.loads((directory / GENERATION_FILE).read_text())
    (directory / GENERATION_FILE).write_text(json.dumps({**saved, **RULES, **GENERATION["bart"]}))
    checkpoint = load_hf_checkpoint(directory, device="cpu")
    rules = checkpoint.generation
    assert rules.forced_bos == BOS and rules.forced_eos and rules.no_repeat_ngram_size == 3
    assert rules.defaults == {"strategy": "beam", "num_beams": 4, "max_new_tokens": 13, "min_new_tokens": 5,
                              "length_penalty": 2.0, "early_stopping": True}
    imported = load_checkpoint(import_hf(directory, tmp_path / "imported"), device="cpu")
    assert imported.generation == rules
    assert imported.model.src_embed.tokens.weight is imported.model.tgt_embed.tokens.weight
    src, _ = padded_sources()
    tgt = torch.full((len(SOURCES), 1), EOS)
    with torch.no_grad():
        expected = load_hf_model(directory)[0](src, tgt)
        for loaded in (checkpoint, imported):
            assert torch.equal(loaded.model(src, tgt), expected)


@pytest.mark.parametrize(
    ("variant", "overrides", "says"),
    [
        ("bart", {"normalize_before": True}, "normalize_before=True is not supported for BART (pre-LN"),
        ("bart", {"add_final_layer_norm": True}, "add_final_layer_norm=True is not supported for BART"),
        ("mbart", {"add_final_layer_norm": False}, "add_final_layer_norm=False is not supported for mBART"),
        ("mbart", {"extra_pos_embeddings": 0}, "extra_pos_embeddings=0 is not supported for mBART"),
        ("m2m100", {"decoder_ffn_dim": 48}, "decoder_ffn_dim=48 differs from encoder_ffn_dim=64"),
        ("m2m100", {"activation_function": "quick_gelu"}, "activation_function='quick_gelu' is not supported"),
        ("mbart", {"decoder_start_token_id": 500}, "decoder_start_token_id=500 is outside the vocabulary"),
    ],
)
def test_config_fields_we_cannot_express_are_refused_by_name(tmp_path, variant, overrides, says):
    directory = save_variant(tmp_path / variant, variant)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(HFImportError, match=says.replace("(", r"\(")):
        load_hf_model(directory)


def test_a_target_prefix_continues_from_the_forced_token(tmp_path):
    """A row with a target prefix is not forced: the prefix must start with its forced token, and greedy decoding
    continues it as it would have continued the forced token (one new token fewer: the prefix's is not counted)."""
    variant = "m2m100"
    directory = save_variant(tmp_path / variant, variant, *ENDINGS[variant])
    model, _ = load_hf_model(directory)
    forced = [LANGUAGES[i % len(LANGUAGES)] for i in range(len(SOURCES))]
    config = GenerationConfig(strategy="greedy", max_new_tokens=10, eos_token_id=EOS)
    whole = best_tokens(generate_seq2seq(model, SOURCES, config, forced_first=forced))
    prefixed = best_tokens(generate_seq2seq(model, SOURCES, dataclasses.replace(config, max_new_tokens=9),
                                            targets=[[t] for t in forced], forced_first=forced))
    assert prefixed == [w[1:] for w in whole]
    with pytest.raises(ValueError, match="source 0: its target prefix must start with its forced first token"):
        generate_seq2seq(model, SOURCES, config, targets=[[BOS]] * len(SOURCES), forced_first=forced)


def test_tied_copies_that_differ_and_generation_rules_we_cannot_apply_are_refused(tmp_path):
    (tmp_path / GENERATION_FILE).write_text(json.dumps({"min_length": 5}))
    with pytest.raises(HFImportError, match="min_length=5 is not supported for a decoder-only model"):
        generation_rules(tmp_path, CausalLMConfig())  # there min_length counts each prompt
    directory = save_variant(tmp_path / "bart", "bart")
    _, config = load_hf_model(directory)
    (directory / GENERATION_FILE).write_text(json.dumps({"decoder_start_token_id": BOS}))
    with pytest.raises(HFImportError, match="decoder_start_token_id=0 differs from the model's"):
        generation_rules(directory, config)
    (directory / GENERATION_FILE).write_text(json.dumps({"forced_bos_token_id": VOCAB}))
    with pytest.raises(HFImportError, match=f"forced_bos_token_id={VOCAB} is not supported"):
        generation_rules(directory, config)
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.shared.weight"] + 1
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFImportError, match="'lm_head.weight' differs from the decoder's token embedding"):
        load_hf_model(directory)
