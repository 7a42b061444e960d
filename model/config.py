"""One dataclass config per model family, validated on construction and saved in every checkpoint.

The shared fields can express the paper's base model, GPT-2 and BERT exactly:

- paper / Marian: sinusoidal positions, post-LN, ReLU, scaled and tied embeddings;
- GPT-2: learned positions, pre-LN with a final LayerNorm, tanh-approximated GELU, no scaling;
- BERT: learned positions, segment embeddings, embedding LayerNorm, post-LN, exact GELU; RoBERTa and DistilBERT
  add a position offset and a ReLU pooler (ClassifierConfig);
- ModernBERT: the Llama-style blocks in a pre-LN encoder (rotary, GeGLU, local layers with a bidirectional window, no
  attention norm on layer 0) and a dense -> act -> norm head over [CLS] or the mean (ClassifierConfig).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from model.rope import check_scaling

POSITIONS = ("sinusoidal", "learned", "rope", "relative")
NORM_TYPES = ("layer", "rms")
FFNS = ("mlp", "gated")
NORMS = ("pre", "post")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
POOLER_ACTIVATIONS = ("tanh", "relu", "gelu", "gelu_tanh", "silu")
HEAD_POOLINGS = ("cls", "mean")  # what a sequence head reads: the [CLS] state, or the mean of the non-pad states
OUTPUT_ACTIVATIONS = ("softmax", "sigmoid", "none")  # a classifier's served outputs
CLASSIFIER_HEADS = ("sequence", "token")  # a classifier's head: one row of logits per text, or per token


class ModelConfigError(ValueError):
    """A model config field is missing or outside its allowed range (a request's bad generation field is
    model.generation_config.ConfigError)."""


@dataclass
class TransformerConfig:
    """Fields shared by every family."""

    vocab_size: int = 8000  # target/output vocabulary (shared with the source unless src_vocab_size is set)
    d_model: int = 256  # width of the residual stream
    n_heads: int = 4  # attention heads; d_model must divide evenly
    d_ff: int = 1024  # inner width of the position-wise feed-forward block
    dropout: float = 0.1  # on embeddings, sub-layer outputs and attention weights (training only)
    max_len: int = 512  # longest sequence the positional encoding covers
    positions: str = "sinusoidal"  # "sinusoidal" (the paper) or "learned" (GPT-2, BERT); "rope", "relative" (T5)
    norm: str = "pre"  # "pre": x + f(LN(x)); "post" (the paper): LN(x + f(x))
    activation: str = "relu"  # "relu" (the paper), "gelu" (BERT), "gelu_tanh" (GPT-2), "silu" (OPUS-MT's swish)
    bias: bool = True  # biases in the attention and feed-forward projections
    scale_embeddings: bool = True  # multiply token embeddings by sqrt(d_model) (the paper)
    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    embedding_norm: bool = False  # LayerNorm right after the embedding sum (BERT)
    final_norm: bool | None = None  # LayerNorm after the last layer; None = on for pre-LN, off for post-LN
    layer_norm_eps: float = 1e-5
    pad_id: int = 0  # padding token id (masked out of attention)
    # Llama-style blocks (every default is the blocks above; :attr:`extended` says whether any is changed)
    norm_type: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm, no bias; eps = layer_norm_eps)
    rope_theta: float = 10000.0  # base of the rotary frequencies (positions="rope")
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters we honour (model.rope.SCALING_KEYS); None = plain
    rotary_dim: int | None = None  # rotated features of each head, the rest passed through (None = head_dim; Phi-3)
    n_kv_heads: int | None = None  # grouped-query attention: heads of K/V (None = n_heads)
    head_size: int | None = None  # width of one head (None = d_model / n_heads)
    ffn: str = "mlp"  # "mlp": fc2(act(fc1 x)); "gated": fc2(act(fc1 x) * up(x)) (SwiGLU with silu)
    ffn_bias: bool | None = None  # biases in the feed-forward projections (None = ``bias``)
    out_bias: bool | None = None  # a bias on attention's output projection (None = ``bias``; Qwen2: q/k/v only)
    qk_norm: bool = False  # a norm over each head of q and of k, before rope (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # pre-LN plus a norm of each sub-layer's output before the residual add (Gemma 3)
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), weights stored as offsets from 1 (Gemma)
    attention_scale: float | None = None  # scale of q.k (None = 1 / sqrt(head_dim); Gemma: query_pre_attn_scalar)
    sliding_window: int | None = None  # a query sees the keys less than this many positions back (None = all)
    window_layers: list[bool] | None = None  # which layers attend within sliding_window (None = every layer)
    rope_local_theta: float | None = None  # rotary base of the window layers, unscaled (Gemma 3; None = as all)
    # positions="relative" (T5, seq2seq only): a learned bias per head and distance bucket on the self-attention
    # scores (model.relative_position), exact up to half the buckets, logarithmic up to the max distance
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # the window reaches as far ahead as back: |q - k| < sliding_window (an encoder's local layers: ModernBERT)
    bidirectional_window: bool = False
    first_attn_norm: bool = True  # layer 0 normalizes its attention input (False: it reads x as is; ModernBERT)
    # q and k rounded to float32 before rotation, computed in the promoted dtype (transformers' ModernBERT): float64
    # or bfloat16 models round as it does; float32 ones are unchanged
    rotary_float32: bool = False

    family: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if self.final_norm is None:
            self.final_norm = self.norm == "pre"
        _check(self.vocab_size >= 8, "vocab_size", "must be at least 8")
        _check(self.d_model > 0 and self.n_heads > 0, "d_model/n_heads", "must be positive")
        if self.head_size is None:
            _check(self.d_model % self.n_heads == 0, "d_model", f"must be divisible by n_heads={self.n_heads}")
        else:
            _check(self.head_size > 0, "head_size", "must be positive")
        _check(self.positions != "rope" or self.rotary_width % 2 == 0, "head_size/rotary_dim",
               "must be even for rotary positions")
        _check(self.rotary_dim is None or 0 < self.rotary_dim <= self.head_dim, "rotary_dim",
               "must be in (0, head_dim]")
        _check(self.positions == "rope" or self.rope_scaling is None and self.rotary_dim is None,
               "rope_scaling/rotary_dim", 'need positions="rope"')
        try:
            check_scaling(self.rope_scaling, self.rotary_width)
        except ValueError as exc:
            raise ModelConfigError(f"rope_scaling {exc}") from exc
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        _check(kv > 0 and self.n_heads % kv == 0, "n_kv_heads", f"must divide n_heads={self.n_heads}")
        _check(self.norm_type in NORM_TYPES, "norm_type", f"must be one of {NORM_TYPES}")
        _check(self.ffn in FFNS, "ffn", f"must be one of {FFNS}")
        _check(self.rope_theta > 0, "rope_theta", "must be positive")
        _check(self.sliding_window is None or self.sliding_window > 0, "sliding_window", "must be positive")
        _check(self.sliding_window is not None or self.window_layers is None and self.rope_local_theta is None,
               "window_layers/rope_local_theta", "need a sliding_window")
        _check(self.rope_local_theta is None or self.rope_local_theta > 0, "rope_local_theta", "must be positive")
        _check(self.sliding_window is not None or not self.bidirectional_window, "bidirectional_window",
               "needs a sliding_window")
        _check(self.first_attn_norm or self.norm == "pre", "first_attn_norm", "False needs norm='pre'")
        _check(not self.rotary_float32 or self.positions == "rope" and self.rotary_dim is None, "rotary_float32",
               "needs positions='rope' over the whole head (rotary_dim None)")
        _check(self.attention_scale is None or self.attention_scale > 0, "attention_scale", "must be positive")
        _check(not (self.norm_offset or self.qk_norm) or self.norm_type == "rms", "norm_offset/qk_norm",
               "need norm_type='rms'")
        _check(not self.sandwich_norm or self.norm == "pre", "sandwich_norm", "needs norm='pre'")
        _check(self.d_ff > 0, "d_ff", "must be positive")
        _check(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        _check(self.max_len > 0, "max_len", "must be positive")
        _check(self.positions in POSITIONS, "positions", f"must be one of {POSITIONS}")
        _check(self.positions != "relative" or self.family == "seq2seq", "positions", "'relative' is for seq2seq only")
        _check(self.relative_buckets >= 4, "relative_buckets", "must be at least 4")
        _check(self.relative_max_distance > self.relative_buckets // 2, "relative_max_distance",
               "must be above relative_buckets / 2")
        _check(self.norm in NORMS, "norm", f"must be one of {NORMS}")
        _check(self.activation in ACTIVATIONS, "activation", f"must be one of {ACTIVATIONS}")
        _check(0 <= self.pad_id < self.vocab_size, "pad_id", "must be a valid token id")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.d_model // self.n_heads

    @property
    def rotary_width(self) -> int:
        """Features of each head that rotary positions rotate (the rest pass through)."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def extended(self) -> bool:
        """Whether any Llama-family field (or T5's relative positions) differs from the original blocks (classifier
        configs take ModernBERT's, seq2seq configs T5's; model.native_support.unsupported says which the C++ step
        implements)."""
        return (self.positions in ("rope", "relative") or self.norm_type != "layer" or self.kv_heads != self.n_heads
                or self.head_dim * self.n_heads != self.d_model or self.ffn != "mlp"
                or self.ffn_bias not in (None, self.bias) or self.out_bias not in (None, self.bias) or self.qk_norm
                or self.sandwich_norm or self.norm_offset or self.attention_scale is not None
                or self.sliding_window is not None or self.bidirectional_window or not self.first_attn_norm
                or self.rotary_float32)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier position)."""
        if self.window_layers is not None and not self.window_layers[layer]:
            return None
        return self.sliding_window

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Build the config of the family named in ``data`` (unknown keys are an error)."""
        data = dict(data)
        family = data.pop("family", cls.family)
        scale = data.pop("rope_scale", 1.0)  # the first Llama step's field: a linear factor
        if scale != 1.0 and data.get("rope_scaling") is None:
            data["rope_scaling"] = {"rope_type": "linear", "factor": scale}
        config_cls = CONFIGS.get(family)
        if config_cls is None:
            raise ModelConfigError(f"unknown model family {family!r}; expected one of {sorted(CONFIGS)}")
        names = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ModelConfigError(f"unknown {family} config fields: {unknown}")
        try:
            return config_cls(**data)
        except TypeError as exc:
            raise ModelConfigError(f"invalid {family} config: {exc}") from exc


