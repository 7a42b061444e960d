"""A random MarianMTModel (the OPUS-MT layout) saved by `transformers` itself, and right-padded sources for it.

OPUS-MT's ids: EOS 0, the pad id last and the decoder start. Shared by the Marian import tests (test_hf_marian)
and the PEFT adapter tests (test_hf_adapters).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_compare import randomize

transformers = pytest.importorskip("transformers")

VOCAB, EOS, PAD = 96, 0, 95
MARIAN = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=48,
              activation_function="swish", scale_embedding=True, pad_token_id=PAD, eos_token_id=EOS,
              decoder_start_token_id=PAD, forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0,
              activation_dropout=0.0)
SOURCES = [[5, 17, 33, EOS], [40, 41, 42, 43, 44, 45, 46, EOS], [7, EOS], [90, 3, 3, 12, 60, EOS], [11, 22, EOS]]


def save_marian(directory: Path, seed: int = 0, eos_boost: float = 1.0, **overrides) -> Path:
    """A random MarianMTModel with a random final_logits_bias (-inf for token 1, ruled out as our export's
    appended row is), saved by transformers' save_pretrained."""
    model = randomize(transformers.MarianMTModel(transformers.MarianConfig(**{**MARIAN, **overrides})), seed=seed,
                      eos_id=EOS, eos_boost=eos_boost)
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
        model.final_logits_bias[0, 1] = float("-inf")
    model.save_pretrained(directory)
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.MarianMTModel.from_pretrained(directory, dtype=dtype).eval()


def padded_sources() -> tuple[torch.Tensor, torch.Tensor]:
    """SOURCES right-padded with PAD, and their attention mask."""
    width = max(map(len, SOURCES))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in SOURCES])
    return ids, (ids != PAD).long()


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference of finite logits; both must rule out (-inf) the same tokens."""
    assert torch.equal(ours.isneginf(), theirs.isneginf())  # a -inf bias rules the same tokens out
    finite = ours.isfinite()
    return float((ours[finite] - theirs[finite]).abs().max())
