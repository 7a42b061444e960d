"""BartForConditionalGeneration -> our seq2seq, and the naming BART's family shares (mbart.py, m2m100.py map over it).

The family's tensors: ``model.shared`` (the token embedding; with ``tie_word_embeddings`` also the encoder's, the
decoder's and ``lm_head``), ``model.{encoder,decoder}.layers.N.{self_attn,encoder_attn}.{q,k,v,out}_proj``,
``fc1``, ``fc2``, ``{self_attn,encoder_attn,final}_layer_norm``, the optional ``layernorm_embedding`` and final
``layer_norm`` of each stack, and ``final_logits_bias`` (our ``head_bias``). Each architecture is a
:class:`Variant` of flags:

- BART: post-LN, an embedding LayerNorm, no final norm, learned positions, GELU, unscaled embeddings by default;
- mBART: pre-LN with the embedding LayerNorm and a final LayerNorm in each stack;
- M2M100 / NLLB-200: pre-LN, final LayerNorms, fairseq's sinusoidal positions, scaled embeddings, ReLU, no bias.

Positions: BART's learned tables have two extra rows (``offset = 2``): position t reads row t + 2, so the table
from row 2 on is ours (rows 0 and 1 are never read). Encoder and decoder each have their own table and embedding
LayerNorm (``shared_positions=False``), sharing the token embedding. M2M100's sinusoidal table is read at
``padding_idx + 1 + t`` for the t-th non-pad token: on right-padded rows (ours; a target prefix too) that is the
row of position t, so its rows from ``padding_idx + 1`` on become a fixed learned table (computed as transformers
computes it, in float32, and one for both stacks: theirs are equal), and a pad token (a generated one too) gets
its zero ``padding_idx`` row (``pad_positions=False``). Every kernel then runs these models (the embeddings are
computed in Python on every path).

PEFT LoRA adapters (``q_proj k_proj v_proj out_proj`` of self- and cross-attention, ``fc1 fc2``, in encoder and
decoder) go onto the same Linears, both ways (:func:`adapter_layout`; marian.py's with its permutation of the model
dim): they touch no embedding, so neither the position tables nor the tied token embedding matter to them.

Old BART-era flags (``normalize_before``, ``add_final_layer_norm``, ``normalize_embedding``,
``static_position_embeddings``, ``add_bias_logits``, ``extra_pos_embeddings``) are ignored by transformers; a
value claiming other math than the class computes is refused by name, as marian.py does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from model.config import Seq2SeqConfig, TransformerConfig
from model.hf.common import HFImportError, Tensors, Unsupported, activation, check_supported, field, take
from model.layers import MAX_POSITIONS
from model.lora_config import AdapterError, LoRAConfig, quote
from model.lora_io import KEY_PREFIX, AdapterLayout, PeftFiles, peft_files, peft_targets, unmapped_tensor

ARCHITECTURES = ("BartForConditionalGeneration",)
SHARED, ENCODER, DECODER, HEAD, BIAS = ("model.shared.weight", "model.encoder.embed_tokens.weight",
                                        "model.decoder.embed_tokens.weight", "lm_head.weight", "final_logits_bias")
LEARNED_OFFSET = 2  # BartLearnedPositionalEmbedding's: position t reads row t + 2
BLOCKS = {"self_attn": "self_attn", "encoder_attn": "cross_attn", None: "ffn"}  # a layer's blocks: theirs -> ours
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")  # a layer's Linears (ours: the same names)
READS_MODEL_DIM = ("q_proj", "k_proj", "v_proj", "fc1")  # Linears whose input is the model dim (the others write it)
_IGNORED = "transformers ignores the flag and runs the class's own blocks, which weights trained that way do not fit"


def ignored_flags(pre_norm: bool) -> tuple[Unsupported, ...]:
    """The BART-era flags, each allowed only at the value the class computes anyway."""
    return (
        Unsupported("normalize_before", (pre_norm,), f"{'post' if pre_norm else 'pre'}-LN: {_IGNORED}"),
        Unsupported("add_final_layer_norm", (pre_norm,), f"the final LayerNorm: {_IGNORED}"),
        Unsupported("normalize_embedding", (True,), f"no embedding LayerNorm: {_IGNORED}"),
        Unsupported("static_position_embeddings", (False,), f"sinusoidal positions: {_IGNORED}"),
        Unsupported("add_bias_logits", (False,), f"a logits bias Linear: {_IGNORED}"),
        Unsupported("extra_pos_embeddings", (LEARNED_OFFSET,), f"another position offset: {_IGNORED}"),
    )


@dataclass(frozen=True)
class Variant:
    """What one architecture of the family computes (the importers differ only here)."""

    name: str
    norm: str  # "post" (BART) or "pre"
    embedding_norm: bool  # layernorm_embedding
    final_norm: bool  # each stack's final layer_norm
    scale_default: bool  # scale_embedding when config.json leaves it out
    activation_default: str
    head_bias: bool  # final_logits_bias
    rules: tuple[Unsupported, ...]
    # None: learned tables with LEARNED_OFFSET; else (rows, d_model, pad_id) -> the fixed table (M2M100)
    position_table: Callable[[int, int, int], torch.Tensor] | None = None


BART = Variant("BART", "post", embedding_norm=True, final_norm=False, scale_default=False,
               activation_default="gelu", head_bias=True, rules=ignored_flags(pre_norm=False))


def config_for(hf: Mapping[str, Any], v: Variant) -> Seq2SeqConfig:
    """Our config for a config.json of variant ``v`` (HFImportError naming a field we cannot express)."""
    check_supported(hf, v.rules, v.name)
    vocab = field(hf, "vocab_size", default=50265)
    sizes = stack_sizes(hf)
    ids = {"pad_token_id": field(hf, "pad_token_id", default=1), "eos_token_id": field(hf, "eos_token_id", default=2)}
    # generate() starts the decoder from decoder_start_token_id, else bos_token_id (mBART's config leaves it unset)
    start = "decoder_start_token_id" if hf.get("decoder_start_token_id") is not None else "bos_token_id"
    ids[start] = field(hf, start, default=...)
    for name, value in ids.items():
        if not 0 <= value < vocab:
            raise HFImportError(f"config.json: {name}={value} is outside the vocabulary (size {vocab})")
    max_len = field(hf, "max_position_embeddings", default=1024)
    if not 0 < max_len <= MAX_POSITIONS:
        raise HFImportError(f"config.json: max_position_embeddings={max_len} is outside [1, {MAX_POSITIONS}]")
    tie = field(hf, "tie_word_embeddings", bool, True)
    return Seq2SeqConfig(
        vocab_size=vocab,
        src_vocab_size=None if tie else vocab,  # transformers unties everything without tie_word_embeddings
        d_model=field(hf, "d_model", default=1024),
        n_heads=sizes["attention_heads"],
        d_ff=sizes["ffn_dim"],
        dropout=0.0,
        max_len=max_len,
        max_src_len=max_len,
        positions="learned",
        norm=v.norm,
        activation=activation(hf, "activation_function", v.activation_default),
        bias=True,
        scale_embeddings=field(hf, "scale_embedding", bool, v.scale_default),
        tie_embeddings=tie,
        embedding_norm=v.embedding_norm,
        final_norm=v.final_norm,
        layer_norm_eps=1e-5,  # nn.LayerNorm's default, hard-coded by the family
        pad_id=ids["pad_token_id"],
        n_encoder_layers=field(hf, "encoder_layers", default=12),
        n_decoder_layers=field(hf, "decoder_layers", default=12),
        bos_id=ids[start],
        eos_id=ids["eos_token_id"],
        head_bias=v.head_bias,
        shared_positions=v.position_table is not None,  # learned: a table per stack
        pad_positions=v.position_table is None,  # M2M100's table gives every pad token its zero padding_idx row
    )


def stack_sizes(hf: Mapping[str, Any]) -> dict[str, int]:
    """config.json's attention_heads and ffn_dim, which our encoder and decoder share (HFImportError where its
    encoder_ and decoder_ values differ)."""
    sizes = {}
    for name, default in (("attention_heads", 16), ("ffn_dim", 4096)):
        sizes[name] = field(hf, f"encoder_{name}", default=default)
        decoder = field(hf, f"decoder_{name}", default=default)
        if decoder != sizes[name]:
            raise HFImportError(f"config.json: decoder_{name}={decoder} differs from encoder_{name}={sizes[name]}; "
                                "our encoder and decoder share one value")
    return sizes


def tensors_for(c: Seq2SeqConfig, t: Tensors, v: Variant) -> Tensors:
    """Our Seq2SeqTransformer's state dict from the tensors of a variant ``v`` model (shapes checked)."""
    d = c.d_model
    src, tgt, head = embeddings(c, t)  # first: their shapes bound d_model before anything is sized by it
    ours = {"src_embed.tokens.weight": src, "tgt_embed.tokens.weight": tgt, "lm_head.weight": head}
    if v.head_bias:
        ours["lm_head.bias"] = head_bias(c, t)
    for side, embed in (("encoder", "src_embed"), ("decoder", "tgt_embed")):
        p = f"model.{side}."
        if v.position_table is None:
            table = take(t, f"{p}embed_positions.weight", (c.max_len + LEARNED_OFFSET, d))[LEARNED_OFFSET:]
        else:
            table = v.position_table(c.max_len, d, c.pad_id)
        ours[f"{embed}.positions.weight"] = table
        if v.embedding_norm:
            ours |= _norm(t, f"{p}layernorm_embedding.", f"{embed}.norm.", d)
        if v.final_norm:
            ours |= _norm(t, f"{p}layer_norm.", f"{side}.final_norm.", d)
    return ours | layers(c, t)