@dataclass
class Seq2SeqConfig(TransformerConfig):
    """Encoder-decoder for translation ("Attention Is All You Need")."""

    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    src_vocab_size: int | None = None  # None: source and target share one vocabulary and embedding
    max_src_len: int = 256  # longest accepted source, in tokens
    bos_id: int = 1  # decoder start token
    eos_id: int = 2
    head_bias: bool = False  # a bias on the output logits (Marian's final_logits_bias)
    head_scale: float = 1.0  # the decoder's output times this before the head (T5's tied head: d_model ** -0.5)
    # False: the encoder has its own position table and embedding LayerNorm, sharing only the token embedding
    # with the decoder (BART, mBART); True: one Embeddings for both sides when the vocabulary is shared
    shared_positions: bool = True
    pad_positions: bool = True  # False: pad tokens get no position embedding (M2M100's zero padding_idx row)

    family: ClassVar[str] = "seq2seq"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.n_encoder_layers > 0 and self.n_decoder_layers > 0, "n_*_layers", "must be positive")
        _check(self.positions != "rope" and self.kv_heads == self.n_heads and self.sliding_window is None
               and not (self.qk_norm or self.sandwich_norm or self.norm_offset) and self.first_attn_norm
               and self.ffn_bias in (None, self.bias) and self.out_bias in (None, self.bias),
               "the Llama-style fields (rope, n_kv_heads, qk_norm, sandwich_norm, norm_offset, sliding_window, "
               "first_attn_norm, ffn_bias, out_bias)", "must keep their defaults: seq2seq takes norm_type, head_size, "
               "ffn and attention_scale of them (T5)")
        _check(self.head_scale > 0 and math.isfinite(self.head_scale), "head_scale", "must be positive and finite")
        _check(self.max_src_len <= self.max_len, "max_src_len", f"must be <= max_len={self.max_len}")
        _check(self.pad_positions or self.positions == "learned", "pad_positions", 'False needs positions="learned"')
        if self.src_vocab_size is not None:
            _check(self.src_vocab_size >= 8, "src_vocab_size", "must be at least 8")


