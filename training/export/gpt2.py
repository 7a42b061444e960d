"""causal_lm -> GPT2LMHeadModel: Conv1D weights are nn.Linear's transposed; c_attn is q, k, v side by side."""

from __future__ import annotations

from typing import Any

import torch

from model.checkpoint import Checkpoint
from training.export.common import HF_ACTIVATIONS, Need, Tensors, bias, norm

ARCHITECTURE = "GPT2LMHeadModel"
NEEDS = (
    Need("extended", False, "the original blocks (LayerNorm, no rope, no GQA or head_size, no gated FFN)"),
    Need("positions", "learned", "learned positions"),
    Need("norm", "pre", "pre-LN"),
    Need("final_norm", True, "a final LayerNorm"),
    Need("scale_embeddings", False, "unscaled embeddings"),
    Need("embedding_norm", False, "no embedding LayerNorm"),
)


def build(ckpt: Checkpoint) -> tuple[dict[str, Any], Tensors]:
    """config.json fields and tensors in HF's names."""
    model, c = ckpt.model, ckpt.config
    tensors = {
        "transformer.wte.weight": model.embed.tokens.weight,
        "transformer.wpe.weight": model.embed.positions.weight,
    }
    for i, layer in enumerate(model.decoder.layers):
        p, attn, ffn = f"transformer.h.{i}.", layer.self_attn, layer.ffn
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        tensors |= {
            f"{p}attn.c_attn.weight": torch.cat([lin.weight for lin in qkv]).T,  # (D, 3D)
            f"{p}attn.c_attn.bias": torch.cat([bias(lin) for lin in qkv]),
            f"{p}attn.c_proj.weight": attn.out_proj.weight.T,
            f"{p}attn.c_proj.bias": bias(attn.out_proj),
            f"{p}mlp.c_fc.weight": ffn.fc1.weight.T,  # (D, d_ff)
            f"{p}mlp.c_fc.bias": bias(ffn.fc1),
            f"{p}mlp.c_proj.weight": ffn.fc2.weight.T,
            f"{p}mlp.c_proj.bias": bias(ffn.fc2),
        }
        tensors |= norm(f"{p}ln_1.", layer.self_attn_norm) | norm(f"{p}ln_2.", layer.ffn_norm)
    tensors |= norm("transformer.ln_f.", model.decoder.final_norm)
    if not c.tie_embeddings:
        tensors["lm_head.weight"] = model.lm_head.weight
    config = {
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.max_len,
        "n_embd": c.d_model,
        "n_layer": c.n_layers,
        "n_head": c.n_heads,
        "n_inner": c.d_ff,
        "activation_function": HF_ACTIVATIONS[c.activation],
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "layer_norm_epsilon": c.layer_norm_eps,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": c.tie_embeddings,
        "pad_token_id": c.pad_id,
        "bos_token_id": c.bos_id,
        "eos_token_id": c.eos_id,
    }
    return config, tensors
