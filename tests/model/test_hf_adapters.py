"""PEFT LoRA adapters trained on Hugging Face models (model/hf's ADAPTER_LAYOUTs), built and saved by `peft`.

Random HF models (tests.hf_compare.randomize), adapters with random non-zero A and B saved by peft's
save_pretrained, then loaded onto our model from load_hf_checkpoint: logits equal to PeftModel's in float32.
Marian: self- and cross-attention and FFN targets (the model dim permuted as the importer permutes it), suffix
and regex targets adapting some of our modules of a name only, two adapters mixed per batch row. BERT: the
ambiguous ``dense`` (four Linears, the pooler's included) and a regex. GPT-2: a regex on some layers' c_attn.
Refused by name: modules_to_save other than a classifier's head (test_hf_modules_to_save has the head), and lm_head.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from model.checkpoint import load_hf_checkpoint
from model.lora import AdapterError, adapter_names, layers_with, use_adapters
from model.lora_io import check_adapter, load_adapter
from tests.hf_compare import ATOL, peft_adapter
from tests.hf_directories import with_tokenizer
from tests.model import hf_bert, hf_gpt2, hf_marian

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MARIAN_ADAPTERS = {  # name -> PEFT LoraConfig fields
    "every-projection-rslora": dict(r=4, lora_alpha=8, use_rslora=True,
                                    target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
    "cross-attention-suffixes": dict(r=2, lora_alpha=4,
                                     target_modules=["encoder_attn.q_proj", "encoder_attn.v_proj", "self_attn.out_proj",
                                                     "fc2"]),
    "regex-one-layer": dict(r=3, lora_alpha=6, target_modules=r"model\.decoder\.layers\.1\.(encoder_attn\.k_proj|fc1)"),
}
BERT_ADAPTERS = {  # name -> (a BertForSequenceClassification, else a BertModel; PEFT LoraConfig fields)
    "bert-model-query-dense": (False, dict(r=4, lora_alpha=8, target_modules=["query", "dense"])),
    "classifier-regex": (True, dict(r=2, lora_alpha=6, target_modules=r".*layer\.1\.attention\.self\.(key|value)"
                                                                     r"|.*\.intermediate\.dense|bert\.pooler\.dense")),
    "classifier-suffixes": (True, dict(r=3, lora_alpha=3, target_modules=["attention.output.dense", "output.dense"])),
}


def ours_with(directory: Path, adapters: dict[str, Path]) -> nn.Module:
    """Our model of HF ``directory`` (load_hf_checkpoint, float32 on CPU) with ``adapters`` loaded by name."""
    checkpoint = load_hf_checkpoint(directory, device="cpu")
    for name, path in adapters.items():
        load_adapter(checkpoint.model, path, name, layout=checkpoint.adapter_layout)
    return checkpoint.model


def adapts_the_same_modules(ours: nn.Module, name: str, adapter: Path) -> bool:
    """Whether our adapter ``name`` is on as many Linears as PEFT's (one for one in Marian and BERT)."""
    peft_linears = sum(k.endswith("lora_A.weight") for k in load_file(adapter / "adapter_model.safetensors"))
    return len(layers_with(ours, name)) == peft_linears


def theirs(base: nn.Module, adapter: Path | None) -> nn.Module:
    return base if adapter is None else peft.PeftModel.from_pretrained(base, adapter).eval()


