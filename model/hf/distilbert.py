"""DistilBertModel / DistilBertForSequenceClassification / DistilBertForTokenClassification -> our classifier.

DistilBERT is BERT's post-LN encoder (bert.py) under its own names (q_lin, k_lin, v_lin, out_lin, ffn.lin1 / lin2,
sa_layer_norm, output_layer_norm), without token types or a pooler, LayerNorm eps fixed at 1e-12; its head is
``pre_classifier -> ReLU -> classifier`` on [CLS], which is our pooler (``pooler_activation="relu"``) and
classifier. ``sinusoidal_pos_embds`` only initializes the position table, which is saved with the weights: it
loads as any learned table. PEFT adapters (on q_lin, k_lin, v_lin, out_lin, lin1, lin2, pre_classifier) map onto the
same modules (ADAPTER_LAYOUT, model.hf.encoder_adapters); a SEQ_CLS adapter's ``classifier`` (modules_to_save)
copies pre_classifier too (PEFT matches it as a suffix): our pooler and classifier. DistilBertForTokenClassification
has no pre_classifier: its ``classifier`` reads every hidden state (ClassifierConfig.head "token").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from model.config import ClassifierConfig
from model.hf import bert
from model.hf.common import Tensors, activation, field, strip_prefix, take
from model.hf.encoder_adapters import EncoderNames, adapter_layout

HEAD = "DistilBertForSequenceClassification"
TOKEN_HEAD = "DistilBertForTokenClassification"  # classifier on every hidden state, no pre_classifier
ARCHITECTURES = (HEAD, "DistilBertModel", TOKEN_HEAD)
LAYER_NORM_EPS = 1e-12  # transformers' DistilBERT hard-codes it
# A layer's modules: ours -> DistilBERT's (under transformer.layer.N.)
LINEARS = {"self_attn.q_proj": "attention.q_lin", "self_attn.k_proj": "attention.k_lin",
           "self_attn.v_proj": "attention.v_lin", "self_attn.out_proj": "attention.out_lin",
           "ffn.fc1": "ffn.lin1", "ffn.fc2": "ffn.lin2"}
# PEFT's target names (a module name or a suffix of its path) -> our modules' last names
ADAPTER_TARGETS = {**{theirs.rpartition(".")[2]: (ours.rpartition(".")[2],) for ours, theirs in LINEARS.items()},
                   **{theirs: (ours.rpartition(".")[2],) for ours, theirs in LINEARS.items()},
                   "pre_classifier": ("pooler",)}
ADAPTER_NAMES = EncoderNames("DistilBERT", "distilbert.", "transformer.layer", LINEARS, ADAPTER_TARGETS,
                             heads={"pre_classifier": "pooler", "classifier": "classifier"},
                             saves={"classifier": ("pooler", "classifier"), "pre_classifier": ("pooler",)})
ADAPTER_LAYOUT = adapter_layout(ADAPTER_NAMES)
NORMS = {"self_attn_norm": "sa_layer_norm", "ffn_norm": "output_layer_norm"}
# config.json: DistilBERT's size fields -> BERT's, with DistilBERT's defaults
CONFIG_NAMES = {"dim": ("hidden_size", 768), "n_heads": ("num_attention_heads", 12),
                "hidden_dim": ("intermediate_size", 3072), "n_layers": ("num_hidden_layers", 6)}


def labels(hf: Mapping[str, Any]) -> list[str] | None:
    """The class names of a DistilBertFor*Classification in id order; None for a DistilBertModel."""
    return bert.head_labels(hf, ARCHITECTURES, (HEAD, TOKEN_HEAD))


def to_config(hf: Mapping[str, Any]) -> ClassifierConfig:
    """Our config for DistilBERT's config.json (HFImportError naming a field we cannot express)."""
    names = labels(hf)
    renamed = {bert_name: field(hf, name, default=default) for name, (bert_name, default) in CONFIG_NAMES.items()}
    renamed["hidden_act"] = field(hf, "activation", str, "gelu")
    activation(hf, "activation", "gelu")  # an unknown one refused under DistilBERT's name
    head = bert.head_kind(hf, (TOKEN_HEAD,))
    c = bert.encoder_config({**hf, **renamed, "type_vocab_size": 1}, names, layer_norm_eps=LAYER_NORM_EPS, head=head)
    return dataclasses.replace(c, type_vocab_size=0, pooler=bool(names) and head == "sequence",
                               pooler_activation="relu")


def state_dict(c: ClassifierConfig, tensors: Tensors) -> Tensors:
    """Our classifier's state dict from DistilBERT's tensors (``distilbert.`` prefix under the head)."""
    t = bert.modern_names(strip_prefix(tensors, "distilbert."))
    d, ff = c.d_model, c.d_ff
    embed = take(t, "embeddings.word_embeddings.weight", (c.vocab_size, d))
    ours = {"embed.tokens.weight": embed,
            "embed.positions.weight": take(t, "embeddings.position_embeddings.weight", (c.max_len, d)),
            **bert.weight_bias(t, "embeddings.LayerNorm.", "embed.norm.", (d,))}
    for i in range(c.n_layers):
        p, q = f"transformer.layer.{i}.", f"encoder.layers.{i}."
        for name, theirs in LINEARS.items():
            shape = {"ffn.fc1": (ff, d), "ffn.fc2": (d, ff)}.get(name, (d, d))
            ours |= bert.weight_bias(t, f"{p}{theirs}.", f"{q}{name}.", shape)
        for name, theirs in NORMS.items():
            ours |= bert.weight_bias(t, f"{p}{theirs}.", f"{q}{name}.", (d,))
    if c.pooler:
        ours |= bert.weight_bias(t, "pre_classifier.", "pooler.", (d, d))
    if c.num_labels:
        ours |= bert.weight_bias(t, "classifier.", "classifier.", (c.num_labels, d))
    return ours | bert.untrained_heads(c, embed)
