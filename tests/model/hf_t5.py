"""Random T5 v1.0, T5 v1.1 (Flan-T5's layout) and mT5 models saved by `transformers` itself, and padded sources.

T5's ids: pad 0 (also the decoder start), EOS 1. Eight relative position buckets up to a distance of 16, so that the
sources and targets here (up to 26 positions) reach the far buckets. Shared by the T5 import tests (test_hf_t5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_compare import randomize

transformers = pytest.importorskip("transformers")

VOCAB, PAD, EOS = 80, 0, 1
BUCKETS, MAX_DISTANCE = 8, 16
T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_decoder_layers=2, num_heads=4,
          relative_attention_num_buckets=BUCKETS, relative_attention_max_distance=MAX_DISTANCE, dropout_rate=0.0,
          pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
VARIANTS = {  # name -> (model_type, config overrides, untied head)
    "t5-v1.0": ("t5", {"feed_forward_proj": "relu"}, False),
    "t5-v1.1": ("t5", {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "d_kv": 12}, True),
    "mt5": ("mt5", {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5},
            True),
}
CLASSES = {"t5": ("T5Config", "T5ForConditionalGeneration"), "mt5": ("MT5Config", "MT5ForConditionalGeneration")}
SOURCES = [[5, 17, 33, 9, 12, EOS], list(range(40, 64)) + [EOS], [7, EOS], [70, 3, 3, 12, 60, 61, 62, 63, 8, EOS],
           [11, 22, EOS]]


def save_t5(directory: Path, variant: str, seed: int = 0, eos_boost: float = 1.0) -> Path:
    """A random model of ``variant`` saved by transformers' save_pretrained; an untied head gets weights of its own
    (transformers ties it at construction, and keeps it apart on loading when the saved tensors differ)."""
    model_type, overrides, untied = VARIANTS[variant]
    config_class, model_class = (getattr(transformers, name) for name in CLASSES[model_type])
    model = model_class(config_class(**{**T5, **overrides}))
    if untied:
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.shared.weight))
    randomize(model, seed=seed, eos_id=EOS, eos_boost=eos_boost)
    with torch.no_grad():  # T5 folds 1/sqrt(d_kv) into q's initialisation (its q.k is not scaled)
        for name, p in model.named_parameters():
            if name.endswith(".q.weight"):
                p.mul_(model.config.d_kv**-0.5)
    model.save_pretrained(directory)
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(directory, dtype=dtype).eval()


def padded_sources() -> tuple[torch.Tensor, torch.Tensor]:
    """SOURCES right-padded with PAD, and their attention mask."""
    width = max(map(len, SOURCES))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in SOURCES])
    return ids, (ids != PAD).long()
