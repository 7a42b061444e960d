"""MBartForConditionalGeneration (mBART-50) -> our seq2seq: bart.py's naming, pre-LN with the embedding LayerNorm
and a final LayerNorm in each stack, learned positions (offset 2), final_logits_bias. The target language is the
forced first token (``forced_bos_token_id``, model.generation.force_first_tokens); a config.json without
``decoder_start_token_id`` starts the decoder from ``bos_token_id``, as generate() does. PEFT adapters: bart.py's
layout (ADAPTER_LAYOUT)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.config import Seq2SeqConfig
from model.hf.bart import Variant, adapter_layout, config_for, ignored_flags, tensors_for
from model.hf.common import Tensors

ARCHITECTURES = ("MBartForConditionalGeneration",)
MBART = Variant("mBART", "pre", embedding_norm=True, final_norm=True, scale_default=False,
                activation_default="gelu", head_bias=True, rules=ignored_flags(pre_norm=True))


def to_config(hf: Mapping[str, Any]) -> Seq2SeqConfig:
    """Our config for mBART's config.json."""
    return config_for(hf, MBART)


def state_dict(c: Seq2SeqConfig, t: Tensors) -> Tensors:
    """Our Seq2SeqTransformer's state dict from mBART's tensors."""
    return tensors_for(c, t, MBART)


ADAPTER_LAYOUT = adapter_layout(MBART.name)
