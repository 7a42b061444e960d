"""BertForSequenceClassification and BertModel (an embedding model: no classification head) -> our classifier.

BERT is post-LN with learned positions, token-type (segment) embeddings and an embedding LayerNorm, exact
GELU, no final LayerNorm and unscaled embeddings; its pooler (dense + tanh on [CLS]) feeds the classification
head. A BertModel saved with ``add_pooling_layer=False`` has no pooler weights, which config.json does not
say: :func:`state_dict` sets ``pooler`` from the tensors. BERT's [CLS] id lives in the tokenizer, not in
config.json, so ``cls_id`` keeps our default here.

A PEFT LoRA adapter (on query, key, value, the dense Linears of a layer, pooler.dense) maps onto the same
modules (ADAPTER_LAYOUT), and its own copy of the classification head (modules_to_save: ``classifier``) onto our
``classifier``. Ours go back onto the same modules (``_to_peft``).

Neither architecture saves pre-training heads; ours (``mlm_head``, ``order_head``) load as zeros (uniform
predictions; the MLM decoder stays tied to the token embedding).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from model.config import ClassifierConfig, TransformerConfig
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
from model.lora_config import LoRAConfig
from model.lora_io import KEY_PREFIX, AdapterLayout, PeftFiles, peft_files, peft_targets, unmapped_tensor

HEAD = "BertForSequenceClassification"
ARCHITECTURES = (HEAD, "BertModel")
RULES = (
    Unsupported("position_embedding_type", ("absolute",), "relative position embeddings"),
    Unsupported("is_decoder", (False,), "a causal decoder"),
    Unsupported("add_cross_attention", (False,), "cross-attention layers"),
)
HEAD_RULES = (
    Unsupported("problem_type", (None, "single_label_classification"), "sigmoid (multi-label) or regression outputs"),
)
# A layer's Linears: ours -> BERT's (under encoder.layers.N. / encoder.layer.N.)
LINEARS = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
           "self_attn.v_proj": "attention.self.value", "self_attn.out_proj": "attention.output.dense",
           "ffn.fc1": "intermediate.dense", "ffn.fc2": "output.dense"}
# Checkpoints converted from TensorFlow name LayerNorm parameters gamma / beta (transformers renames them too).
LEGACY_NORM_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def labels(hf: Mapping[str, Any]) -> list[str] | None:
    """The class names of a BertForSequenceClassification in id order (id2label; transformers' LABEL_i names
    when it has none); None for a BertModel, which has no classification head."""
    if HEAD not in (hf.get("architectures") or ARCHITECTURES[:1]):
        return None
    check_supported(hf, HEAD_RULES, HEAD)
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
    if len(names) < 2:
        raise HFImportError(f"{CONFIG_FILE}: num_labels={len(names)} is not supported for {HEAD} (one output is "
                            "a regression or sigmoid score; supported: 2 or more)")
    return names


def to_config(hf: Mapping[str, Any]) -> ClassifierConfig:
    """Our config for BERT's config.json (HFImportError naming a field we cannot express)."""
    check_supported(hf, RULES, "BERT")
    vocab = field(hf, "vocab_size", default=30522)
    pad = field(hf, "pad_token_id", default=0)
    if not 0 <= pad < vocab:
        raise HFImportError(f"{CONFIG_FILE}: pad_token_id={pad} is outside the vocabulary (vocab_size={vocab})")
    type_vocab = field(hf, "type_vocab_size", default=2)
    if type_vocab < 1:
        raise HFImportError(f"{CONFIG_FILE}: type_vocab_size={type_vocab} is not supported (supported: >= 1)")
    return ClassifierConfig(
        vocab_size=vocab,
        d_model=field(hf, "hidden_size", default=768),
        n_heads=field(hf, "num_attention_heads", default=12),
        d_ff=field(hf, "intermediate_size", default=3072),
        dropout=0.0,
        max_len=field(hf, "max_position_embeddings", default=512),
        positions="learned",
        norm="post",
        activation=activation(hf, "hidden_act", "gelu"),
        bias=True,
        scale_embeddings=False,
        tie_embeddings=True,  # the MLM decoder shares the word embedding, as BERT's does
        embedding_norm=True,
        final_norm=False,
        layer_norm_eps=field(hf, "layer_norm_eps", float, 1e-12),
        pad_id=pad,
        n_layers=field(hf, "num_hidden_layers", default=12),
        num_labels=len(labels(hf) or ()),
        type_vocab_size=type_vocab,
        pooler=True,
    )


def state_dict(c: ClassifierConfig, tensors: Tensors) -> Tensors:
    """Our classifier's state dict from BERT's tensors (shapes checked); a BertModel without pooler weights
    sets ``c.pooler`` False."""
    t = {_modern_name(k): v for k, v in strip_prefix(tensors, "bert.").items()}
    d, ff = c.d_model, c.d_ff
    embed = take(t, "embeddings.word_embeddings.weight", (c.vocab_size, d))
    ours = {
        "embed.tokens.weight": embed,
        "embed.positions.weight": take(t, "embeddings.position_embeddings.weight", (c.max_len, d)),
        "embed.segments.weight": take(t, "embeddings.token_type_embeddings.weight", (c.type_vocab_size, d)),
        **_weight_bias(t, "embeddings.LayerNorm.", "embed.norm.", (d,)),
    }
    for i in range(c.n_layers):
        p, q = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        for name, theirs in LINEARS.items():
            shape = {"ffn.fc1": (ff, d), "ffn.fc2": (d, ff)}.get(name, (d, d))
            ours |= _weight_bias(t, f"{p}{theirs}.", f"{q}{name}.", shape)
        ours |= _weight_bias(t, f"{p}attention.output.LayerNorm.", f"{q}self_attn_norm.", (d,))
        ours |= _weight_bias(t, f"{p}output.LayerNorm.", f"{q}ffn_norm.", (d,))
    if c.num_labels == 0:
        c.pooler = "pooler.dense.weight" in t  # BertModel(add_pooling_layer=False) saves none
    if c.pooler:
        ours |= _weight_bias(t, "pooler.dense.", "pooler.", (d, d))
    if c.num_labels:
        ours |= _weight_bias(t, "classifier.", "classifier.", (c.num_labels, d))
    return ours | _untrained_heads(c, embed)


