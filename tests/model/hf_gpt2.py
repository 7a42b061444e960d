"""A random Hugging Face GPT-2 saved by `transformers` itself, and prompts of its ids.

Shared by the GPT-2 import tests (test_hf_import) and the PEFT adapter tests (test_hf_adapters).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_compare import randomize

transformers = pytest.importorskip("transformers")

VOCAB, EOS = 96, 2
GPT2 = dict(vocab_size=VOCAB, n_positions=48, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=EOS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [7], [90, 3, 3, 12, 60], [11, 22]]


def save_gpt2(directory: Path, seed: int = 0, eos_boost: float = 1.0, head: bool = True, **overrides) -> Path:
    """A random GPT-2 saved by transformers' save_pretrained (safetensors)."""
    config = transformers.GPT2Config(**{**GPT2, **overrides})
    cls = transformers.GPT2LMHeadModel if head else transformers.GPT2Model
    model = randomize(cls(config), seed=seed, eos_id=EOS, eos_boost=eos_boost)
    model.save_pretrained(directory)
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