def layers(c: Seq2SeqConfig, t: Tensors, order: torch.Tensor | None = None) -> Tensors:
    """Every encoder and decoder layer of the family's naming, as our TransformerLayers'. ``order``: where the model
    dim is permuted (Marian's: our dim j is theirs order[j]), every tensor indexed by it is read back through it: a
    Linear's input columns where it reads the model dim (READS_MODEL_DIM), else its output rows and bias, and the
    LayerNorms."""
    ours: Tensors = {}
    for side, n_layers in (("encoder", c.n_encoder_layers), ("decoder", c.n_decoder_layers)):
        for i in range(n_layers):
            ours |= layer_tensors(t, f"model.{side}.layers.{i}.", f"{side}.layers.{i}.", c, side == "decoder", order)
    return ours


def layer_tensors(t: Tensors, theirs: str, ours: str, c: Seq2SeqConfig, cross: bool,
                  order: torch.Tensor | None = None) -> Tensors:
    """One encoder (or, with ``cross``, decoder) layer of the family's naming, as our TransformerLayer's (``order``:
    as :func:`layers`)."""
    d = c.d_model
    blocks = [("self_attn", "self_attn")] + ([("encoder_attn", "cross_attn")] if cross else [])
    tensors: Tensors = {}
    for hf_block, block in blocks:
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            tensors |= _linear(t, f"{theirs}{hf_block}.{name}", f"{ours}{block}.{name}", (d, d), order)
        tensors |= _norm(t, f"{theirs}{hf_block}_layer_norm.", f"{ours}{block}_norm.", d, order)
    tensors |= _linear(t, f"{theirs}fc1", f"{ours}ffn.fc1", (c.d_ff, d), order)
    tensors |= _linear(t, f"{theirs}fc2", f"{ours}ffn.fc2", (d, c.d_ff), order)
    return tensors | _norm(t, f"{theirs}final_layer_norm.", f"{ours}ffn_norm.", d, order)


