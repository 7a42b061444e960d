"""Hugging Face BERT directories as our classifier (model/hf/bert.py), built and saved by `transformers` itself.

Random weights (tests.hf_compare.randomize: LayerNorms included, so a misplaced tensor shows); a right-padded
batch of single texts and pairs with token_type_ids. BertForSequenceClassification: logits and labels;
BertModel (with and without its pooler): hidden states, pooled output, and the cls / mean / max embeddings
against a float64 reference from transformers' last_hidden_state; the config fields we cannot express
refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.hf import HFImportError, bert, load_hf_model
from model.hf.common import read_config
from tests.hf_compare import ATOL, randomize

transformers = pytest.importorskip("transformers")

PAD, CLS, SEP = 0, 2, 3
LABELS = ["neg", "pos", "mid"]
BERT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)
VARIANTS = {"gelu": {}, "gelu_new-eps-3types": {"hidden_act": "gelu_new", "layer_norm_eps": 1e-6, "type_vocab_size": 3}}
TEXTS = [([10, 11, 12], [20, 21]), ([30], [40, 41, 42, 43, 44]), ([50, 51], None), ([7, 8, 9, 60, 61, 62], [5])]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """ "[CLS] a [SEP] (b [SEP])" rows, right-padded, and their token types (1 on the pair's second text)."""
    rows = [([CLS, *a, SEP], [*b, SEP] if b else []) for a, b in TEXTS]
    width = max(len(a) + len(b) for a, b in rows)
    ids = [a + b + [PAD] * (width - len(a) - len(b)) for a, b in rows]
    types = [[0] * len(a) + [1] * len(b) + [0] * (width - len(a) - len(b)) for a, b in rows]
    return torch.tensor(ids), torch.tensor(types)


def save_bert(directory: Path, head: bool = True, pooler: bool = True, seed: int = 0, **overrides):
    """A random BERT saved by transformers' save_pretrained (safetensors); the model itself, in eval mode."""
    config = transformers.BertConfig(**{**BERT, "id2label": dict(enumerate(LABELS)), **overrides})
    model = transformers.BertForSequenceClassification(config) if head else transformers.BertModel(config, pooler)
    randomize(model, seed=seed).save_pretrained(directory)
    return model


def hf_outputs(model, dtype: torch.dtype, ids: torch.Tensor, types: torch.Tensor):
    with torch.no_grad():
        return model.to(dtype)(input_ids=ids, attention_mask=(ids != PAD).long(), token_type_ids=types)


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_bert_classification_logits_equal_transformers(tmp_path, overrides):
    theirs = save_bert(tmp_path / "bert", **overrides)
    ids, types = batch()
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, config = load_hf_model(tmp_path / "bert", dtype)
        with torch.no_grad():
            diff = (ours(ids, types) - hf_outputs(theirs, dtype, ids, types).logits).abs().max()
        assert diff < tolerance, (dtype, float(diff))
    assert (config.family, config.num_labels, config.pooler) == ("classifier", 3, True)
    assert bert.labels(read_config(tmp_path / "bert")) == LABELS


@pytest.mark.parametrize("pooler", [True, False], ids=["pooler", "no-pooler"])
def test_a_bert_model_is_an_embedding_model_equal_to_transformers(tmp_path, pooler):
    """BertModel saved alone: no "bert." prefix, no classification head, and a pooler only when it saved one."""
    theirs = save_bert(tmp_path / "base", head=False, pooler=pooler)
    ids, types = batch()
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, config = load_hf_model(tmp_path / "base", dtype)
        expected = hf_outputs(theirs, dtype, ids, types)
        with torch.no_grad():
            hidden, _ = ours.encode(ids, types)
            assert (hidden - expected.last_hidden_state).abs().max() < tolerance, dtype
            if pooler:
                assert (ours.pool(hidden) - expected.pooler_output).abs().max() < tolerance, dtype
    assert (config.num_labels, config.pooler, ours.classifier) == (0, pooler, None)
    assert bert.labels(read_config(tmp_path / "base")) is None
    with pytest.raises(ValueError, match="no classification head"):
        ours(ids, types)


def test_cls_mean_and_max_embeddings_equal_a_float64_reference(tmp_path):
    theirs = save_bert(tmp_path / "base", head=False, seed=3)
    ids, types = batch()
    hidden = hf_outputs(theirs, torch.float64, ids, types).last_hidden_state
    keep = (ids != PAD).unsqueeze(-1)
    reference = {
        "cls": hidden[:, 0],
        "mean": (hidden * keep).sum(1) / keep.sum(1),
        "max": torch.where(keep, hidden, torch.tensor(-1e9, dtype=torch.float64)).amax(1),  # sentence-transformers
    }
    assert (hidden.amax(1) - reference["max"]).abs().max() > 1e-6  # the padding would change the maximum
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, 1e-9)):
        ours, _ = load_hf_model(tmp_path / "base", dtype)
        for pooling, expected in reference.items():
            with torch.no_grad():
                got = ours.embed_texts(ids, types, pooling)
            assert (got.double() - expected).abs().max() < tolerance, (dtype, pooling)


def test_tensorflow_era_layernorm_names_load(tmp_path):
    """LayerNorm.gamma / LayerNorm.beta, as checkpoints converted from TensorFlow name them."""
    theirs = save_bert(tmp_path / "bert")
    path = tmp_path / "bert" / "model.safetensors"
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in load_file(path).items()}
    assert any(k.endswith("gamma") for k in legacy)
    save_file(legacy, path, metadata={"format": "pt"})
    ours, _ = load_hf_model(tmp_path / "bert")
    ids, types = batch()
    with torch.no_grad():
        assert (ours(ids, types) - hf_outputs(theirs, torch.float32, ids, types).logits).abs().max() < ATOL


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key' is not supported"),
        ({"is_decoder": True}, "is_decoder=True is not supported"),
        ({"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu' is not supported"),
        ({"problem_type": "multi_label_classification"}, "problem_type='multi_label_classification' is not"),
        ({"problem_type": "regression"}, "problem_type='regression' is not supported"),
        ({"id2label": {"0": "score"}}, "num_labels=1 is not supported"),
        ({"type_vocab_size": 3}, "'embeddings.token_type_embeddings.weight' has shape (2, 32), expected (3, 32)"),
    ],
)
def test_bert_config_fields_we_cannot_express_are_refused_by_name(tmp_path, overrides, says):
    save_bert(tmp_path / "bert")
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    (tmp_path / "bert" / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(HFImportError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_hf_model(tmp_path / "bert")
