"""T5 v1.0, T5 v1.1 (Flan-T5's layout) and mT5 directories as our seq2seq (model/hf/t5.py), built and saved by
`transformers` itself.

Random weights, eight relative position buckets up to a distance of 16 and sources and targets longer than that, so
that every kind of bucket is used. Logits equal to `transformers` in float32 and float64 on a padded batch, greedy
and beam-4 generation token for token, cached decoding of rows at different positions, the import through
load_hf_checkpoint and the checkpoint round trip, what we cannot express refused by name, and PEFT adapters equal to
PeftModel's both ways.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import native
from model.checkpoint import load_checkpoint, load_hf_checkpoint, save_checkpoint
from model.fast_step import plan_for
from model.generation import generate_seq2seq
from model.hf import HFImportError, companion_files, load_hf_model
from model.native_support import unsupported
from model.relative_position import relative_bucket
from tests.hf_compare import ATOL, best_tokens, decoding, strip
from tests.hf_directories import with_tokenizer
from tests.model.hf_t5 import (
    BUCKETS,
    EOS,
    MAX_DISTANCE,
    PAD,
    SOURCES,
    VARIANTS,
    VOCAB,
    hf_model,
    padded_sources,
    save_t5,
)
from tests.model.test_native_step import _Watched

transformers = pytest.importorskip("transformers")

MAX_NEW = 20  # beyond MAX_DISTANCE: the decoder's far bucket too
TARGETS = torch.randint(2, VOCAB, (len(SOURCES), 25), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=list(VARIANTS))
def t5_directory(request, tmp_path_factory):
    return save_t5(tmp_path_factory.mktemp("t5") / request.param, request.param, seed=3, eos_boost=2.5)


def _decoder_inputs() -> torch.Tensor:
    return torch.cat([torch.full((len(SOURCES), 1), PAD), TARGETS], dim=1)  # the decoder starts from the pad id


def _float64_norms(monkeypatch) -> None:
    """transformers' T5LayerNorm takes the variance in float32 even in a float64 model (~1e-5 off in the logits):
    for the float64 comparison it takes it in the input's dtype, as ours does, and nothing else changes."""
    from transformers.models.mt5 import modeling_mt5
    from transformers.models.t5 import modeling_t5

    def forward(self, hidden):
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_t5.T5LayerNorm, "forward", forward)
    monkeypatch.setattr(modeling_mt5.MT5LayerNorm, "forward", forward)


def test_buckets_equal_transformers():
    relative = torch.arange(-3 * MAX_DISTANCE, 3 * MAX_DISTANCE)[None, :]
    for bidirectional in (True, False):
        theirs = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
            relative, bidirectional=bidirectional, num_buckets=BUCKETS, max_distance=MAX_DISTANCE)
        ours = relative_bucket(relative, bidirectional, BUCKETS, MAX_DISTANCE)
        assert torch.equal(ours, theirs)
        assert int(ours.max()) == BUCKETS - 1  # the far bucket of keys after (encoder) or before (decoder)


