"""Random BART-family models (BART, mBART, M2M100, NLLB-200's values on M2M100) saved by `transformers` itself,
right-padded sources for them, and generate()'s per-row forced first token (mixed target languages in one batch).

The family's ids: <s> 0, pad 1, </s> 2 (EOS, and the decoder start of BART and M2M100); LANGUAGES stand for
language codes. Shared by the import tests (test_hf_bart_family).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_compare import randomize

transformers = pytest.importorskip("transformers")

VOCAB, BOS, PAD, EOS = 64, 0, 1, 2
LANGUAGES = (60, 61, 62)  # stand-ins for language codes (mBART-50's "fr_XX", NLLB's "fra_Latn")
SIZES = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=40,
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
             pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
# name -> (model class, config class, config overrides): each class and config variant
VARIANTS = {
    "bart": ("BartForConditionalGeneration", "BartConfig", {}),
    "bart-scaled-untied": ("BartForConditionalGeneration", "BartConfig",
                           {"scale_embedding": True, "tie_word_embeddings": False, "activation_function": "relu"}),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", {"scale_embedding": True, "decoder_start_token_id": EOS}),
    "mbart-bos-start-untied": ("MBartForConditionalGeneration", "MBartConfig", {"tie_word_embeddings": False}),
    "m2m100": ("M2M100ForConditionalGeneration", "M2M100Config", {}),
    "nllb": ("M2M100ForConditionalGeneration", "M2M100Config",  # NLLB-200's config values, smaller
             {"d_model": 24, "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 48,
              "decoder_ffn_dim": 48, "activation_function": "relu", "scale_embedding": True,
              "decoder_start_token_id": EOS, "tie_word_embeddings": True, "init_std": 0.02}),
}
SOURCES = [[5, 17, 33, EOS], [40, 41, 42, 43, 44, 45, 46, EOS], [7, EOS], [50, 3, 3, 12, 30, EOS], [11, 22, EOS]]


def model_class(variant: str) -> type:
    return getattr(transformers, VARIANTS[variant][0])


def save_variant(directory: Path, variant: str, seed: int = 0, eos_boost: float = 1.0, **overrides) -> Path:
    """A random model of ``variant`` (with a random final_logits_bias where the class has one), saved by
    transformers' save_pretrained (its generation_config.json included)."""
    cls, config_cls, fields = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**SIZES, **fields, **overrides})
    model = randomize(getattr(transformers, cls)(config), seed=seed, eos_id=EOS, eos_boost=eos_boost)
    if hasattr(model, "final_logits_bias"):
        with torch.no_grad():
            model.final_logits_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    return directory


def hf_model(directory: Path, variant: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return model_class(variant).from_pretrained(directory, dtype=dtype).eval()


def padded_sources() -> tuple[torch.Tensor, torch.Tensor]:
    """SOURCES right-padded with PAD, and their attention mask."""
    width = max(map(len, SOURCES))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in SOURCES])
    return ids, (ids != PAD).long()


class ForcedFirstPerRow(transformers.LogitsProcessor):
    """generate()'s ForcedBOSTokenLogitsProcessor with a token per input (rows of one input: its beams)."""

    def __init__(self, tokens: list[int], rows_per_input: int) -> None:
        self.tokens = torch.tensor(tokens).repeat_interleave(rows_per_input)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != 1:
            return scores
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.tokens[:, None].to(scores.device), 0.0)
