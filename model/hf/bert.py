"""BertForSequenceClassification, BertForTokenClassification and BertModel (an embedding model: no classification
head) -> our classifier.

BERT is post-LN with learned positions, token-type (segment) embeddings and an embedding LayerNorm, exact
GELU, no final LayerNorm and unscaled embeddings; its pooler (dense + tanh on [CLS]) feeds the classification
head. A BertModel saved with ``add_pooling_layer=False`` has no pooler weights, which config.json does not
say: :func:`state_dict` sets ``pooler`` from the tensors. BERT's [CLS] id lives in the tokenizer, not in
config.json, so ``cls_id`` keeps our default here. ``problem_type`` says what classify serves (PROBLEM_TYPES:
softmax, each label's sigmoid, or a regression's raw values); one label without it is a sigmoid relevance score
(a cross-encoder). :func:`encoder_config` and :func:`state_dict` also serve the BERT-shaped importers (roberta.py,
distilbert.py).

A PEFT LoRA adapter (on query, key, value, the dense Linears of a layer, pooler.dense) maps onto the same
modules (ADAPTER_LAYOUT, model.hf.encoder_adapters), and its own copy of the classification head (modules_to_save:
``classifier``) onto our ``classifier``; ours go back onto the same modules.

Neither architecture saves pre-training heads; ours (``mlm_head``, ``order_head``) load as zeros (uniform
predictions; the MLM decoder stays tied to the token embedding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from model.config import ClassifierConfig
from model.hf.common import (
    CONFIG_FILE,
    HFImportError,
    Tensors,
    Unsupported,
    activation,
    check_supported,
    field,
    strip_prefix,
    take,
)
from model.hf.encoder_adapters import EncoderNames, adapter_layout

HEAD = "BertForSequenceClassification"
TOKEN_HEAD = "BertForTokenClassification"  # a Linear on every hidden state, no pooler
ARCHITECTURES = (HEAD, "BertModel", TOKEN_HEAD)
RULES = (
    Unsupported("position_embedding_type", ("absolute",), "relative position embeddings"),
    Unsupported("is_decoder", (False,), "a causal decoder"),
    Unsupported("add_cross_attention", (False,), "cross-attention layers"),
)
# problem_type -> what classify serves (transformers' text-classification pipeline: sigmoid for multi-label and for
# one label without a problem_type, softmax otherwise, regression raw)
PROBLEM_TYPES = {"single_label_classification": "softmax", "multi_label_classification": "sigmoid",
                 "regression": "none"}
# A layer's Linears: ours -> BERT's (under encoder.layers.N. / encoder.layer.N.)
LINEARS = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
           "self_attn.v_proj": "attention.self.value", "self_attn.out_proj": "attention.output.dense",
           "ffn.fc1": "intermediate.dense", "ffn.fc2": "output.dense"}
# Checkpoints converted from TensorFlow name LayerNorm parameters gamma / beta (transformers renames them too).
LEGACY_NORM_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def labels(hf: Mapping[str, Any]) -> list[str] | None:
    """The class names of a BertFor*Classification in id order; None for a BertModel."""
    return head_labels(hf, ARCHITECTURES, (HEAD, TOKEN_HEAD))


def head_kind(hf: Mapping[str, Any], token_heads: tuple[str, ...]) -> str:
    """ClassifierConfig.head of config.json's architecture: "token" for one of ``token_heads``, else "sequence"."""
    return "token" if set(token_heads) & set(hf.get("architectures") or ()) else "sequence"


def head_labels(hf: Mapping[str, Any], architectures: tuple[str, ...], heads: tuple[str, ...]) -> list[str] | None:
    """The class names in id order (id2label; transformers' LABEL_i names when it has none) when config.json names
    one of ``heads`` (a missing ``architectures`` counts as ``architectures[0]``); None for a headless model."""
    if not set(heads) & set(hf.get("architectures") or architectures[:1]):
        return None
    count = field(hf, "num_labels", default=None)
    id2label = field(hf, "id2label", dict, default=None)
    if id2label is None:
        names = [f"LABEL_{i}" for i in range(2 if count is None else count)]  # transformers' defaults
    else:
        if set(id2label) != {str(i) for i in range(len(id2label))}:
            raise HFImportError(f"{CONFIG_FILE}: id2label keys must be the ids 0..{len(id2label) - 1}")
        names = [id2label[str(i)] for i in range(len(id2label))]
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) < len(names):
            raise HFImportError(f"{CONFIG_FILE}: id2label must map each id to a distinct non-empty name")
        if count is not None and count != len(names):
            raise HFImportError(f"{CONFIG_FILE}: num_labels={count} but id2label has {len(names)} labels")
    if not names:
        raise HFImportError(f"{CONFIG_FILE}: num_labels=0 is not supported for {heads[0]} (supported: 1 or more)")
    return names