def test_t5_logits_equal_transformers(t5_directory, monkeypatch):
    variant = t5_directory.name
    src, mask = padded_sources()
    tgt = _decoder_inputs()
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        if dtype == torch.float64:
            _float64_norms(monkeypatch)
        ours, config = load_hf_model(t5_directory, dtype)
        with torch.no_grad():
            theirs = hf_model(t5_directory, dtype)(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
            diff = float((ours(src, tgt) - theirs).abs().max())
        assert diff < tolerance, (dtype, diff)
    untied = VARIANTS[variant][2]
    assert (config.positions, config.norm_type, config.bos_id, config.eos_id, config.pad_id) == (
        "relative", "rms", PAD, EOS, PAD)
    assert config.tie_embeddings is not untied and (config.head_scale == 1.0) is untied
    assert config.ffn == ("mlp" if variant == "t5-v1.0" else "gated")
    assert unsupported(config) == [] and ours.decoder.native and ours.encoder.native  # tests/model/test_t5_native.py


def test_t5_generation_equals_transformers_on_a_padded_batch(t5_directory):
    """Greedy and beam-4 (generate()'s defaults), through the path that serves the model: the C++ decoding step
    where the kernels are built (counted)."""
    ours, _ = load_hf_model(t5_directory)
    counted = None
    if native.kernels() is not None:
        plan = plan_for(ours.decoder)
        counted = plan.native = _Watched(plan.native)
    src, mask = padded_sources()
    for strategy in ("greedy", "beam"):
        ours_config, hf_kwargs = decoding(strategy)
        ours_config = dataclasses.replace(ours_config, eos_token_id=EOS, max_new_tokens=MAX_NEW)
        mine = best_tokens(generate_seq2seq(ours, SOURCES, ours_config))
        with torch.no_grad():
            theirs = hf_model(t5_directory).generate(input_ids=src, attention_mask=mask,
                                                     **{**hf_kwargs, "max_new_tokens": MAX_NEW})
        assert all(seq[0] == PAD for seq in theirs.tolist())  # the decoder starts from the pad id
        assert [strip(seq, 1, EOS) for seq in theirs.tolist()] == mine, strategy
        lengths = [len(m) for m in mine]
        assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths  # both endings
    assert counted is None or counted.calls >= 2 * (MAX_NEW - 1)


def test_cached_decoding_of_rows_at_different_positions_equals_the_forward(t5_directory):
    """Target prefixes of different lengths (a non-uniform cache: each row's queries at its own position), then
    steps of one token: each step's logits equal the teacher-forced forward's."""
    ours, _ = load_hf_model(t5_directory)
    src, _ = padded_sources()
    prefixes = [TARGETS[i, : 3 + 4 * i].tolist() for i in range(len(SOURCES))]  # 3..19 tokens
    with torch.no_grad():
        logits, cache = ours.start(src, capacity=8, targets=prefixes)
        for _ in range(4):
            for row, (prefix, got) in enumerate(zip(prefixes, logits, strict=True)):
                forward = ours(src[row: row + 1], torch.tensor([[PAD, *prefix]]))[0, -1]
                assert (got - forward).abs().max() < ATOL
            nxt = logits.argmax(-1)
            prefixes = [p + [int(t)] for p, t in zip(prefixes, nxt, strict=True)]
            logits = ours.decode_step(nxt, cache)


def test_load_hf_checkpoint_and_the_checkpoint_round_trip(t5_directory, tmp_path):
    """The HF directory through load_hf_checkpoint, saved as our checkpoint (python -m training import's layout) and
    loaded again: the same config (relative positions, head scale) and the same logits."""
    directory = with_tokenizer(t5_directory, VOCAB)
    checkpoint = load_hf_checkpoint(directory, device="cpu")
    saved = save_checkpoint(tmp_path / "ours", checkpoint.model, None,
                            extra_files={f"hf/{name}": data for name, data in companion_files(directory).items()})
    again = load_checkpoint(saved, device="cpu")
    assert again.config == checkpoint.config and again.config.positions == "relative"
    src, _ = padded_sources()
    with torch.no_grad():
        assert torch.equal(again.model(src, _decoder_inputs()), checkpoint.model(src, _decoder_inputs()))
    assert again.model.lm_head.weight is again.model.tgt_embed.tokens.weight or not again.config.tie_embeddings


@pytest.mark.parametrize(
    ("variant", "overrides", "says"),
    [
        ("t5-v1.0", {"model_type": "umt5"}, "model_type='umt5' is not supported"),
        ("t5-v1.0", {"feed_forward_proj": "gated-quick_gelu"}, "feed_forward_proj='gated-quick_gelu' is not supported"),
        ("t5-v1.0", {"feed_forward_proj": "geglu-relu"}, "feed_forward_proj='geglu-relu' is not 'ACT' or 'gated-ACT'"),
        ("t5-v1.0", {"is_decoder": True}, "is_decoder=true is not supported"),
        ("t5-v1.0", {"decoder_start_token_id": 500}, "decoder_start_token_id=500 is outside the vocabulary"),
        ("t5-v1.1", {"relative_attention_num_buckets": 6}, "'encoder.block.0.layer.0.SelfAttention.relative_attent"),
    ],
)
def test_what_we_cannot_express_is_refused_by_name(tmp_path, variant, overrides, says):
    directory = save_t5(tmp_path / variant, variant)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(HFImportError, match=says):
        load_hf_model(directory)


def test_a_scaled_head_that_differs_from_the_embedding_is_refused(tmp_path):
    """T5 ties a head scaled by d_model ** -0.5 (v1.0): a saved lm_head of other values is refused, naming it."""
    directory = save_t5(tmp_path / "t5", "t5-v1.0")
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["shared.weight"] + 1
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFImportError, match="'lm_head.weight' differs from 'shared.weight'"):
        load_hf_model(directory)


