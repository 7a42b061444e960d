"""T5ForConditionalGeneration and MT5ForConditionalGeneration -> our seq2seq: a map of config fields and tensor names
onto the flagged blocks.

T5 is pre-norm with RMSNorms (T5LayerNorm: no mean, no bias) and one at the end of each stack, no biases, no
embedding scaling and no position table: a relative position bias (model.relative_position; bidirectional in the
encoder, causal in the decoder) from layer 0's table serves every self-attention layer of its stack. q.k is not
scaled (attention_scale 1), heads are ``d_kv`` wide (num_heads * d_kv may differ from d_model), the decoder starts
from the pad id. ``feed_forward_proj`` "relu" (T5 v1.0) is fc2(relu(fc1 x)); "gated-gelu" (v1.1, Flan-T5, mT5) is
wo(gelu_tanh(wi_0 x) * wi_1 x) (our fc1 = wi_0, up = wi_1, fc2 = wo).

The head, as transformers 5.23 computes it: T5 scales the decoder's output by d_model ** -0.5 unless config.json says
``tie_word_embeddings: false`` (``scale_decoder_outputs`` when transformers wrote the file); mT5 never does. A scaled
head (v1.0) is the shared embedding (a saved ``lm_head.weight`` of other values is refused, naming it); an unscaled
one (v1.1, mT5) is ``lm_head.weight``, or a copy of ``shared.weight`` where the file has none (transformers ties
them then).
UMT5 (a relative position table in every layer) has no importer: its model_type is refused by name.

A PEFT LoRA adapter on q, k, v, o (self- and cross-attention: ``SelfAttention``, ``EncDecAttention``) and wi, wi_0,
wi_1, wo (``DenseReluDense``) maps onto the same Linears, unchanged (ADAPTER_LAYOUT).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from model.config import Seq2SeqConfig, TransformerConfig
from model.hf.common import ACTIVATIONS, CONFIG_FILE, WEIGHTS_FILE, HFImportError, Tensors, field, take, token_id_field
from model.lora_config import LoRAConfig
from model.lora_io import KEY_PREFIX, AdapterLayout, PeftFiles, peft_files, peft_targets, unmapped_tensor

ARCHITECTURES = ("T5ForConditionalGeneration", "MT5ForConditionalGeneration")
SHARED, HEAD = "shared.weight", "lm_head.weight"
TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")  # older saves hold them
ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
FFN = {"wi": "fc1", "wi_0": "fc1", "wi_1": "up", "wo": "fc2"}  # DenseReluDense's -> our FeedForward's
BIAS_TABLE = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
_BLOCKS = {"SelfAttention": "self_attn", "EncDecAttention": "cross_attn", "DenseReluDense": "ffn"}  # a T5Block's


def to_config(hf: Mapping[str, Any]) -> Seq2SeqConfig:
    """Our config for a T5 or mT5 config.json (HFImportError naming a field we cannot express)."""
    mt5 = hf.get("model_type") == "mt5"
    if not field(hf, "is_encoder_decoder", bool, True) or field(hf, "is_decoder", bool, False):
        raise HFImportError(f"{CONFIG_FILE}: is_encoder_decoder=false / is_decoder=true is not supported for T5 "
                            "(the encoder-decoder only)")
    vocab = field(hf, "vocab_size", default=250112 if mt5 else 32128)
    d_model, heads = field(hf, "d_model", default=512), field(hf, "num_heads", default=6 if mt5 else 8)
    d_kv = field(hf, "d_kv", default=64)
    layers = field(hf, "num_layers", default=8 if mt5 else 6)
    gated, activation = _feed_forward(field(hf, "feed_forward_proj", str, "gated-gelu" if mt5 else "relu"))
    ids = {name: token_id_field(hf, name, vocab, default)
           for name, default in (("pad_token_id", 0), ("eos_token_id", 1))}
    ids["decoder_start_token_id"] = token_id_field(hf, "decoder_start_token_id", vocab, ids["pad_token_id"])
    max_len = field(hf, "n_positions", default=512)  # no table: the longest sequence served
    if max_len <= 0:
        raise HFImportError(f"{CONFIG_FILE}: n_positions={max_len} must be positive")
    tied = not mt5 and _scales_output(hf)  # a v1.0 head: the shared embedding, scaled
    return Seq2SeqConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_heads=heads,
        head_size=d_kv if d_kv * heads != d_model else None,
        d_ff=field(hf, "d_ff", default=1024 if mt5 else 2048),
        dropout=0.0,
        max_len=max_len,
        max_src_len=max_len,
        positions="relative",
        relative_buckets=field(hf, "relative_attention_num_buckets", default=32),
        relative_max_distance=field(hf, "relative_attention_max_distance", default=128),
        norm="pre",
        norm_type="rms",
        activation=activation,
        ffn="gated" if gated else "mlp",
        bias=False,
        scale_embeddings=False,
        tie_embeddings=tied,
        final_norm=True,
        layer_norm_eps=field(hf, "layer_norm_epsilon", (int, float), 1e-6),
        attention_scale=1.0,
        pad_id=ids["pad_token_id"],
        n_encoder_layers=layers,
        n_decoder_layers=field(hf, "num_decoder_layers", default=layers),
        bos_id=ids["decoder_start_token_id"],
        eos_id=ids["eos_token_id"],
        head_scale=d_model**-0.5 if tied else 1.0,
    )


def _feed_forward(proj: str) -> tuple[bool, str]:
    """(gated, our activation) of ``feed_forward_proj`` ("relu", "gated-gelu", ...) as T5Config reads it: the
    activation after the dash, "gated-gelu" meaning the tanh approximation (gelu_new)."""
    parts = proj.split("-")
    if len(parts) > 2 or len(parts) == 2 and parts[0] != "gated":
        raise HFImportError(f"{CONFIG_FILE}: feed_forward_proj={proj!r} is not 'ACT' or 'gated-ACT'")
    name = "gelu_new" if proj == "gated-gelu" else parts[-1]
    if name not in ACTIVATIONS:
        raise HFImportError(f"{CONFIG_FILE}: feed_forward_proj={proj!r} is not supported (its activation {name!r}; "
                            f"supported: {sorted(ACTIVATIONS)})")
    return len(parts) == 2, ACTIVATIONS[name]


def _scales_output(hf: Mapping[str, Any]) -> bool:
    """T5Config.scale_decoder_outputs: as written by transformers, else whether tie_word_embeddings is not false."""
    if "scale_decoder_outputs" in hf:
        return field(hf, "scale_decoder_outputs", bool)
    return hf.get("tie_word_embeddings") is not False


def state_dict(c: Seq2SeqConfig, t: Tensors) -> Tensors:
    """Our Seq2SeqTransformer's state dict from T5's tensors (shapes checked)."""
    d, inner = c.d_model, c.n_heads * c.head_dim
    shared = take(t, SHARED, (c.vocab_size, d))
    for name in TIED_COPIES:
        if name in t and not torch.equal(take(t, name, (c.vocab_size, d)), shared):
            raise HFImportError(f"{WEIGHTS_FILE}: {name!r} differs from {SHARED!r}, which it is tied to")
    head = take(t, HEAD, (c.vocab_size, d)) if HEAD in t else shared
    if c.tie_embeddings and not torch.equal(head, shared):
        raise HFImportError(f"{WEIGHTS_FILE}: {HEAD!r} differs from {SHARED!r}, which a head scaled by "
                            "d_model ** -0.5 (tie_word_embeddings not false) is tied to")
    ours = {"tgt_embed.tokens.weight": shared, "src_embed.tokens.weight": shared, "lm_head.weight": head}
    shapes = {"q": (inner, d), "k": (inner, d), "v": (inner, d), "o": (d, inner)}
    ffn = ("wi_0", "wi_1", "wo") if c.ffn == "gated" else ("wi", "wo")
    for side, n_layers in (("encoder", c.n_encoder_layers), ("decoder", c.n_decoder_layers)):
        ours[f"{side}.relative_bias.embedding.weight"] = take(t, f"{side}.{BIAS_TABLE}", (c.relative_buckets,
                                                                                        c.n_heads))
        ours[f"{side}.final_norm.weight"] = take(t, f"{side}.final_layer_norm.weight", (d,))
        for i in range(n_layers):
            q = f"{side}.layers.{i}."
            for block in ("SelfAttention", "EncDecAttention") if side == "decoder" else ("SelfAttention",):
                p, mine = f"{side}.block.{i}.layer.{_sublayer(side, block)}.", _BLOCKS[block]
                ours[f"{q}{mine}_norm.weight"] = take(t, f"{p}layer_norm.weight", (d,))
                for name, shape in shapes.items():
                    ours[f"{q}{mine}.{ATTENTION[name]}.weight"] = take(t, f"{p}{block}.{name}.weight", shape)
            p = f"{side}.block.{i}.layer.{_sublayer(side, 'DenseReluDense')}."
            ours[f"{q}ffn_norm.weight"] = take(t, f"{p}layer_norm.weight", (d,))
            for name in ffn:
                shape = (d, c.d_ff) if name == "wo" else (c.d_ff, d)
                ours[f"{q}ffn.{FFN[name]}.weight"] = take(t, f"{p}DenseReluDense.{name}.weight", shape)
    return ours


def _sublayer(side: str, block: str) -> str:
    """The index of ``block`` in a T5Block's ``layer`` list: self-attention, the decoder's cross-attention, FFN."""
    return {"SelfAttention": "0", "EncDecAttention": "1"}.get(block, "2" if side == "decoder" else "1")


# PEFT's target names -> our Linears' last names (wi: a v1.0 FFN's fc1; wi_0, wi_1: a gated FFN's fc1 and up)
_PROJECTIONS = {**ATTENTION, **FFN}
_ADAPTER_TARGETS = {theirs: (ours,) for theirs, ours in _PROJECTIONS.items()}
_ADAPTER_KEY = re.compile(r"base_model\.model\.((?:en|de)coder)\.block\.(\d+)\.layer\.(\d)\."
                          r"(SelfAttention|EncDecAttention|DenseReluDense)\.(q|k|v|o|wi|wi_0|wi_1|wo)\.lora_([AB])\.weight")
_OUR_KEY = re.compile(r"base_model\.model\.((?:en|de)coder)\.layers\.(\d+)\.(self_attn|cross_attn|ffn)\."
                      r"(q_proj|k_proj|v_proj|out_proj|fc1|up|fc2)\.lora_([AB])\.weight")


def _projections(block: str, model: TransformerConfig) -> tuple[str, ...]:
    """PEFT's names of ``block``'s Linears in a model of config ``model``."""
    if block != "DenseReluDense":
        return ("q", "k", "v", "o")
    return ("wi_0", "wi_1", "wo") if model.ffn == "gated" else ("wi", "wo")


def _adapter_config(d: dict[str, Any]) -> dict[str, Any]:
    return peft_targets(d, _ADAPTER_TARGETS, "T5")


def _adapter_tensors(tensors: dict[str, torch.Tensor], model: TransformerConfig) -> dict[str, torch.Tensor]:
    """PEFT's LoRA tensors under our names (a tensor of no Linear of this model refused, naming it)."""
    ours = {}
    for key, t in tensors.items():
        match = _ADAPTER_KEY.fullmatch(key)
        if (match is None or match[3] != _sublayer(match[1], match[4]) or match[5] not in _projections(match[4], model)
                or match[1] == "encoder" and match[4] == "EncDecAttention"):
            raise unmapped_tensor(key, "T5", _ADAPTER_TARGETS)
        side, layer, _, block, name, kind = match.groups()
        ours[f"{KEY_PREFIX}{side}.layers.{layer}.{_BLOCKS[block]}.{_PROJECTIONS[name]}.lora_{kind}.weight"] = t
    return ours


def _to_peft(config: LoRAConfig, tensors: dict[str, torch.Tensor], model: TransformerConfig) -> PeftFiles:
    """Our adapter as PEFT's on the T5 model: its names (the inverse of ``_adapter_tensors``)."""
    blocks = {ours: theirs for theirs, ours in _BLOCKS.items()}
    theirs = {}
    for key, t in tensors.items():
        match = _OUR_KEY.fullmatch(key)
        if match is None:
            raise unmapped_tensor(key, "T5", _ADAPTER_TARGETS)
        side, layer, block, name, kind = match.groups()
        hf_block = blocks[block]
        hf_names = [n for n in _projections(hf_block, model) if _PROJECTIONS[n] == name]
        if not hf_names:  # a Linear of another block (no such module of ours)
            raise unmapped_tensor(key, "T5", _ADAPTER_TARGETS)
        theirs[f"{KEY_PREFIX}{side}.block.{layer}.layer.{_sublayer(side, hf_block)}.{hf_block}.{hf_names[0]}"
               f".lora_{kind}.weight"] = t
    return peft_files(config, theirs, "SEQ_2_SEQ_LM")


ADAPTER_LAYOUT = AdapterLayout(config=_adapter_config, tensors=_adapter_tensors, to_peft=_to_peft)
