"""PEFT LoRA adapters on BART, mBART, M2M100 and NLLB-200 (model/hf/bart.py's adapter_layout), built and saved by
`peft` itself.

Random models of tests/model/hf_bart.py and adapters with random non-zero A and B (tests.hf_compare.peft_adapter):
on every projection (q_proj k_proj v_proj out_proj of self- and cross-attention, fc1 fc2, encoder and decoder),
suffixes, a regex on one layer, rank-stabilised. Our logits equal PeftModel's in float64 (< 1e-9) and float32;
ours saved back (save_adapter with the layout) holds PEFT's own tensors and gives PeftModel the same logits; on
BART (a position table per stack, one token embedding) an imported checkpoint's model gives them too. Two adapters
and the base mixed per row, with a target language per row, in one forward and in greedy and beam-4 decoding
(model.generation, as the service runs a batch) give each row what PeftModel gives it alone. Refused by name: LoRA
on the embeddings or lm_head, modules_to_save, DoRA, biases.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint, load_hf_checkpoint
from model.generation import generate_seq2seq
from model.generation_config import GenerationConfig
from model.lora import AdapterError, adapter_names, layers_with, use_adapters
from model.lora_io import check_adapter, load_adapter, save_adapter
from tests.hf_compare import ATOL, best_tokens, peft_adapter, strip
from tests.hf_directories import with_tokenizer
from tests.model.hf_bart import (
    EOS,
    LANGUAGES,
    SOURCES,
    VOCAB,
    ForcedFirstPerRow,
    hf_model,
    padded_sources,
    save_variant,
)
from tests.model.test_hf_bart_family import ENDINGS
from training.import_cmd import import_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EVERY = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
ADAPTERS = {  # name -> (variant of hf_bart.VARIANTS, PEFT LoraConfig fields)
    "bart-every-projection": ("bart", dict(r=4, lora_alpha=8, target_modules=EVERY)),
    "bart-untied-suffixes": ("bart-scaled-untied", dict(r=2, lora_alpha=4, target_modules=[
        "encoder_attn.q_proj", "encoder_attn.v_proj", "self_attn.out_proj", "fc2"])),
    "mbart-every-projection-rslora": ("mbart", dict(r=4, lora_alpha=8, use_rslora=True, target_modules=EVERY)),
    "m2m100-regex-one-layer": ("m2m100", dict(r=3, lora_alpha=6, target_modules=r"model\.decoder\.layers\.1\."
                                                                                  r"(encoder_attn\.k_proj|fc1)")),
    "nllb-every-projection": ("nllb", dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=EVERY)),
}


def directory_of(tmp_path: Path, variant: str) -> Path:
    return with_tokenizer(save_variant(tmp_path / variant, variant, seed=1), VOCAB)


def batch(start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded sources, their mask, and decoder inputs from the decoder start ``start``."""
    src, mask = padded_sources()
    tokens = torch.randint(3, VOCAB, (len(SOURCES), 9), generator=torch.Generator().manual_seed(0))
    return src, mask, torch.cat([torch.full((len(SOURCES), 1), start), tokens], dim=1)


def peft_model(directory: Path, variant: str, adapter: Path | None, dtype: torch.dtype = torch.float32):
    base = hf_model(directory, variant, dtype)
    return base if adapter is None else peft.PeftModel.from_pretrained(base, adapter).eval()


def peft_logits(directory: Path, variant: str, adapter: Path | None, start: int, dtype: torch.dtype) -> torch.Tensor:
    src, mask, tgt = batch(start)
    with torch.no_grad():
        return peft_model(directory, variant, adapter, dtype)(input_ids=src, attention_mask=mask,
                                                              decoder_input_ids=tgt).logits


def ours_logits(model: torch.nn.Module, adapters, start: int) -> torch.Tensor:
    src, _, tgt = batch(start)
    with torch.no_grad(), use_adapters(model, adapters):
        return model(src, tgt)


@pytest.mark.parametrize(("variant", "fields"), ADAPTERS.values(), ids=ADAPTERS.keys())
def test_adapters_give_peftmodels_logits_both_ways(tmp_path, variant, fields):
    """Loaded onto ours: PeftModel's logits in float64 and float32; saved back in the model's names: PEFT's own
    tensors, which give PeftModel the same logits again."""
    directory = directory_of(tmp_path, variant)
    adapter = peft_adapter(hf_model(directory, variant), tmp_path / "adapter", seed=1, **fields)
    peft_tensors = load_file(adapter / "adapter_model.safetensors")
    for dtype, tolerance in ((torch.float64, 1e-9), (torch.float32, ATOL)):
        checkpoint = load_hf_checkpoint(directory, device="cpu", dtype=dtype)
        ours, layout, start = checkpoint.model, checkpoint.adapter_layout, checkpoint.config.bos_id
        load_adapter(ours, adapter, "a", layout=layout)
        assert len(layers_with(ours, "a")) == sum(k.endswith("lora_A.weight") for k in peft_tensors)
        expected = peft_logits(directory, variant, adapter, start, dtype)
        assert (ours_logits(ours, "a", start) - expected).abs().max() < tolerance, dtype
        assert (ours_logits(ours, None, start) - expected).abs().max() > 0.1  # the adapter changes them
        save_adapter(ours, "a", tmp_path / f"saved-{dtype}", layout=layout)
        saved = load_file(tmp_path / f"saved-{dtype}" / "adapter_model.safetensors")
        assert sorted(saved) == sorted(peft_tensors)
        assert (peft_logits(directory, variant, tmp_path / f"saved-{dtype}", start, dtype) - expected).abs().max() \
            < tolerance