def output_activation(hf: Mapping[str, Any], num_labels: int) -> str:
    """What classify serves for config.json's problem_type (PROBLEM_TYPES; None: sigmoid for one label, as
    transformers' pipeline and sentence-transformers' CrossEncoder apply, else softmax)."""
    problem = field(hf, "problem_type", str, default=None)
    if problem is None:
        return "sigmoid" if num_labels == 1 else "softmax"
    if problem not in PROBLEM_TYPES:
        raise HFImportError(f"{CONFIG_FILE}: problem_type={problem!r} is not supported (supported: "
                            f"{sorted(PROBLEM_TYPES)})")
    return PROBLEM_TYPES[problem]


def to_config(hf: Mapping[str, Any]) -> ClassifierConfig:
    """Our config for BERT's config.json (HFImportError naming a field we cannot express)."""
    check_supported(hf, RULES, "BERT")
    return encoder_config(hf, labels(hf), layer_norm_eps=field(hf, "layer_norm_eps", float, 1e-12),
                          head=head_kind(hf, (TOKEN_HEAD,)))


def encoder_config(hf: Mapping[str, Any], label_names: list[str] | None, *, layer_norm_eps: float,
                   vocab: int = 30522, pad: int = 0, max_positions: int = 512, type_vocab: int = 2,
                   offset_positions: bool = False, head: str = "sequence") -> ClassifierConfig:
    """Our config for a BERT-named config.json (hidden_size, num_attention_heads...; the defaults are the
    architecture's); ``offset_positions``: RoBERTa's positions from pad_token_id + 1; ``head``: "token" for a
    *ForTokenClassification (no pooler; softmax over each token's labels, as transformers' pipeline)."""
    vocab = field(hf, "vocab_size", default=vocab)
    pad = field(hf, "pad_token_id", default=pad)
    if not 0 <= pad < vocab:
        raise HFImportError(f"{CONFIG_FILE}: pad_token_id={pad} is outside the vocabulary (vocab_size={vocab})")
    type_vocab = field(hf, "type_vocab_size", default=type_vocab)
    if type_vocab < 1:
        raise HFImportError(f"{CONFIG_FILE}: type_vocab_size={type_vocab} is not supported (supported: >= 1)")
    offset = pad + 1 if offset_positions else 0
    positions = field(hf, "max_position_embeddings", default=max_positions)
    if positions <= offset:
        raise HFImportError(f"{CONFIG_FILE}: max_position_embeddings={positions} leaves no position after the "
                            f"offset pad_token_id + 1 = {offset}")
    num_labels = len(label_names or ())
    return ClassifierConfig(
        vocab_size=vocab,
        d_model=field(hf, "hidden_size", default=768),
        n_heads=field(hf, "num_attention_heads", default=12),
        d_ff=field(hf, "intermediate_size", default=3072),
        dropout=0.0,
        max_len=positions - offset,  # the longest input; the table has ``offset`` more rows
        positions="learned",
        norm="post",
        activation=activation(hf, "hidden_act", "gelu"),
        bias=True,
        scale_embeddings=False,
        tie_embeddings=True,  # the MLM decoder shares the word embedding, as BERT's does
        embedding_norm=True,
        final_norm=False,
        layer_norm_eps=layer_norm_eps,
        pad_id=pad,
        n_layers=field(hf, "num_hidden_layers", default=12),
        num_labels=num_labels,
        type_vocab_size=type_vocab,
        pooler=head == "sequence",
        position_offset=offset,
        output_activation=output_activation(hf, num_labels) if num_labels and head == "sequence" else "softmax",
        head=head,
    )


