"""classifier -> BertForSequenceClassification (the MLM and sentence-order heads stay behind)."""

from __future__ import annotations

from typing import Any

import torch

from model.checkpoint import Checkpoint
from model.hf import bert as hf_bert
from training.export.common import HF_ACTIVATIONS, Need, Tensors, linear, norm

ARCHITECTURE = "BertForSequenceClassification"
NEEDS = (
    Need("extended", False, "the original blocks (LayerNorm, no rope, no GQA or head_size, no gated FFN)"),
    Need("positions", "learned", "learned positions"),
    Need("norm", "post", "post-LN"),
    Need("final_norm", False, "no final LayerNorm"),
    Need("scale_embeddings", False, "unscaled embeddings"),
    Need("embedding_norm", True, "an embedding LayerNorm"),
    Need("head", "sequence", "a sequence classification head (not a token one)"),
    Need("pooler", True, "the dense + tanh pooler"),
    Need("pooler_activation", "tanh", "the dense + tanh pooler"),
    Need("head_norm", False, "no LayerNorm after the pooler (ModernBERT's head)"),
    Need("head_pooling", "cls", "the [CLS] state pooled (not the mean: ModernBERT's)"),
    Need("position_offset", 0, "positions counted from 0 (RoBERTa's start after the pad id)"),
)
# ClassifierConfig.output_activation -> config.json's problem_type: the importer's map (model.hf.bert) inverted
PROBLEM_TYPES = {activation: problem for problem, activation in hf_bert.PROBLEM_TYPES.items()}


def build(ckpt: Checkpoint) -> tuple[dict[str, Any], Tensors]:
    """config.json fields and tensors in HF's names."""
    model, c = ckpt.model, ckpt.config
    embed = model.embed
    # BERT always adds a token-type embedding: one zero row adds nothing when we have no segments.
    segments = embed.segments.weight if embed.segments is not None else torch.zeros(1, c.d_model)
    tensors = {
        "bert.embeddings.word_embeddings.weight": embed.tokens.weight,
        "bert.embeddings.position_embeddings.weight": embed.positions.weight,
        "bert.embeddings.token_type_embeddings.weight": segments,
        **norm("bert.embeddings.LayerNorm.", embed.norm),
        **linear("bert.pooler.dense.", model.pooler),
        **linear("classifier.", model.classifier),
    }
    for i, layer in enumerate(model.encoder.layers):
        p, attn = f"bert.encoder.layer.{i}.", layer.self_attn
        tensors |= linear(f"{p}attention.self.query.", attn.q_proj) | linear(f"{p}attention.self.key.", attn.k_proj)
        tensors |= linear(f"{p}attention.self.value.", attn.v_proj)
        tensors |= linear(f"{p}attention.output.dense.", attn.out_proj)
        tensors |= norm(f"{p}attention.output.LayerNorm.", layer.self_attn_norm)
        tensors |= linear(f"{p}intermediate.dense.", layer.ffn.fc1) | linear(f"{p}output.dense.", layer.ffn.fc2)
        tensors |= norm(f"{p}output.LayerNorm.", layer.ffn_norm)
    config = {
        "model_type": "bert",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "intermediate_size": c.d_ff,
        "hidden_act": HF_ACTIVATIONS[c.activation],
        "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": c.dropout,
        "max_position_embeddings": c.max_len,
        "type_vocab_size": max(c.type_vocab_size, 1),
        "layer_norm_eps": c.layer_norm_eps,
        "pad_token_id": c.pad_id,
        "position_embedding_type": "absolute",
        "problem_type": PROBLEM_TYPES[c.output_activation],
        "id2label": {str(i): name for i, name in enumerate(ckpt.labels)},  # load_checkpoint checked the labels
        "label2id": {name: i for i, name in enumerate(ckpt.labels)},
    }
    return config, tensors
