"""ModernBertModel / ModernBertForSequenceClassification / ModernBertForTokenClassification -> our classifier.

ModernBERT is a pre-LN encoder of the Llama-style blocks: token embeddings -> LayerNorm (no position table), rotary
positions, a fused ``Wqkv`` (rows q, k, v) split onto our q/k/v, GeGLU with a fused ``Wi`` (rows: the activated
input, then the gate) split onto our fc1 / up, no attention norm on layer 0, a final norm. Its layers are global
(``layer_types`` "full_attention", or every ``global_attn_every_n_layers``-th in older files) with the
"full_attention" rotary base, or local with the "sliding_attention" base (unscaled) and a bidirectional window
|i - j| <= local_attention // 2 (our ``sliding_window`` = that + 1, ``bidirectional_window``). The head is
``dense -> classifier_activation -> norm`` (our pooler, pooler_activation and head_norm) on [CLS] or on the mean of
the non-pad states (``classifier_pooling``), then ``classifier``; a token head applies it to every state.
``norm_bias`` / ``classifier_bias`` False: our LayerNorms and the head dense get zero biases (the same outputs).
``problem_type`` rules as BERT's (bert.py). Not imported: ModernBertForMaskedLM and the other heads (refused by
their architecture name); our pre-training heads load as zeros. q and k are rotated through float32
(``rotary_float32``), as transformers does. PEFT adapters (``Wqkv Wo Wi`` and ``head.dense``; ``classifier``, the
SEQ_CLS / TOKEN_CLS head, and ``head``, its dense and norm, in modules_to_save) map through
model.hf.encoder_adapters (ADAPTER_LAYOUT), a fused module's LoRA split onto our parts; a copy of ``head`` is one of
our pooler and one of head_norm (without a bias where ``classifier_bias`` / ``norm_bias`` is False, as theirs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from model.config import ClassifierConfig
from model.hf import bert
from model.hf.common import CONFIG_FILE, HFImportError, Tensors, activation, field, strip_prefix, take
from model.hf.encoder_adapters import EncoderNames, adapter_layout
from model.hf.rope import rope_fields

HEAD = "ModernBertForSequenceClassification"
TOKEN_HEAD = "ModernBertForTokenClassification"
ARCHITECTURES = (HEAD, "ModernBertModel", TOKEN_HEAD)
LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # layer type -> a local (window) layer
GLOBAL_THETA, LOCAL_THETA = 160_000.0, 10_000.0  # transformers' defaults
# A layer's Linears: ModernBERT's (under layers.N.) -> ours; a fused one -> our parts in its row order
LINEARS: dict[str, str | tuple[str, ...]] = {
    "attn.Wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn.Wo": "self_attn.out_proj",
    "mlp.Wi": ("ffn.fc1", "ffn.up"), "mlp.Wo": "ffn.fc2"}
NORMS = {"attn_norm": "self_attn_norm", "mlp_norm": "ffn_norm"}
# PEFT's target names (a module name, or a suffix of its path: "Wo" is attention's and the MLP's) -> our last names
ADAPTER_TARGETS = {"Wqkv": ("q_proj", "k_proj", "v_proj"), "Wi": ("fc1", "up"), "Wo": ("out_proj", "fc2"),
                   "attn.Wqkv": ("q_proj", "k_proj", "v_proj"), "attn.Wo": ("out_proj",), "mlp.Wi": ("fc1", "up"),
                   "mlp.Wo": ("fc2",), "dense": ("pooler",), "head.dense": ("pooler",)}
ADAPTER_NAMES = EncoderNames("ModernBERT", "model.", "layers",
                             {ours: theirs for theirs, ours in LINEARS.items() if isinstance(ours, str)},
                             ADAPTER_TARGETS,
                             heads={"head.dense": "pooler", "head.norm": "head_norm", "classifier": "classifier"},
                             saves={"head": ("pooler", "head_norm")},
                             fused={theirs: ours for theirs, ours in LINEARS.items() if not isinstance(ours, str)})
ADAPTER_LAYOUT = adapter_layout(ADAPTER_NAMES)

__all__ = ["ADAPTER_LAYOUT", "ARCHITECTURES", "labels", "state_dict", "to_config"]


def labels(hf: Mapping[str, Any]) -> list[str] | None:
    """The class names of a ModernBertFor*Classification in id order; None for a ModernBertModel."""
    return bert.head_labels(hf, ARCHITECTURES, (HEAD, TOKEN_HEAD))


def to_config(hf: Mapping[str, Any]) -> ClassifierConfig:
    """Our config for ModernBERT's config.json (HFImportError naming a field we cannot express)."""
    names = labels(hf)
    head = bert.head_kind(hf, (TOKEN_HEAD,))
    d, heads = field(hf, "hidden_size", default=768), field(hf, "num_attention_heads", default=12)
    if heads <= 0 or d % heads:
        raise HFImportError(f"{CONFIG_FILE}: hidden_size={d} must be a multiple of num_attention_heads={heads}")
    if field(hf, "head_dim", default=d // heads) != d // heads:
        raise HFImportError(f"{CONFIG_FILE}: head_dim={hf['head_dim']} is not supported for ModernBERT (its "
                            f"attention uses hidden_size / num_attention_heads = {d // heads})")
    vocab, pad = field(hf, "vocab_size", default=50368), field(hf, "pad_token_id", default=50283)
    if not 0 <= pad < vocab:
        raise HFImportError(f"{CONFIG_FILE}: pad_token_id={pad} is outside the vocabulary (vocab_size={vocab})")
    cls = field(hf, "cls_token_id", default=50281)
    local = _local_layers(hf)
    rope = rope_fields(hf, d // heads, layer_type="full_attention",
                       default_theta=field(hf, "global_rope_theta", (int, float), GLOBAL_THETA),
                       default_max_positions=8192)
    window: dict[str, Any] = {}
    if any(local):
        window = {"sliding_window": field(hf, "local_attention", default=128) // 2 + 1, "window_layers": local,
                  "bidirectional_window": True, "rope_local_theta": _local_theta(hf, d // heads, rope)}
    num_labels = len(names or ())
    attention_bias = field(hf, "attention_bias", bool, False)
    return ClassifierConfig(
        vocab_size=vocab, d_model=d, n_heads=heads, d_ff=field(hf, "intermediate_size", default=1152), dropout=0.0,
        max_len=field(hf, "max_position_embeddings", default=8192), positions="rope", norm="pre",
        activation=activation(hf, "hidden_activation", "gelu"), bias=attention_bias,
        ffn_bias=field(hf, "mlp_bias", bool, False), out_bias=attention_bias, scale_embeddings=False,
        tie_embeddings=True, embedding_norm=True, final_norm=True, layer_norm_eps=field(hf, "norm_eps", float, 1e-5),
        pad_id=pad, ffn="gated", first_attn_norm=False, rotary_float32=True, **rope, **window,
        n_layers=len(local), num_labels=num_labels, type_vocab_size=0, pooler=bool(num_labels),
        cls_id=cls if 0 <= cls < vocab else ClassifierConfig.cls_id,
        pooler_activation=activation(hf, "classifier_activation", "gelu"), head_norm=bool(num_labels),
        head_pooling=_pooling(hf) if head == "sequence" else "cls",
        output_activation=bert.output_activation(hf, num_labels) if num_labels and head == "sequence" else "softmax",
        head=head,
    )


def _local_layers(hf: Mapping[str, Any]) -> list[bool]:
    """Which layers are local: ``layer_types``, else every layer but each ``global_attn_every_n_layers``-th."""
    n_layers = field(hf, "num_hidden_layers", default=22)
    types = hf.get("layer_types")
    if types is None:
        every = field(hf, "global_attn_every_n_layers", default=3)
        if every <= 0:
            raise HFImportError(f"{CONFIG_FILE}: global_attn_every_n_layers={every} must be positive")
        return [bool(i % every) for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise HFImportError(f"{CONFIG_FILE}: layer_types must list one of {sorted(LAYER_TYPES)} per layer "
                            f"({n_layers})")
    return [LAYER_TYPES[t] for t in types]


def _local_theta(hf: Mapping[str, Any], head_dim: int, rope: Mapping[str, Any]) -> float:
    """The local layers' rotary base: plain rope, as wide as the global layers'."""
    local = rope_fields(hf, head_dim, layer_type="sliding_attention",
                        default_theta=field(hf, "local_rope_theta", (int, float), LOCAL_THETA))
    if local["rope_scaling"] is not None or local["rotary_dim"] != rope["rotary_dim"]:
        raise HFImportError(f"{CONFIG_FILE}: rope scaling or a partial rotary width on the sliding_attention layers "
                            "is not supported for ModernBERT (supported: plain rope there)")
    return local["rope_theta"]


def _pooling(hf: Mapping[str, Any]) -> str:
    pooling = field(hf, "classifier_pooling", str, "cls")
    if pooling not in ("cls", "mean"):
        raise HFImportError(f"{CONFIG_FILE}: classifier_pooling={pooling!r} is not supported (supported: cls, mean)")
    return pooling


def state_dict(c: ClassifierConfig, tensors: Tensors) -> Tensors:
    """Our classifier's state dict from ModernBERT's tensors (``model.`` prefix under a head); the fused projections
    split into our parts, a missing bias (``*_bias`` False) zero."""
    t = strip_prefix(tensors, "model.")
    d, ff = c.d_model, c.d_ff
    shapes = {"attn.Wqkv": ((3 * d, d), c.bias), "attn.Wo": ((d, d), c.out_bias), "mlp.Wi": ((2 * ff, d), c.ffn_bias),
              "mlp.Wo": ((d, ff), c.ffn_bias)}  # (shape, whether ours have biases) of LINEARS
    embed = take(t, "embeddings.tok_embeddings.weight", (c.vocab_size, d))
    ours = {"embed.tokens.weight": embed, **_norm(t, "embeddings.norm.", "embed.norm.", d)}
    for i in range(c.n_layers):
        p, q = f"layers.{i}.", f"encoder.layers.{i}."
        for theirs, parts in LINEARS.items():
            parts = (parts,) if isinstance(parts, str) else parts
            ours |= _linear(t, f"{p}{theirs}.", [f"{q}{part}." for part in parts], *shapes[theirs])
        for theirs, name in NORMS.items():
            if i or name != "self_attn_norm":  # layer 0 has no attention norm
                ours |= _norm(t, f"{p}{theirs}.", f"{q}{name}.", d)
    ours |= _norm(t, "final_norm.", "encoder.final_norm.", d)
    if c.num_labels:
        ours |= _linear(t, "head.dense.", ["pooler."], (d, d), True)
        ours |= _norm(t, "head.norm.", "head_norm.", d)
        ours |= bert.weight_bias(t, "classifier.", "classifier.", (c.num_labels, d))
    return ours | bert.untrained_heads(c, embed)


def _linear(t: Tensors, theirs: str, ours: list[str], shape: tuple[int, int], bias: bool | None) -> Tensors:
    """``theirs`` Linear (``shape``), its rows split evenly onto ``ours`` in order; with ``bias`` (ours have one)
    its bias too, zeros where it has none (``classifier_bias`` False)."""
    weight = take(t, f"{theirs}weight", shape)
    out = {f"{name}weight": part for name, part in zip(ours, weight.chunk(len(ours)), strict=True)}
    if bias:
        b = take(t, f"{theirs}bias", shape[:1]) if f"{theirs}bias" in t else torch.zeros(shape[0], dtype=weight.dtype)
        out |= {f"{name}bias": part for name, part in zip(ours, b.chunk(len(ours)), strict=True)}
    return out


def _norm(t: Tensors, theirs: str, ours: str, d: int) -> Tensors:
    """``theirs`` LayerNorm as ours: its bias, or zeros (``norm_bias`` False)."""
    weight = take(t, f"{theirs}weight", (d,))
    bias = take(t, f"{theirs}bias", (d,)) if f"{theirs}bias" in t else torch.zeros(d, dtype=weight.dtype)
    return {f"{ours}weight": weight, f"{ours}bias": bias}