def state_dict(c: ClassifierConfig, tensors: Tensors) -> Tensors:
    """Our classifier's state dict from BERT's tensors (shapes checked); a BertModel without pooler weights
    sets ``c.pooler`` False."""
    t = modern_names(strip_prefix(tensors, "bert."))
    d, ff = c.d_model, c.d_ff
    embed = take(t, "embeddings.word_embeddings.weight", (c.vocab_size, d))
    ours = {
        "embed.tokens.weight": embed,
        "embed.positions.weight": take(t, "embeddings.position_embeddings.weight", (c.max_len + c.position_offset, d)),
        "embed.segments.weight": take(t, "embeddings.token_type_embeddings.weight", (c.type_vocab_size, d)),
        **weight_bias(t, "embeddings.LayerNorm.", "embed.norm.", (d,)),
    }
    for i in range(c.n_layers):
        p, q = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        for name, theirs in LINEARS.items():
            shape = {"ffn.fc1": (ff, d), "ffn.fc2": (d, ff)}.get(name, (d, d))
            ours |= weight_bias(t, f"{p}{theirs}.", f"{q}{name}.", shape)
        ours |= weight_bias(t, f"{p}attention.output.LayerNorm.", f"{q}self_attn_norm.", (d,))
        ours |= weight_bias(t, f"{p}output.LayerNorm.", f"{q}ffn_norm.", (d,))
    if c.num_labels == 0:
        c.pooler = "pooler.dense.weight" in t  # BertModel(add_pooling_layer=False) saves none
    if c.pooler:
        ours |= weight_bias(t, "pooler.dense.", "pooler.", (d, d))
    if c.num_labels:
        ours |= weight_bias(t, "classifier.", "classifier.", (c.num_labels, d))
    return ours | untrained_heads(c, embed)


def modern_names(tensors: Tensors) -> Tensors:
    """``tensors`` with TensorFlow-era LayerNorm names (LEGACY_NORM_NAMES) renamed."""
    return {_modern_name(k): v for k, v in tensors.items()}


def _modern_name(name: str) -> str:
    for legacy, modern in LEGACY_NORM_NAMES.items():
        if name.endswith(legacy):
            return name.removesuffix(legacy) + modern
    return name


def weight_bias(t: Tensors, theirs: str, ours: str, shape: tuple[int, ...]) -> Tensors:
    """``theirs`` weight (``shape``) and bias (``shape[:1]``) of a Linear or LayerNorm, named ``ours``."""
    return {f"{ours}weight": take(t, f"{theirs}weight", shape), f"{ours}bias": take(t, f"{theirs}bias", shape[:1])}


def untrained_heads(c: ClassifierConfig, embed: torch.Tensor) -> Tensors:
    """Our pre-training heads, which BERT's fine-tuned and base checkpoints do not carry: zero outputs."""
    d = c.d_model
    return {
        "mlm_head.dense.weight": torch.zeros(d, d), "mlm_head.dense.bias": torch.zeros(d),
        "mlm_head.norm.weight": torch.ones(d), "mlm_head.norm.bias": torch.zeros(d),
        "mlm_head.decoder.weight": embed, "mlm_head.decoder.bias": torch.zeros(c.vocab_size),
        "order_head.weight": torch.zeros(2, d), "order_head.bias": torch.zeros(2),
    }


# PEFT's target names (a module name, or a suffix of its path: "dense" is four Linears) -> our modules' last names
ADAPTER_TARGETS = {"query": ("q_proj",), "key": ("k_proj",), "value": ("v_proj",),
                   "dense": ("out_proj", "fc1", "fc2", "pooler"), "attention.output.dense": ("out_proj",),
                   "output.dense": ("out_proj", "fc2"), "intermediate.dense": ("fc1",), "pooler.dense": ("pooler",)}
ADAPTER_NAMES = EncoderNames("BERT", "bert.", "encoder.layer", LINEARS, ADAPTER_TARGETS,
                             heads={"bert.pooler.dense": "pooler", "classifier": "classifier"})
ADAPTER_LAYOUT = adapter_layout(ADAPTER_NAMES)