def embeddings(c: Seq2SeqConfig, t: Tensors, sharing: str = "tie_word_embeddings"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source, target, output) embeddings as transformers resolves them: a missing token embedding is
    model.shared's, a missing tied head the decoder embedding's; tied copies saved side by side must agree (the
    encoder's with the decoder's when the config has one vocabulary, ``sharing`` the field that ties them)."""
    d = c.d_model

    def first(name: str, rows: int) -> torch.Tensor:
        return take(t, name if name in t or SHARED not in t else SHARED, (rows, d))

    src, tgt = first(ENCODER, c.src_vocab_size or c.vocab_size), first(DECODER, c.vocab_size)
    head = take(t, HEAD, (c.vocab_size, d)) if HEAD in t or not c.tie_embeddings else tgt
    for name, tensor, tied, field_name in ((HEAD, head, c.tie_embeddings, "tie_word_embeddings"),
                                           (ENCODER, src, c.src_vocab_size is None, sharing)):
        if tied and not torch.equal(tensor, tgt):
            raise HFImportError(f"model.safetensors: {name!r} differs from the decoder's token embedding, which "
                                f"{field_name}=True ties it to")
    return src, tgt, head


def head_bias(c: Seq2SeqConfig, t: Tensors) -> torch.Tensor:
    """final_logits_bias (our lm_head.bias), which may hold -inf (a token ruled out); absent: zeros, as transformers
    initialises it."""
    return take(t, BIAS, (1, c.vocab_size), minus_inf=True)[0] if BIAS in t else torch.zeros(c.vocab_size)


def _linear(t: Tensors, theirs: str, ours: str, shape: tuple[int, int], order: torch.Tensor | None) -> Tensors:
    weight, bias = take(t, f"{theirs}.weight", shape), take(t, f"{theirs}.bias", shape[:1])
    if ours.rpartition(".")[2] in READS_MODEL_DIM:
        return {f"{ours}.weight": permuted(weight, order, 1), f"{ours}.bias": bias}
    return {f"{ours}.weight": permuted(weight, order, 0), f"{ours}.bias": permuted(bias, order, 0)}


def _norm(t: Tensors, theirs: str, ours: str, d: int, order: torch.Tensor | None = None) -> Tensors:
    return {f"{ours}{k}": permuted(take(t, f"{theirs}{k}", (d,)), order, 0) for k in ("weight", "bias")}


def permuted(x: torch.Tensor, order: torch.Tensor | None, dim: int) -> torch.Tensor:
    """``x`` with its indices along ``dim`` taken in ``order`` (None: ``x`` itself)."""
    return x if order is None else x.index_select(dim, order)


def to_config(hf: Mapping[str, Any]) -> Seq2SeqConfig:
    """Our config for BART's config.json."""
    return config_for(hf, BART)