@dataclass
class ClassifierConfig(TransformerConfig):
    """BERT-style bidirectional encoder with [CLS] (or mean) pooling and pre-training heads. The Llama-style blocks
    may be set too (ModernBERT: rotary positions, a gated FFN, local layers with a bidirectional window)."""

    n_layers: int = 4
    num_labels: int = 2  # 0: no classification head (an embedding model)
    type_vocab_size: int = 2  # segment embeddings for sentence pairs (0 = off)
    pooler: bool = True  # a dense layer + pooler_activation on the [CLS] state before the classification head
    cls_id: int = 4
    # "tanh" (BERT's pooler, RoBERTa's head dense), "relu" (DistilBERT's), "gelu"... (ModernBERT's head dense)
    pooler_activation: str = "tanh"
    head_norm: bool = False  # a LayerNorm after the pooler's activation (ModernBERT's head: dense -> act -> norm)
    head_pooling: str = "cls"  # what the sequence head reads: "cls" or "mean" (ModernBERT's classifier_pooling)
    # > 0: positions count non-pad tokens from here, pads at position_offset - 1 (RoBERTa / fairseq: pad_id + 1);
    # the position table then has max_len + position_offset rows. 0: position t is t (BERT).
    position_offset: int = 0
    # what classify serves from the logits: "softmax" (single-label), "sigmoid" (multi-label: each label's
    # probability; a one-label relevance score), "none" (regression: the raw values)
    output_activation: str = "softmax"
    # "sequence": the classifier reads the pooled [CLS] (forward); "token": it reads every hidden state (token_logits:
    # NER-style *ForTokenClassification), through the pooler and head_norm where there is one (ModernBERT's head)
    head: str = "sequence"

    family: ClassVar[str] = "classifier"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.n_layers > 0, "n_layers", "must be positive")
        _check(self.position_offset == 0 or self.positions == "learned", "position_offset", "needs positions='learned'")
        _check(self.sliding_window is None or self.bidirectional_window, "sliding_window",
               "of an encoder needs bidirectional_window (it reaches ahead as far as back)")
        _check(self.window_layers is None or len(self.window_layers) == self.n_layers, "window_layers",
               f"must have one entry per layer ({self.n_layers})")
        _check(self.num_labels >= 0, "num_labels", "must be >= 0 (0 = no classification head)")
        _check(self.type_vocab_size >= 0, "type_vocab_size", "must be >= 0")
        _check(self.pooler_activation in POOLER_ACTIVATIONS, "pooler_activation",
               f"must be one of {POOLER_ACTIVATIONS}")
        _check(self.position_offset >= 0, "position_offset", "must be >= 0")
        _check(self.output_activation in OUTPUT_ACTIVATIONS, "output_activation",
               f"must be one of {OUTPUT_ACTIVATIONS}")
        _check(self.head in CLASSIFIER_HEADS, "head", f"must be one of {CLASSIFIER_HEADS}")
        _check(self.head == "sequence" or self.num_labels > 0, "head", "'token' needs num_labels > 0")
        _check(self.head_pooling in HEAD_POOLINGS, "head_pooling", f"must be one of {HEAD_POOLINGS}")
        _check(self.head_pooling == "cls" or self.head == "sequence", "head_pooling", "'mean' needs head='sequence'")
        _check(not self.head_norm or self.pooler, "head_norm", "needs a pooler (the norm follows its activation)")


@dataclass
class CausalLMConfig(TransformerConfig):
    """GPT-style decoder-only language model."""

    n_layers: int = 4
    bos_id: int = 1
    eos_id: int = 2

    family: ClassVar[str] = "causal_lm"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.n_layers > 0, "n_layers", "must be positive")
        _check(self.window_layers is None or len(self.window_layers) == self.n_layers, "window_layers",
               f"must have one entry per layer ({self.n_layers})")


CONFIGS: dict[str, type[TransformerConfig]] = {c.family: c for c in (Seq2SeqConfig, ClassifierConfig, CausalLMConfig)}


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ModelConfigError(f"{field} {message}")
