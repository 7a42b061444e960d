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

A PEFT LoRA adapter (on q_proj, k_proj, v_proj, out_proj of self- and cross-attention, fc1, fc2) maps onto
the same modules with the same permutation: an update B A reads or writes the model dim where its Linear
does, so A's input columns or B's output rows are read back through it (ADAPTER_LAYOUT), and ours are
written back through its inverse (``_to_peft``).

transformers ignores the BART-era flags old OPUS-MT configs carry (``normalize_before``,
``normalize_embedding``/``layernorm_embedding``, ``add_final_layer_norm``, ``static_position_embeddings``) and
always computes the above: a value claiming other math is refused by name rather than served as transformers
would run it. final_logits_bias may hold -inf (a token ruled out, as training/export/marian.py writes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from model.config import Seq2SeqConfig, TransformerConfig
from model.hf.common import HFImportError, Tensors, Unsupported, activation, check_supported, field, take
from model.layers import MAX_POSITIONS, sinusoidal_table
from model.lora_config import LoRAConfig
from model.lora_io import KEY_PREFIX, AdapterLayout, PeftFiles, peft_files, peft_targets, unmapped_tensor

ARCHITECTURES = ("MarianMTModel",)
_IGNORED = "transformers' Marian ignores the flag and runs plain Marian, which weights trained that way do not fit"
RULES = (
    Unsupported("normalize_before", (False,), f"pre-LN: {_IGNORED}"),
    Unsupported("normalize_embedding", (False,), f"an embedding LayerNorm: {_IGNORED}"),
    Unsupported("layernorm_embedding", (False,), f"an embedding LayerNorm: {_IGNORED}"),
    Unsupported("add_final_layer_norm", (False,), f"a final LayerNorm: {_IGNORED}"),
    Unsupported("static_position_embeddings", (True,), f"learned positions: {_IGNORED}"),
)
# Linears whose input is the model dimension; the others (out_proj, fc2) write it
READS_MODEL_DIM = ("q_proj", "k_proj", "v_proj", "fc1")
SHARED, ENCODER, DECODER, HEAD, BIAS = ("model.shared.weight", "model.encoder.embed_tokens.weight",
                                        "model.decoder.embed_tokens.weight", "lm_head.weight", "final_logits_bias")


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
    sizes = {}
    for name, default in (("attention_heads", 16), ("ffn_dim", 4096)):
        sizes[name] = field(hf, f"encoder_{name}", default=default)
        decoder = field(hf, f"decoder_{name}", default=default)
        if decoder != sizes[name]:
            raise HFImportError(f"config.json: decoder_{name}={decoder} differs from encoder_{name}={sizes[name]}; "
                                "our encoder and decoder share one value")
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
    src, tgt, head = _embeddings(c, t)  # first: their shapes bound d_model before anything is sized by it
    order = _order(d)
    for side in ("encoder", "decoder"):  # old saves hold the table, which transformers then adds as stored
        name = f"model.{side}.embed_positions.weight"
        if name in t and not torch.equal(take(t, name, (c.max_len, d)),
                                         sinusoidal_table(c.max_len, d)[:, permutation(d)].to(t[name].dtype)):
            raise HFImportError(f"model.safetensors: {name!r} is not Marian's sinusoidal table")  # fp16: rounded
    ours = {"src_embed.tokens.weight": src[:, order], "tgt_embed.tokens.weight": tgt[:, order],
            "lm_head.weight": head[:, order]}
    bias = take(t, BIAS, (1, c.vocab_size), minus_inf=True)[0] if BIAS in t else torch.zeros(c.vocab_size)
    ours["lm_head.bias"] = bias  # absent: transformers initialises it to zeros
    for side, n_layers in (("encoder", c.n_encoder_layers), ("decoder", c.n_decoder_layers)):
        for i in range(n_layers):
            p, q = f"model.{side}.layers.{i}.", f"{side}.layers.{i}."
            ours |= _attention(t, f"{p}self_attn.", f"{q}self_attn.", d, order)
            ours |= _norm(t, f"{p}self_attn_layer_norm.", f"{q}self_attn_norm.", d, order)
            if side == "decoder":
                ours |= _attention(t, f"{p}encoder_attn.", f"{q}cross_attn.", d, order)
                ours |= _norm(t, f"{p}encoder_attn_layer_norm.", f"{q}cross_attn_norm.", d, order)
            ours |= _linear(t, f"{p}fc1", f"{q}ffn.fc1", (c.d_ff, d), order)
            ours |= _linear(t, f"{p}fc2", f"{q}ffn.fc2", (d, c.d_ff), order)
            ours |= _norm(t, f"{p}final_layer_norm.", f"{q}ffn_norm.", d, order)
    return ours


def _embeddings(c: Seq2SeqConfig, t: Tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source, target, output) embeddings as transformers resolves them: a missing token embedding is
    model.shared's, a missing tied head the target embedding's; tied copies saved side by side must agree."""
    d = c.d_model

    def first(name: str, alias: str, rows: int) -> torch.Tensor:
        return take(t, name if name in t or alias not in t else alias, (rows, d))

    src = first(ENCODER, SHARED, c.src_vocab_size or c.vocab_size)
    tgt = first(DECODER, SHARED, c.vocab_size)
    head = take(t, HEAD, (c.vocab_size, d)) if HEAD in t or not c.tie_embeddings else tgt
    if c.tie_embeddings and not torch.equal(head, tgt):
        raise HFImportError(f"model.safetensors: {HEAD!r} differs from the decoder's token embedding, which "
                            "tie_word_embeddings=True ties it to")
    if c.src_vocab_size is None and not torch.equal(src, tgt):
        raise HFImportError(f"model.safetensors: {ENCODER!r} differs from the decoder's token embedding, which "
                            "share_encoder_decoder_embeddings=True ties it to")
    return src, tgt, head


def _attention(t: Tensors, theirs: str, ours: str, d: int, order: torch.Tensor) -> Tensors:
    tensors = {}
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        tensors |= _linear(t, f"{theirs}{name}", f"{ours}{name}", (d, d), order)
    return tensors


def _linear(t: Tensors, theirs: str, ours: str, shape: tuple[int, int], order: torch.Tensor) -> Tensors:
    """A Linear with the model dim un-permuted: its input columns (READS_MODEL_DIM) or its output rows and bias."""
    weight, bias = take(t, f"{theirs}.weight", shape), take(t, f"{theirs}.bias", shape[:1])
    if ours.rpartition(".")[2] in READS_MODEL_DIM:
        return {f"{ours}.weight": weight[:, order], f"{ours}.bias": bias}
    return {f"{ours}.weight": weight[order], f"{ours}.bias": bias[order]}


def _norm(t: Tensors, theirs: str, ours: str, d: int, order: torch.Tensor) -> Tensors:
    return {f"{ours}{k}": take(t, f"{theirs}{k}", (d,))[order] for k in ("weight", "bias")}


# PEFT's target names (a module name, or a suffix of its path) -> our modules' last names
_ADAPTER_TARGETS = {name: (name,) for name in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")}
# model.: MarianMTModel's (a prefix our Seq2SeqTransformer lacks: our own adapters' names never match)
_ADAPTER_KEY = re.compile(r"base_model\.model\.model\.((?:en|de)coder\.layers\.\d+\.)"
                          r"(self_attn\.|encoder_attn\.)?([qkv]_proj|out_proj|fc[12])\.lora_([AB])\.weight")
_ADAPTER_MODULES = {"self_attn.": "self_attn.", "encoder_attn.": "cross_attn.", None: "ffn."}


def _adapter_config(d: dict[str, Any]) -> dict[str, Any]:
    return peft_targets(d, _ADAPTER_TARGETS, "Marian")


def _adapter_tensors(tensors: dict[str, torch.Tensor], model: TransformerConfig) -> dict[str, torch.Tensor]:
    """Our names, and the model dim un-permuted as state_dict does: A's input columns where the Linear reads it,
    B's output rows where it writes it (B A's columns / rows are then those of the Linear's weight)."""
    ours = {}
    for key, t in tensors.items():
        match = _ADAPTER_KEY.fullmatch(key)
        if match is None or (match[2] is None) != match[3].startswith("fc"):  # fc1/fc2 alone, the others in one
            raise unmapped_tensor(key, "Marian", _ADAPTER_TARGETS)
        layer, attention, name, kind = match.groups()
        if t.dim() == 2 and (kind == "A") == (name in READS_MODEL_DIM):  # another shape is named later
            dim = 1 if kind == "A" else 0
            t = t.index_select(dim, _order(t.shape[dim]))
        ours[f"base_model.model.{layer}{_ADAPTER_MODULES[attention]}{name}.lora_{kind}.weight"] = t
    return ours


_HF_BLOCKS = {ours: theirs or "" for theirs, ours in _ADAPTER_MODULES.items()}  # our block -> Marian's
_OUR_KEY = re.compile(r"base_model\.model\.((?:en|de)coder\.layers\.\d+\.)(self_attn\.|cross_attn\.|ffn\.)"
                      r"([qkv]_proj|out_proj|fc[12])\.lora_([AB])\.weight")


def _to_peft(config: LoRAConfig, tensors: dict[str, torch.Tensor], model: TransformerConfig) -> PeftFiles:
    """Our adapter as PEFT's on MarianMTModel: Marian's names, and A's input columns / B's output rows permuted
    back into Marian's model dim (the inverse of ``_adapter_tensors``)."""
    theirs = {}
    for key, t in tensors.items():
        match = _OUR_KEY.fullmatch(key)
        if match is None or (match[2] == "ffn.") != match[3].startswith("fc"):
            raise unmapped_tensor(key, "Marian", _ADAPTER_TARGETS)
        layer, block, name, kind = match.groups()
        if (kind == "A") == (name in READS_MODEL_DIM):
            dim = 1 if kind == "A" else 0
            t = t.index_select(dim, permutation(t.shape[dim]))
        theirs[f"{KEY_PREFIX}model.{layer}{_HF_BLOCKS[block]}{name}.lora_{kind}.weight"] = t
    return peft_files(config, theirs, "SEQ_2_SEQ_LM")


ADAPTER_LAYOUT = AdapterLayout(config=_adapter_config, tensors=_adapter_tensors, to_peft=_to_peft)
