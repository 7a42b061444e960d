"""A random Hugging Face BERT saved by `transformers` itself, and a right-padded batch of texts and pairs for it.

Shared by the BERT import tests (test_hf_bert) and the PEFT adapter tests (test_hf_adapters, test_hf_modules_to_save).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_compare import randomize

transformers = pytest.importorskip("transformers")

PAD, CLS, SEP = 0, 2, 3
LABELS = ["neg", "pos", "mid"]
BERT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)
TEXTS = [([10, 11, 12], [20, 21]), ([30], [40, 41, 42, 43, 44]), ([50, 51], None), ([7, 8, 9, 60, 61, 62], [5])]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """ "[CLS] a [SEP] (b [SEP])" rows, right-padded, and their token types (1 on the pair's second text)."""
    rows = [([CLS, *a, SEP], [*b, SEP] if b else []) for a, b in TEXTS]
    width = max(len(a) + len(b) for a, b in rows)
    ids = [a + b + [PAD] * (width - len(a) - len(b)) for a, b in rows]
    types = [[0] * len(a) + [1] * len(b) + [0] * (width - len(a) - len(b)) for a, b in rows]
    return torch.tensor(ids), torch.tensor(types)


def save_bert(directory: Path, head: bool = True, pooler: bool = True, seed: int = 0, **overrides):
    """A random BERT saved by transformers' save_pretrained (safetensors); the model itself, in eval mode."""
    config = transformers.BertConfig(**{**BERT, "id2label": dict(enumerate(LABELS)), **overrides})
    model = transformers.BertForSequenceClassification(config) if head else transformers.BertModel(config, pooler)
    randomize(model, seed=seed).save_pretrained(directory)
    return model


def hf_outputs(model, dtype: torch.dtype, ids: torch.Tensor, types: torch.Tensor):
    with torch.no_grad():
        return model.to(dtype)(input_ids=ids, attention_mask=(ids != PAD).long(), token_type_ids=types)
