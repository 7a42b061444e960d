"""Hugging Face BERT directories as our classifier (model/hf/bert.py), built and saved by `transformers` itself.

Random weights (tests.hf_compare.randomize: LayerNorms included, so a misplaced tensor shows); a right-padded
batch of single texts and pairs with token_type_ids. BertForSequenceClassification: logits and labels;
BertModel (with and without its pooler): hidden states, pooled output, and the cls / mean / max embeddings
against a float64 reference from transformers' last_hidden_state; the config fields we cannot express
refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.hf import HFImportError, bert, load_hf_model
from model.hf.common import read_config
from tests.hf_compare import ATOL
from tests.model.hf_bert import LABELS, PAD, batch, hf_outputs, save_bert

transformers = pytest.importorskip("transformers")

VARIANTS = {"gelu": {}, "gelu_new-eps-3types": {"hidden_act": "gelu_new", "layer_norm_eps": 1e-6, "type_vocab_size": 3}}


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
        ({"problem_type": "ranking"}, "problem_type='ranking' is not supported"),
        ({"type_vocab_size": 3}, "'embeddings.token_type_embeddings.weight' has shape (2, 32), expected (3, 32)"),
    ],
)
def test_bert_config_fields_we_cannot_express_are_refused_by_name(tmp_path, overrides, says):
    save_bert(tmp_path / "bert")
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    (tmp_path / "bert" / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(HFImportError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_hf_model(tmp_path / "bert")
