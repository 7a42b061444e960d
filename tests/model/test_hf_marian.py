"""MarianMTModel directories (the OPUS-MT layout) as our seq2seq (model/hf/marian.py), built and saved by
`transformers` itself.

Random weights (tests.hf_compare.randomize, plus a random final_logits_bias), OPUS-MT's ids (EOS 0, the pad
id last and the decoder start), then logits equal to `transformers` in float32 and float64 on a right-padded
batch, greedy and beam-4 generation token for token, and the config fields we cannot express refused by name.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import native
from model.fast_step import plan_for
from model.generation import generate_seq2seq
from model.hf import HFImportError, load_hf_model
from model.hf.marian import permutation
from model.layers import sinusoidal_table
from model.quantize import quantize_int8
from tests.hf_compare import (
    ATOL,
    DECODINGS,
    assert_varied,
    best_tokens,
    decoding,
    repeats_ngram,
    strip,
)
from tests.model.hf_marian import EOS, MARIAN, PAD, SOURCES, VOCAB, hf_model, max_diff, padded_sources, save_marian

transformers = pytest.importorskip("transformers")

VARIANTS = {  # OPUS-MT's is the first
    "swish-scaled-shared": {},
    "gelu-unscaled-untied": {"activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": False},
    "relu-separate-vocabularies": {"activation_function": "relu", "share_encoder_decoder_embeddings": False,
                                   "decoder_vocab_size": 112},
    "silu-shared-untied": {"activation_function": "silu", "tie_word_embeddings": False},
}


def _kernels() -> bool:
    """Whether our C++ kernels (the native decoding step, int8) run here."""
    return native.kernels() is not None


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_marian_logits_equal_transformers(tmp_path, overrides):
    directory = save_marian(tmp_path / "marian", **overrides)
    src, mask = padded_sources()
    vocab = overrides.get("decoder_vocab_size", VOCAB)
    tokens = torch.randint(1, vocab - 1, (len(SOURCES), 9), generator=torch.Generator().manual_seed(0))
    tgt = torch.cat([torch.full((len(SOURCES), 1), PAD), tokens], dim=1)  # the decoder starts from the pad id
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, config = load_hf_model(directory, dtype)
        with torch.no_grad():
            theirs = hf_model(directory, dtype)(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
            diff = max_diff(ours(src, tgt), theirs)
        assert diff < tolerance, (dtype, diff)
    assert (config.family, config.bos_id, config.eos_id, config.pad_id) == ("seq2seq", PAD, EOS, PAD)
    assert config.src_vocab_size == (None if not overrides else VOCAB)  # one embedding only when shared and tied


@pytest.mark.parametrize("strategy", DECODINGS)
def test_marian_generation_equals_transformers_on_a_padded_batch(tmp_path, strategy):
    """OPUS-MT's variant (swish: the native decoding step's SiLU; the head bias in the few-rows GEMV)."""
    directory = save_marian(tmp_path / "marian", seed=10, eos_boost=2.5)  # both endings: EOS and the length limit
    ours_config, hf_kwargs = decoding(strategy)
    ours, _ = load_hf_model(directory)
    assert plan_for(ours.decoder).native is not None or not _kernels()
    mine = best_tokens(generate_seq2seq(ours, SOURCES, dataclasses.replace(ours_config, eos_token_id=EOS)))
    src, mask = padded_sources()
    with torch.no_grad():
        theirs = hf_model(directory).generate(input_ids=src, attention_mask=mask, **hf_kwargs)
    assert all(seq[0] == PAD for seq in theirs.tolist())  # the decoder starts from the pad id
    assert [strip(seq, 1, EOS) for seq in theirs.tolist()] == mine
    assert_varied(mine)


def test_the_head_bias_is_in_every_logits_path(tmp_path):
    """decode_step's head (the few-rows GEMV at 1 row, the packed GEMM beyond 4) and the int8 head add it."""
    directory = save_marian(tmp_path / "marian")
    ours, config = load_hf_model(directory)
    assert config.head_bias and ours.lm_head.bias.isneginf().sum() == 1
    src, _ = padded_sources()
    for rows in (src[:1], src):
        with torch.no_grad():
            first, _ = ours.start(rows, capacity=4)
            forward = ours(rows, torch.full((len(rows), 1), PAD))[:, 0]
        assert max_diff(first, forward) < 1e-5
    if not _kernels():
        return
    unbiased, _ = load_hf_model(directory)
    bias = unbiased.lm_head.bias.detach().clone()
    with torch.no_grad():
        unbiased.lm_head.bias.zero_()
    for model in (ours, unbiased):  # the same int8 weights: only the bias differs
        quantize_int8(model)
    for rows in (src[:1], src):
        with torch.no_grad():
            biased, plain = (model.start(rows, capacity=4)[0] for model in (ours, unbiased))
        assert max_diff(biased, plain + bias) < 1e-5


