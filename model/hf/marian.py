"""MarianMTModel (the OPUS-MT layout) -> our seq2seq.

Marian is post-LN with sinusoidal positions, biased projections, LayerNorm eps 1e-5 and no final LayerNorm;
OPUS-MT models scale their embeddings, use swish, start the decoder from the pad id and add
``final_logits_bias`` (our ``head_bias``: ``lm_head.bias``, on every logits path) to the logits.

Positions: transformers' table puts sin in the first half of the dimensions and cos in the second, where
ours interleaves them. HF dim k is our dim ``permutation(d)[k]``; every tensor indexed by the model dimension
is read back through the inverse (embedding columns, q/k/v/fc1 input columns, out_proj/fc2 output rows and
biases, LayerNorms), so the model is a plain sinusoidal seq2seq: every kernel runs it and
training/export/marian.py writes it back. Every operation is equivariant under the permutation (head and
FFN dims are not permuted); only float sums run in another order.

Marian's tensors are named as BART's (model/hf/bart.py: its embeddings, final_logits_bias, layers and PEFT adapter
layout are read here, given the permutation). A PEFT LoRA adapter (on q_proj, k_proj, v_proj, out_proj of self- and
cross-attention, fc1, fc2) maps onto the same modules with the same permutation: an update B A reads or writes the
model dim where its Linear does, so A's input columns or B's output rows are read back through it
(ADAPTER_LAYOUT), and ours are written back through its inverse.

transformers ignores the BART-era flags old OPUS-MT configs carry (``normalize_before``,
``normalize_embedding``/``layernorm_embedding``, ``add_final_layer_norm``, ``static_position_embeddings``) and
always computes the above: a value claiming other math is refused by name rather than served as transformers
would run it. final_logits_bias may hold -inf (a token ruled out, as training/export/marian.py writes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from model.config import Seq2SeqConfig
from model.hf.bart import adapter_layout, embeddings, head_bias, layers, stack_sizes
from model.hf.common import HFImportError, Tensors, Unsupported, activation, check_supported, field, take
from model.layers import MAX_POSITIONS, sinusoidal_table

ARCHITECTURES = ("MarianMTModel",)
_IGNORED = "transformers' Marian ignores the flag and runs plain Marian, which weights trained that way do not fit"
RULES = (
    Unsupported("normalize_before", (False,), f"pre-LN: {_IGNORED}"),
    Unsupported("normalize_embedding", (False,), f"an embedding LayerNorm: {_IGNORED}"),
    Unsupported("layernorm_embedding", (False,), f"an embedding LayerNorm: {_IGNORED}"),
    Unsupported("add_final_layer_norm", (False,), f"a final LayerNorm: {_IGNORED}"),
    Unsupported("static_position_embeddings", (True,), f"learned positions: {_IGNORED}"),
)


def permutation(d_model: int) -> torch.Tensor:
    """perm with HF Marian's positional dim k = our dim perm[k]: the sin dims (even) first, then the cos dims."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _order(d_model: int) -> torch.Tensor:
    """Our dim j is HF dim order[j]."""
    return torch.argsort(permutation(d_model))


def to_config(hf: Mapping[str, Any]) -> Seq2SeqConfig:
    """Our config for Marian's config.json (HFImportError naming a field we cannot express)."""
    check_supported(hf, RULES, "Marian")
    vocab = field(hf, "vocab_size", default=58101)
    share = field(hf, "share_encoder_decoder_embeddings", bool, True)
    tie = field(hf, "tie_word_embeddings", bool, True)
    decoder_vocab = field(hf, "decoder_vocab_size", default=vocab)
    if share and decoder_vocab != vocab:
        raise HFImportError(f"config.json: decoder_vocab_size={decoder_vocab} differs from vocab_size={vocab} with "
                            "share_encoder_decoder_embeddings=True")
    sizes = stack_sizes(hf)
    ids = {"pad_token_id": field(hf, "pad_token_id", default=58100),
           "eos_token_id": field(hf, "eos_token_id", default=0),
           "decoder_start_token_id": field(hf, "decoder_start_token_id", default=58100)}
    for name, value in ids.items():  # the pad id also pads (and embeds) sources
        limit = min(vocab, decoder_vocab) if name == "pad_token_id" else decoder_vocab
        if not 0 <= value < limit:
            raise HFImportError(f"config.json: {name}={value} is outside the vocabulary (size {limit})")
    max_len = field(hf, "max_position_embeddings", default=1024)
    if not 0 < max_len <= MAX_POSITIONS:  # the table is computed from this number alone: nothing else bounds it
        raise HFImportError(f"config.json: max_position_embeddings={max_len} is outside [1, {MAX_POSITIONS}] (the "
                            "sinusoidal table is built for every position)")
    return Seq2SeqConfig(
        vocab_size=decoder_vocab,
        src_vocab_size=None if share and tie else vocab,  # transformers unties everything without tie_word_embeddings
        d_model=field(hf, "d_model", default=1024),
        n_heads=sizes["attention_heads"],
        d_ff=sizes["ffn_dim"],
        dropout=0.0,
        max_len=max_len,
        max_src_len=max_len,
        positions="sinusoidal",
        norm="post",
        activation=activation(hf, "activation_function", "gelu"),
        bias=True,
        scale_embeddings=field(hf, "scale_embedding", bool, False),
        tie_embeddings=tie,
        embedding_norm=False,
        final_norm=False,
        layer_norm_eps=1e-5,  # nn.LayerNorm's default, hard-coded by Marian
        pad_id=ids["pad_token_id"],
        n_encoder_layers=field(hf, "encoder_layers", default=12),
        n_decoder_layers=field(hf, "decoder_layers", default=12),
        bos_id=ids["decoder_start_token_id"],
        eos_id=ids["eos_token_id"],
        head_bias=True,
    )


def state_dict(c: Seq2SeqConfig, t: Tensors) -> Tensors:
    """Our Seq2SeqTransformer's state dict from Marian's tensors (shapes checked, the model dim un-permuted)."""
    d = c.d_model
    # first: their shapes bound d_model before anything is sized by it
    src, tgt, head = embeddings(c, t, sharing="share_encoder_decoder_embeddings")
    order = _order(d)
    for side in ("encoder", "decoder"):  # old saves hold the table, which transformers then adds as stored
        name = f"model.{side}.embed_positions.weight"
        if name in t and not torch.equal(take(t, name, (c.max_len, d)),
                                         sinusoidal_table(c.max_len, d)[:, permutation(d)].to(t[name].dtype)):
            raise HFImportError(f"model.safetensors: {name!r} is not Marian's sinusoidal table")  # fp16: rounded
    ours = {"src_embed.tokens.weight": src[:, order], "tgt_embed.tokens.weight": tgt[:, order],
            "lm_head.weight": head[:, order], "lm_head.bias": head_bias(c, t)}
    return ours | layers(c, t, order)


ADAPTER_LAYOUT = adapter_layout("Marian", permutation)
