"""seq2seq -> MarianMTModel, exact in `transformers` and after CTranslate2's Marian converter.

Positions: HF rebuilds Marian's sinusoidal table on load (the checkpoint holds none) with sin in the
first half of the dimensions and cos in the second, where ours interleaves them (PE(pos, 2i) = sin,
PE(pos, 2i+1) = cos). The export permutes the model dimension, HF dim k = our dim perm[k] with
perm = (0, 2, 4, ..., 1, 3, 5, ...), in every tensor indexed by it: embedding columns, the input
columns of q/k/v/fc1, the output rows and biases of out_proj/fc2, every LayerNorm. Every operation
is equivariant under it (LayerNorm statistics ignore the order; head and fc1 dims are not permuted).

CTranslate2's converter treats the model as a Marian-trained one: it drops the last vocabulary row
(Marian's trailing <pad>) and starts the decoder from a zero embedding whatever the start token. So
the export (1) appends a row that is never produced (zero embedding, final_logits_bias -inf) and
(2) gives BOS a zero decoder embedding: every decoder token embedding is shifted by -e_bos, and the
first decoder layer takes the shift back (q/k/v biases + W s, out_proj bias + s, s = scale * e_bos:
post-LN adds the input to the residual before any LayerNorm). The encoder embedding and lm_head keep
the original rows, so the three are written untied (share_encoder_decoder_embeddings and
tie_word_embeddings false); the logits are unchanged. A head bias (``head_bias``) is final_logits_bias.

An imported MarianMTModel (an OPUS-MT directory) goes back as it came (``build_imported``): its own
config.json, vocabularies and tying, no appended row and no shift, the inverse of model/hf/marian.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model.checkpoint import Checkpoint
from model.hf.marian import permutation
from model.layers import TransformerLayer
from training.export.common import HF_ACTIVATIONS, Need, Tensors, bias, linear, norm

ARCHITECTURE = "MarianMTModel"
NEEDS = (
    Need("extended", False, "the original blocks (LayerNorm, no rope, no GQA or head_size, no gated FFN)"),
    Need("positions", "sinusoidal", "sinusoidal positions"),
    Need("norm", "post", "post-LN"),
    Need("embedding_norm", False, "no embedding LayerNorm"),
    Need("final_norm", False, "no final LayerNorm"),
    Need("layer_norm_eps", 1e-5, "LayerNorm eps 1e-5"),  # nn.LayerNorm's default, hard-coded by Marian
    Need("src_vocab_size", None, "one vocabulary shared by source and target"),
)


def _attention(prefix: str, attn: nn.Module, perm: torch.Tensor, shift: torch.Tensor | None) -> Tensors:
    """q/k/v/out_proj; with ``shift``, the inputs arrive as x - shift and the biases restore x + attn(x)."""
    tensors = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        layer = getattr(attn, name)
        b = bias(layer) if shift is None else bias(layer) + layer.weight @ shift
        tensors |= {f"{prefix}{name}.weight": layer.weight[:, perm], f"{prefix}{name}.bias": b}
    out = bias(attn.out_proj) if shift is None else bias(attn.out_proj) + shift
    return tensors | {f"{prefix}out_proj.weight": attn.out_proj.weight[perm], f"{prefix}out_proj.bias": out[perm]}


def _layer(prefix: str, layer: TransformerLayer, perm: torch.Tensor, shift: torch.Tensor | None) -> Tensors:
    tensors = _attention(f"{prefix}self_attn.", layer.self_attn, perm, shift)
    tensors |= norm(f"{prefix}self_attn_layer_norm.", layer.self_attn_norm, perm)
    if layer.cross_attn is not None:
        tensors |= _attention(f"{prefix}encoder_attn.", layer.cross_attn, perm, None)
        tensors |= norm(f"{prefix}encoder_attn_layer_norm.", layer.cross_attn_norm, perm)
    tensors |= linear(f"{prefix}fc1.", layer.ffn.fc1, inputs=perm)
    tensors |= linear(f"{prefix}fc2.", layer.ffn.fc2, outputs=perm)
    return tensors | norm(f"{prefix}final_layer_norm.", layer.ffn_norm, perm)


def _layers(model: nn.Module, perm: torch.Tensor, first_decoder_shift: torch.Tensor | None) -> Tensors:
    tensors = {}
    for side, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        for i, layer in enumerate(stack.layers):
            shift = first_decoder_shift if side == "decoder" and i == 0 else None
            tensors |= _layer(f"model.{side}.layers.{i}.", layer, perm, shift)
    return tensors


def build_imported(ckpt: Checkpoint, hf_config: dict[str, Any]) -> Tensors:
    """The tensors of the MarianMTModel directory ``ckpt`` was imported from (config.json ``hf_config``), in the
    keys transformers' save_pretrained writes. With shared but untied embeddings transformers keeps a
    ``model.shared.weight`` its forward never reads: the import drops it, and the encoder's stands in for it."""
    model, c = ckpt.model, ckpt.config
    perm = permutation(c.d_model)
    share = hf_config.get("share_encoder_decoder_embeddings", True)
    tie = hf_config.get("tie_word_embeddings", True)
    src, tgt = model.src_embed.tokens.weight[:, perm], model.tgt_embed.tokens.weight[:, perm]
    tensors = {"final_logits_bias": bias(model.lm_head)[None]}
    if share and tie:
        tensors["model.shared.weight"] = tgt
    else:
        tensors |= {"model.encoder.embed_tokens.weight": src, "model.decoder.embed_tokens.weight": tgt}
        if share:
            tensors["model.shared.weight"] = src.clone()  # its own copy: safetensors stores no aliases
        if not tie:
            tensors["lm_head.weight"] = model.lm_head.weight[:, perm]
    return tensors | _layers(model, perm, None)