def marian_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded sources, their mask, and decoder inputs starting from the pad id."""
    src, mask = hf_marian.padded_sources()
    tokens = torch.randint(1, hf_marian.VOCAB - 1, (len(src), 9), generator=torch.Generator().manual_seed(0))
    return src, mask, torch.cat([torch.full((len(src), 1), hf_marian.PAD), tokens], dim=1)


def marian_logits(directory: Path, adapter: Path | None) -> torch.Tensor:
    src, mask, tgt = marian_batch()
    with torch.no_grad():
        model = theirs(hf_marian.hf_model(directory), adapter)
        return model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits


@pytest.fixture
def marian(tmp_path) -> Path:
    return with_tokenizer(hf_marian.save_marian(tmp_path / "marian"), hf_marian.VOCAB)


@pytest.mark.parametrize("fields", MARIAN_ADAPTERS.values(), ids=MARIAN_ADAPTERS.keys())
def test_marian_adapters_give_peft_logits(marian, tmp_path, fields):
    adapter = peft_adapter(hf_marian.hf_model(marian), tmp_path / "adapter", seed=1, **fields)
    ours = ours_with(marian, {"a": adapter})
    assert adapts_the_same_modules(ours, "a", adapter)
    src, _, tgt = marian_batch()
    expected = marian_logits(marian, adapter)
    with torch.no_grad(), use_adapters(ours, "a"):
        got = ours(src, tgt)
    assert hf_marian.max_diff(got, expected) < ATOL
    assert hf_marian.max_diff(marian_logits(marian, None), expected) > 0.1  # the adapter changes them


def test_two_marian_adapters_mixed_per_row_give_each_row_its_own(marian, tmp_path):
    names = list(MARIAN_ADAPTERS)[:2]
    adapters = {n: peft_adapter(hf_marian.hf_model(marian), tmp_path / n, seed=i, **MARIAN_ADAPTERS[n])
                for i, n in enumerate(names)}
    ours = ours_with(marian, adapters)
    rows = [names[0], names[1], None, names[1], names[0]]
    src, _, tgt = marian_batch()
    expected = {n: marian_logits(marian, adapters.get(n)) for n in (*names, None)}
    with torch.no_grad(), use_adapters(ours, rows):
        got = ours(src, tgt)
    for i, name in enumerate(rows):
        assert hf_marian.max_diff(got[i], expected[name][i]) < ATOL, (i, name)


@pytest.mark.parametrize(("head", "fields"), BERT_ADAPTERS.values(), ids=BERT_ADAPTERS.keys())
def test_bert_adapters_give_peft_outputs(tmp_path, head, fields):
    directory = tmp_path / "bert"
    hf_bert.save_bert(directory, head=head)
    with_tokenizer(directory, hf_bert.BERT["vocab_size"])
    cls = transformers.BertForSequenceClassification if head else transformers.BertModel
    adapter = peft_adapter(cls.from_pretrained(directory), tmp_path / "adapter", seed=2, **fields)
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] is None
    ours = ours_with(directory, {"a": adapter})
    assert adapts_the_same_modules(ours, "a", adapter)
    ids, types = hf_bert.batch()
    expected = hf_bert.hf_outputs(theirs(cls.from_pretrained(directory), adapter), torch.float32, ids, types)
    base = hf_bert.hf_outputs(cls.from_pretrained(directory), torch.float32, ids, types)
    with torch.no_grad(), use_adapters(ours, "a"):
        if head:
            pairs = [(ours(ids, types), expected.logits, base.logits)]
        else:
            hidden, _ = ours.encode(ids, types)
            pairs = [(hidden, expected.last_hidden_state, base.last_hidden_state),
                     (ours.pool(hidden), expected.pooler_output, base.pooler_output)]
    for got, want, unadapted in pairs:
        assert (got - want).abs().max() < ATOL
        assert (unadapted - want).abs().max() > 1e-2  # the adapter changes them


def test_a_gpt2_adapter_with_a_regex_target_gives_peft_logits(tmp_path):
    """c_attn (q, k, v of ours) and mlp.c_proj of the second layer only."""
    directory = with_tokenizer(hf_gpt2.save_gpt2(tmp_path / "gpt2"), hf_gpt2.VOCAB)
    fields = dict(r=2, lora_alpha=4, fan_in_fan_out=True, target_modules=r".*\.h\.1\.(attn\.c_attn|mlp\.c_proj)")
    adapter = peft_adapter(hf_gpt2.hf_model(directory), tmp_path / "adapter", seed=3, **fields)
    ours = ours_with(directory, {"a": adapter})
    ids = torch.tensor([hf_gpt2.PROMPTS[1] * 3])
    with torch.no_grad(), use_adapters(ours, "a"):
        diff = (ours(ids) - theirs(hf_gpt2.hf_model(directory), adapter)(input_ids=ids).logits).abs().max()
    assert diff < ATOL
    assert sorted(layers_with(ours, "a")) == [f"decoder.layers.1.{m}" for m in
                                              ("ffn.fc2", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj")]


@pytest.mark.parametrize(
    ("family", "fields", "says"),
    [
        ("bert", dict(target_modules=["query"], modules_to_save=["embeddings"]),
         r"modules_to_save \['embeddings'\] is not supported: only a classifier's head \(classifier, score, "
         r"pooler\)"),
        ("marian", dict(target_modules=["q_proj", "lm_head"]),
         r"target_modules \['lm_head'\] are not Marian projections we adapt \(fc1, fc2, k_proj"),
        ("marian", dict(target_modules=r".*\.fc1|lm_head"),
         r"tensor 'base_model\.model\.lm_head\.[a-z_.]+' is not a LoRA tensor of a Marian projection"),
    ],
    ids=["modules_to_save", "lm_head-name", "lm_head-regex"],
)
def test_what_we_cannot_adapt_is_refused_by_name(tmp_path, family, fields, says):
    if family == "bert":
        directory = tmp_path / "bert"
        hf_bert.save_bert(directory)
        with_tokenizer(directory, hf_bert.BERT["vocab_size"])
        base = transformers.BertForSequenceClassification.from_pretrained(directory)
    else:
        directory = with_tokenizer(hf_marian.save_marian(tmp_path / "marian"), hf_marian.VOCAB)
        base = hf_marian.hf_model(directory)
    adapter = peft_adapter(base, tmp_path / "adapter", seed=4, r=2, lora_alpha=4, **fields)
    checkpoint = load_hf_checkpoint(directory, device="cpu")
    with pytest.raises(AdapterError, match=says):
        check_adapter(checkpoint.model, adapter, "a", checkpoint.adapter_layout)
    with pytest.raises(AdapterError, match=says):
        load_adapter(checkpoint.model, adapter, "a", layout=checkpoint.adapter_layout)
    assert adapter_names(checkpoint.model) == []