def test_stored_position_tables_load_when_they_are_marians(tmp_path):
    """Old saves hold the sinusoidal tables, which transformers then adds as stored."""
    directory = save_marian(tmp_path / "marian")
    tensors = load_file(directory / "model.safetensors")
    d, n = MARIAN["d_model"], MARIAN["max_position_embeddings"]
    table = sinusoidal_table(n, d)[:, permutation(d)]
    for side in ("encoder", "decoder"):
        tensors[f"model.{side}.embed_positions.weight"] = table.clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    load_hf_model(directory)
    tensors["model.decoder.embed_positions.weight"] = table.roll(1, dims=0)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFImportError, match="'model.decoder.embed_positions.weight' is not Marian's sinusoidal"):
        load_hf_model(directory)


def test_tied_copies_that_differ_are_refused(tmp_path):
    directory = save_marian(tmp_path / "marian", share_encoder_decoder_embeddings=False)
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.decoder.embed_tokens.weight"] + 1
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFImportError, match="'lm_head.weight' differs from the decoder's token embedding"):
        load_hf_model(directory)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"normalize_before": True}, "normalize_before=True is not supported for Marian (pre-LN: transformers"),
        ({"static_position_embeddings": False}, "static_position_embeddings=False is not supported"),
        ({"decoder_ffn_dim": 48}, "decoder_ffn_dim=48 differs from encoder_ffn_dim=64"),
        ({"decoder_vocab_size": 80}, "decoder_vocab_size=80 differs from vocab_size=96"),
        ({"activation_function": "quick_gelu"}, "activation_function='quick_gelu' is not supported"),
        ({"decoder_start_token_id": 500}, "decoder_start_token_id=500 is outside the vocabulary"),
    ],
)
def test_marian_config_fields_we_cannot_express_are_refused_by_name(tmp_path, overrides, says):
    directory = save_marian(tmp_path / "marian")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(HFImportError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_hf_model(directory)


def test_generation_config_rules_we_cannot_apply_are_refused_by_name(tmp_path):
    """bad_words_ids of one token each, a forced EOS equal to the model's EOS and no_repeat_ngram_size are applied,
    num_beams / max_length / early_stopping become request defaults (model/hf/generation.py); longer bad words,
    another forced token or a rule generate() applies that we do not are refused, naming the field."""
    from model.hf.generation import GENERATION_FILE, generation_rules

    directory = save_marian(tmp_path / "marian")
    _, config = load_hf_model(directory)
    rules = {"bad_words_ids": [[PAD], [EOS]], "forced_eos_token_id": EOS, "no_repeat_ngram_size": 3,
             "renormalize_logits": True, "num_beams": 6, "max_length": 40, "repetition_penalty": 1.0}
    (directory / GENERATION_FILE).write_text(json.dumps(rules))
    applied = generation_rules(directory, config)
    assert applied.banned_token_ids == (PAD,) and applied.forced_eos  # EOS itself is never banned
    assert (applied.no_repeat_ngram_size, applied.renormalize) == (3, True)
    assert applied.defaults == {"strategy": "beam", "num_beams": 6, "max_new_tokens": 39, "early_stopping": False}
    for bad, says in [({"bad_words_ids": [[5, 6]]}, "bad_words_ids must be single tokens"),
                      ({"forced_eos_token_id": 3}, "forced_eos_token_id=3 differs"),
                      ({"encoder_repetition_penalty": 1.2}, "encoder_repetition_penalty=1.2 is not supported"),
                      ({"repetition_penalty": 0}, "repetition_penalty must be finite and > 0"),
                      ({"do_sample": True, "num_beams": 2}, "do_sample with num_beams=2"),
                      ({"no_repeat_ngram_size": "3"}, "no_repeat_ngram_size must be an int"),
                      ({"early_stopping": "sometimes"}, "early_stopping must be")]:
        (directory / GENERATION_FILE).write_text(json.dumps(bad))
        with pytest.raises(HFImportError, match=f"{GENERATION_FILE}: {says}"):
            generation_rules(directory, config)


@pytest.mark.parametrize("strategy", DECODINGS)
def test_a_repetition_penalty_gives_generates_tokens(tmp_path, strategy):
    """generation_config.json's repetition_penalty over the decoder's tokens (start token + output), on a padded
    batch, as generate() applies it; it changes some output."""
    from model.hf.generation import GENERATION_FILE, generation_rules

    directory = save_marian(tmp_path / "marian", seed=10, eos_boost=1.5)
    model, config = load_hf_model(directory)
    ours_config, hf_kwargs = decoding(strategy)
    base = dataclasses.replace(ours_config, eos_token_id=EOS)
    (directory / GENERATION_FILE).write_text(json.dumps({"repetition_penalty": 2.0, "decoder_start_token_id": PAD,
                                                         "eos_token_id": EOS, "pad_token_id": PAD}))
    ruled = dataclasses.replace(base, **generation_rules(directory, config).imposed())
    mine = best_tokens(generate_seq2seq(model, SOURCES, ruled))
    src, mask = padded_sources()
    with torch.no_grad():
        theirs = hf_model(directory).generate(input_ids=src, attention_mask=mask, **hf_kwargs)
    assert [strip(seq, 1, EOS) for seq in theirs.tolist()] == mine
    assert mine != best_tokens(generate_seq2seq(model, SOURCES, base))


@pytest.mark.parametrize("strategy", DECODINGS)
def test_the_generation_config_rules_give_generates_tokens(tmp_path, strategy):
    """no_repeat_ngram_size, renormalize_logits, the banned pad and the forced EOS from generation_config.json, as
    generate() applies them by itself; without the n-gram rule our outputs repeat bigrams (the rule is exercised)."""
    from model.hf.generation import GENERATION_FILE, generation_rules

    directory = save_marian(tmp_path / "marian", seed=10, eos_boost=1.5)
    rules = {"no_repeat_ngram_size": 2, "renormalize_logits": True, "bad_words_ids": [[PAD]],
             "forced_eos_token_id": EOS, "decoder_start_token_id": PAD, "eos_token_id": EOS, "pad_token_id": PAD}
    (directory / GENERATION_FILE).write_text(json.dumps(rules))
    model, config = load_hf_model(directory)
    ours_config, hf_kwargs = decoding(strategy)
    ours_config = dataclasses.replace(ours_config, eos_token_id=EOS, **generation_rules(directory, config).imposed())
    mine = best_tokens(generate_seq2seq(model, SOURCES, ours_config))
    src, mask = padded_sources()
    with torch.no_grad():
        theirs = hf_model(directory).generate(input_ids=src, attention_mask=mask, **hf_kwargs)
    assert [strip(seq, 1, EOS) for seq in theirs.tolist()] == mine
    assert not any(repeats_ngram([PAD, *o], 2) for o in mine)
    unruled = best_tokens(generate_seq2seq(model, SOURCES,
                                           dataclasses.replace(ours_config, no_repeat_ngram_size=0)))
    assert any(repeats_ngram([PAD, *o], 2) for o in unruled)