def state_dict(c: Seq2SeqConfig, t: Tensors) -> Tensors:
    """Our Seq2SeqTransformer's state dict from BART's tensors."""
    return tensors_for(c, t, BART)


# PEFT's LoRA keys on the family's models (model.: the ConditionalGeneration's, which our Seq2SeqTransformer lacks)
# and on ours: (layer path, block, Linear, A or B); fc1 / fc2 alone, the others in an attention block
_THEIR_KEY = re.compile(rf"{re.escape(KEY_PREFIX)}model\.((en|de)coder\.layers\.\d+\.)(?:(self_attn|encoder_attn)\.)?"
                        r"([qkv]_proj|out_proj|fc[12])\.lora_([AB])\.weight")
_OUR_KEY = re.compile(rf"{re.escape(KEY_PREFIX)}((en|de)coder\.layers\.\d+\.)(self_attn|cross_attn|ffn)\."
                      r"([qkv]_proj|out_proj|fc[12])\.lora_([AB])\.weight")
_TARGETS = {name: (name,) for name in PROJECTIONS}  # PEFT's target names -> our Linears' (the same)
NO_COPIES = "an adapter's own copies of the head or the embeddings are not mapped"


def adapter_layout(architecture: str, permutation: Callable[[int], torch.Tensor] | None = None) -> AdapterLayout:
    """PEFT LoRA adapters on ``q_proj k_proj v_proj out_proj`` (self- and cross-attention) and ``fc1 fc2`` of the
    family's models (and Marian's) <-> ours: the same Linears, by the names :func:`layer_tensors` maps. With Marian's
    ``permutation`` of the model dim (theirs k is ours permutation(d)[k]), an update B A reads or writes it where its
    Linear does: A's input columns (READS_MODEL_DIM) or B's output rows are read back through its inverse, and
    written back through it. Refused by name: targets other than these Linears (the token embeddings' LoRA among
    them, lm_head's), modules_to_save (:data:`NO_COPIES`); DoRA and the other options model.lora_config refuses."""
    return AdapterLayout(config=partial(_adapter_config, architecture=architecture),
                         tensors=partial(_adapter_tensors, architecture=architecture, permutation=permutation),
                         to_peft=partial(_to_peft, architecture=architecture, permutation=permutation))


