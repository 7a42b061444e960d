"""M2M100ForConditionalGeneration (M2M100 and NLLB-200) -> our seq2seq: bart.py's naming, pre-LN with a final
LayerNorm in each stack, no embedding LayerNorm, scaled embeddings, ReLU, no logits bias, and fairseq's sinusoidal
positions (:func:`position_table`). The target language is the forced first token (``forced_bos_token_id``,
model.generation.force_first_tokens); the decoder starts from ``decoder_start_token_id`` (EOS). PEFT adapters:
bart.py's layout (ADAPTER_LAYOUT)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from model.config import Seq2SeqConfig
from model.hf.bart import Variant, adapter_layout, config_for, tensors_for
from model.hf.common import Tensors

ARCHITECTURES = ("M2M100ForConditionalGeneration",)


def position_table(rows: int, d_model: int, pad_id: int) -> torch.Tensor:
    """The rows of M2M100SinusoidalPositionalEmbedding's table that positions 0..rows-1 of a right-padded row read
    (``pad_id + 1 + t``), computed as transformers does (in float32): sin of every frequency
    10000^(-i / (d/2 - 1)) in the first half of the dims, cos in the second, a zero column for an odd d_model."""
    half = d_model // 2
    step = math.log(10000) / (half - 1) if half > 1 else 0.0  # half = 1: transformers divides by zero
    frequencies = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(pad_id + 1, pad_id + 1 + rows, dtype=torch.int64).float()[:, None] * frequencies[None]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if d_model % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    return table


M2M100 = Variant("M2M100", "pre", embedding_norm=False, final_norm=True, scale_default=True,
                 activation_default="relu", head_bias=False, rules=(), position_table=position_table)


def to_config(hf: Mapping[str, Any]) -> Seq2SeqConfig:
    """Our config for M2M100's (and NLLB-200's) config.json."""
    return config_for(hf, M2M100)


def state_dict(c: Seq2SeqConfig, t: Tensors) -> Tensors:
    """Our Seq2SeqTransformer's state dict from M2M100's tensors."""
    return tensors_for(c, t, M2M100)


ADAPTER_LAYOUT = adapter_layout(M2M100.name)