def test_an_imported_bart_checkpoint_takes_the_adapter_alike(tmp_path):
    """python -m training import's checkpoint (one token embedding, a position table per stack): the adapter gives
    the logits it gives on load_hf_checkpoint's model."""
    variant, fields = ADAPTERS["bart-every-projection"]
    directory = directory_of(tmp_path, variant)
    adapter = peft_adapter(hf_model(directory, variant), tmp_path / "adapter", seed=2, **fields)
    models = [load_hf_checkpoint(directory, device="cpu"), load_checkpoint(import_hf(directory, tmp_path / "ours"),
                                                                           device="cpu")]
    for checkpoint in models:
        load_adapter(checkpoint.model, adapter, "a", layout=checkpoint.adapter_layout)
    imported = models[1].model
    assert imported.src_embed.tokens.weight is imported.tgt_embed.tokens.weight
    assert not models[1].config.shared_positions
    start = models[0].config.bos_id
    assert torch.equal(ours_logits(models[0].model, "a", start), ours_logits(imported, "a", start))


@pytest.mark.parametrize("variant", ["m2m100", "bart"])
def test_two_adapters_and_the_base_mixed_per_row_give_each_row_its_own(tmp_path, variant):
    """One forward of a padded batch, then greedy and beam-4 decoding (model.generation, as the service decodes a
    batch, with generation_config's rules) with a target language forced per row: each row as PeftModel gives it
    alone, and each adapter changes the tokens of some row."""
    directory = with_tokenizer(save_variant(tmp_path / variant, variant, *ENDINGS[variant]), VOCAB)
    names = ["every", "suffixes"]
    adapters = {name: peft_adapter(hf_model(directory, variant), tmp_path / name, seed=i + 3, **fields)
                for i, (name, (_, fields)) in enumerate(zip(names, [ADAPTERS["bart-every-projection"],
                                                                    ADAPTERS["bart-untied-suffixes"]], strict=True))}
    checkpoint = load_hf_checkpoint(directory, device="cpu")
    ours, start = checkpoint.model, checkpoint.config.bos_id
    for name, path in adapters.items():
        load_adapter(ours, path, name, layout=checkpoint.adapter_layout)
    rows = [names[0], None, names[1], names[1], names[0]]
    got = ours_logits(ours, rows, start)
    for i, name in enumerate(rows):
        expected = peft_logits(directory, variant, adapters.get(name), start, torch.float32)[i]
        assert (got[i] - expected).abs().max() < ATOL, (i, name)

    rules = checkpoint.generation
    forced = [rules.forced_bos] * len(SOURCES) if rules.forced_bos is not None else [
        LANGUAGES[i % len(LANGUAGES)] for i in range(len(SOURCES))]
    for strategy, beams in (("greedy", 1), ("beam", 4)):
        config = dataclasses.replace(GenerationConfig(**rules.imposed(), **rules.defaults), strategy=strategy,
                                     num_beams=beams, max_new_tokens=10, eos_token_id=EOS)
        mine = best_tokens(generate_seq2seq(ours, SOURCES, config, adapters=rows, forced_first=forced))
        wanted = []
        for source, name, token in zip(SOURCES, rows, forced, strict=True):
            with torch.no_grad():
                out = peft_model(directory, variant, adapters.get(name)).generate(
                    input_ids=torch.tensor([source]), max_new_tokens=10, num_beams=beams, do_sample=False,
                    logits_processor=transformers.LogitsProcessorList([ForcedFirstPerRow([token], beams)]))
            wanted.append(strip(out[0].tolist(), 1, EOS))
        assert mine == wanted, strategy
        base = best_tokens(generate_seq2seq(ours, SOURCES, config, forced_first=forced))
        assert {name for m, b, name in zip(mine, base, rows, strict=True) if m != b} == set(names), strategy


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (dict(target_modules=["q_proj", "embed_tokens"]),
         r"target_modules \['embed_tokens'\] are not BART projections we adapt \(fc1, fc2, k_proj"),
        (dict(target_modules=r".*(q_proj|embed_tokens)"),
         r"tensor 'base_model\.model\.model\.(en|de)coder\.embed_tokens\.lora_embedding_A' is not a LoRA tensor of "
         r"a BART projection"),
        (dict(target_modules=["q_proj", "lm_head"]), r"target_modules \['lm_head'\] are not BART projections"),
        (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
         r"modules_to_save \['lm_head'\] is not supported for BART: an adapter's own copies of the head"),
        (dict(target_modules=["q_proj"], use_dora=True), r"unsupported PEFT options \{'use_dora': True\}"),
        (dict(target_modules=["q_proj"], bias="all"), "bias='all'"),
    ],
    ids=["embed_tokens", "embed_tokens-regex", "lm_head", "modules_to_save", "dora", "bias"],
)
def test_what_we_cannot_adapt_is_refused_by_name(tmp_path, fields, says):
    directory = directory_of(tmp_path, "bart")
    adapter = peft_adapter(hf_model(directory, "bart"), tmp_path / "adapter", seed=4, r=2, lora_alpha=4, **fields)
    checkpoint = load_hf_checkpoint(directory, device="cpu")
    with pytest.raises(AdapterError, match=says):
        check_adapter(checkpoint.model, adapter, "a", checkpoint.adapter_layout)
    with pytest.raises(AdapterError, match=says):
        load_adapter(checkpoint.model, adapter, "a", layout=checkpoint.adapter_layout)
    assert adapter_names(checkpoint.model) == []