def _adapter_config(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    if d.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {quote(d['modules_to_save'])} is not supported for {architecture}: "
                           f"{NO_COPIES}")
    return peft_targets(d, _TARGETS, architecture)


def _model_dim(kind: str, name: str) -> int | None:
    """The dim of a LoRA ``kind`` (A or B) tensor of Linear ``name`` that is the model dim: A's input columns where
    the Linear reads it, B's output rows where it writes it (else None: head or FFN dims)."""
    if (kind == "A") == (name in READS_MODEL_DIM):
        return 1 if kind == "A" else 0
    return None


def _adapter_tensors(tensors: dict[str, torch.Tensor], model: TransformerConfig, architecture: str,
                     permutation: Callable[[int], torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """PEFT's LoRA tensors under our names, the model dim un-permuted (a tensor of no Linear of ours refused)."""
    ours = {}
    for key, t in tensors.items():
        match = _THEIR_KEY.fullmatch(key)
        if match is None or (match[3] is None) != match[4].startswith("fc") or (match[2], match[3]) == (
                "en", "encoder_attn"):
            raise unmapped_tensor(key, architecture, _TARGETS)
        layer, _, block, name, kind = match.groups()
        dim = _model_dim(kind, name)
        if permutation is not None and dim is not None and t.dim() == 2:  # another shape is refused later, by name
            t = t.index_select(dim, torch.argsort(permutation(t.shape[dim])))
        ours[f"{KEY_PREFIX}{layer}{BLOCKS[block]}.{name}.lora_{kind}.weight"] = t
    return ours


def _to_peft(config: LoRAConfig, tensors: dict[str, torch.Tensor], model: TransformerConfig, architecture: str,
             permutation: Callable[[int], torch.Tensor] | None) -> PeftFiles:
    """Our adapter as PEFT's on the Hugging Face model: its names, the model dim permuted back (the inverse of
    ``_adapter_tensors``)."""
    blocks = {ours: theirs for theirs, ours in BLOCKS.items()}
    theirs = {}
    for key, t in tensors.items():
        match = _OUR_KEY.fullmatch(key)
        if match is None or (match[3] == "ffn") != match[4].startswith("fc") or (match[2], match[3]) == (
                "en", "cross_attn"):
            raise unmapped_tensor(key, architecture, _TARGETS)
        layer, _, block, name, kind = match.groups()
        dim = _model_dim(kind, name)
        if permutation is not None and dim is not None:
            t = t.index_select(dim, permutation(t.shape[dim]))
        hf_block = "" if blocks[block] is None else f"{blocks[block]}."
        theirs[f"{KEY_PREFIX}model.{layer}{hf_block}{name}.lora_{kind}.weight"] = t
    return peft_files(config, theirs, "SEQ_2_SEQ_LM")


ADAPTER_LAYOUT = adapter_layout(BART.name)