def _modern_name(name: str) -> str:
    for legacy, modern in LEGACY_NORM_NAMES.items():
        if name.endswith(legacy):
            return name.removesuffix(legacy) + modern
    return name


def _weight_bias(t: Tensors, theirs: str, ours: str, shape: tuple[int, ...]) -> Tensors:
    """``theirs`` weight (``shape``) and bias (``shape[:1]``) of a Linear or LayerNorm, named ``ours``."""
    return {f"{ours}weight": take(t, f"{theirs}weight", shape), f"{ours}bias": take(t, f"{theirs}bias", shape[:1])}


def _untrained_heads(c: ClassifierConfig, embed: torch.Tensor) -> Tensors:
    """Our pre-training heads, which BERT's fine-tuned and base checkpoints do not carry: zero outputs."""
    d = c.d_model
    return {
        "mlm_head.dense.weight": torch.zeros(d, d), "mlm_head.dense.bias": torch.zeros(d),
        "mlm_head.norm.weight": torch.ones(d), "mlm_head.norm.bias": torch.zeros(d),
        "mlm_head.decoder.weight": embed, "mlm_head.decoder.bias": torch.zeros(c.vocab_size),
        "order_head.weight": torch.zeros(2, d), "order_head.bias": torch.zeros(2),
    }


# PEFT's target names (a module name, or a suffix of its path: "dense" is four Linears) -> our modules' last names
_ADAPTER_TARGETS = {"query": ("q_proj",), "key": ("k_proj",), "value": ("v_proj",),
                    "dense": ("out_proj", "fc1", "fc2", "pooler"), "attention.output.dense": ("out_proj",),
                    "output.dense": ("out_proj", "fc2"), "intermediate.dense": ("fc1",), "pooler.dense": ("pooler",)}
_ADAPTER_MODULES = {theirs: ours for ours, theirs in LINEARS.items()}
_LAYER_LINEAR = "|".join(map(re.escape, _ADAPTER_MODULES))
_ADAPTER_KEY = re.compile(rf"base_model\.model\.(?:bert\.)?(?:encoder\.layer\.(\d+)\.({_LAYER_LINEAR})|pooler\.dense)"
                          r"\.lora_([AB])\.weight")
_HEAD_KEY = re.compile(r"base_model\.model\.classifier\.(?:weight|bias)")  # the adapter's head copy: ours alike


def _adapter_config(d: dict[str, Any]) -> dict[str, Any]:
    return peft_targets(d, _ADAPTER_TARGETS, "BERT")


def _adapter_tensors(tensors: dict[str, torch.Tensor], model: TransformerConfig) -> dict[str, torch.Tensor]:
    ours = {}
    for key, t in tensors.items():
        if _HEAD_KEY.fullmatch(key):
            ours[key] = t
            continue
        match = _ADAPTER_KEY.fullmatch(key)
        if match is None:
            raise unmapped_tensor(key, "BERT", _ADAPTER_TARGETS)
        layer, module, kind = match.groups()
        path = "pooler" if layer is None else f"encoder.layers.{layer}.{_ADAPTER_MODULES[module]}"
        ours[f"base_model.model.{path}.lora_{kind}.weight"] = t
    return ours


_OUR_KEY = re.compile(rf"base_model\.model\.(?:encoder\.layers\.(\d+)\.({'|'.join(map(re.escape, LINEARS))})|pooler)"
                      r"\.lora_([AB])\.weight")


def _to_peft(config: LoRAConfig, tensors: dict[str, torch.Tensor], model: TransformerConfig) -> PeftFiles:
    """Our adapter as PEFT's on BertForSequenceClassification (``bert.`` paths), or on a BertModel (no head).
    task_type stays None: PEFT's SEQ_CLS would expect the adapter to carry its own classification head."""
    prefix = "bert." if getattr(model, "num_labels", 0) else ""
    theirs = {}
    for key, t in tensors.items():
        if _HEAD_KEY.fullmatch(key):  # BertForSequenceClassification's classifier: the same path
            theirs[key] = t
            continue
        match = _OUR_KEY.fullmatch(key)
        if match is None:
            raise unmapped_tensor(key, "BERT", [*LINEARS, "pooler"])
        layer, module, kind = match.groups()
        path = "pooler.dense" if layer is None else f"encoder.layer.{layer}.{LINEARS[module]}"
        theirs[f"{KEY_PREFIX}{prefix}{path}.lora_{kind}.weight"] = t
    return peft_files(config, theirs, None)


ADAPTER_LAYOUT = AdapterLayout(config=_adapter_config, tensors=_adapter_tensors, to_peft=_to_peft)