@pytest.mark.parametrize("variant", ["t5-v1.0", "t5-v1.1"])
def test_peft_adapters_give_peftmodels_logits_both_ways(tmp_path, monkeypatch, variant):
    """A PEFT LoRA on every projection (q k v o of self- and cross-attention, the FFN's wi / wi_0 wi_1, wo) loaded
    onto ours gives PeftModel's logits; ours saved back in T5's names gives them again through PeftModel. In float64
    (the random LoRAs on every Linear make float32's rounding differ by ~1e-3 in these logits)."""
    peft = pytest.importorskip("peft")
    from model.lora import use_adapters
    from model.lora_io import load_adapter, save_adapter
    from tests.hf_compare import peft_adapter

    directory = with_tokenizer(save_t5(tmp_path / variant, variant), VOCAB)
    adapter = peft_adapter(hf_model(directory), tmp_path / "adapter", seed=1, r=4, lora_alpha=8,
                           target_modules=["q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"])
    checkpoint = load_hf_checkpoint(directory, device="cpu", dtype=torch.float64)
    load_adapter(checkpoint.model, adapter, "a", layout=checkpoint.adapter_layout)
    src, mask = padded_sources()
    tgt = _decoder_inputs()
    _float64_norms(monkeypatch)

    def peft_logits(path):
        model = peft.PeftModel.from_pretrained(hf_model(directory, torch.float64), path).eval()
        with torch.no_grad():
            return model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits

    expected = peft_logits(adapter)
    with torch.no_grad(), use_adapters(checkpoint.model, "a"):
        assert (checkpoint.model(src, tgt) - expected).abs().max() < 1e-9
    save_adapter(checkpoint.model, "a", tmp_path / "ours", layout=checkpoint.adapter_layout)
    assert (peft_logits(tmp_path / "ours") - expected).abs().max() < 1e-9
    with torch.no_grad():
        assert (checkpoint.model(src, tgt) - expected).abs().max() > 0.1  # without the adapter: other logits


@pytest.mark.parametrize(
    ("family", "fields", "says"),
    [
        ("causal_lm", {"positions": "relative"}, "positions 'relative' is for seq2seq only"),
        ("seq2seq", {"positions": "rope"}, "the Llama-style fields"),
        ("seq2seq", {"positions": "relative", "relative_buckets": 32, "relative_max_distance": 16},
         "relative_max_distance must be above relative_buckets / 2"),
        ("seq2seq", {"head_scale": 0.0}, "head_scale must be positive"),
    ],
)
def test_config_fields_of_t5_blocks_are_validated(family, fields, says):
    from model.config import ModelConfigError, TransformerConfig

    with pytest.raises(ModelConfigError, match=says):
        TransformerConfig.from_dict({"family": family, **fields})