def build(ckpt: Checkpoint) -> tuple[dict[str, Any], Tensors]:
    """config.json fields and tensors in HF's names."""
    model, c = ckpt.model, ckpt.config
    perm = permutation(c.d_model)
    embed = model.tgt_embed.tokens.weight
    start = embed[c.bos_id] * model.tgt_embed.scale  # what BOS adds to the decoder's first input

    def rows(weight: torch.Tensor) -> torch.Tensor:  # (V, D) -> (V + 1, D), in HF's dim order
        return torch.cat([weight, weight.new_zeros(1, c.d_model)])[:, perm]

    tensors = {
        "model.encoder.embed_tokens.weight": rows(embed),
        "model.decoder.embed_tokens.weight": rows(embed - embed[c.bos_id]),  # BOS -> the zero vector
        "lm_head.weight": rows(model.lm_head.weight),
        "final_logits_bias": torch.cat([bias(model.lm_head), torch.tensor([float("-inf")])])[None],
    }
    tensors |= _layers(model, perm, start)
    config = {
        "model_type": "marian",
        "vocab_size": c.vocab_size + 1,
        "decoder_vocab_size": c.vocab_size + 1,
        "d_model": c.d_model,
        "encoder_layers": c.n_encoder_layers,
        "decoder_layers": c.n_decoder_layers,
        "encoder_attention_heads": c.n_heads,
        "decoder_attention_heads": c.n_heads,
        "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.d_ff,
        "activation_function": HF_ACTIVATIONS[c.activation],
        "max_position_embeddings": c.max_len,
        "scale_embedding": c.scale_embeddings,
        "dropout": c.dropout,
        "attention_dropout": c.dropout,
        "activation_dropout": c.dropout,
        "share_encoder_decoder_embeddings": False,
        "tie_word_embeddings": False,
        "is_encoder_decoder": True,
        "pad_token_id": c.pad_id,
        "bos_token_id": c.bos_id,
        "eos_token_id": c.eos_id,
        "decoder_start_token_id": c.bos_id,
        "forced_eos_token_id": None,
    }
    return config, tensors
