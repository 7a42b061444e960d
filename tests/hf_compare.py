"""Comparing our models with `transformers`: random weights that make outputs differ, matching decoding settings.

Shared by the export tests (ours -> HF) and the import tests (HF -> ours).
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.decoding import GenerationConfig

MAX_NEW = 12
ATOL = 1e-4


def randomize(model: torch.nn.Module, seed: int, eos_id: int = 2, eos_boost: float = 1.0) -> torch.nn.Module:
    """Every parameter random (LayerNorm gains around 1); the EOS row of the output embedding scaled up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name and name.endswith("weight") else 0.3 * noise)
        head = getattr(model, "lm_head", None)
        if head is not None:
            head.weight[eos_id] *= eos_boost
    return model.eval()


def strip(seq: list[int], start: int, eos: int = 2) -> list[int]:
    """HF output after the prompt/decoder start, cut at the first EOS (padding follows it)."""
    out = seq[start:]
    return out[: out.index(eos)] if eos in out else out


def best_tokens(hyps) -> list[list[int]]:
    """The best hypothesis's tokens of each input."""
    return [h[0].tokens for h in hyps]


# Decodings compared with generate(): greedy, and beam-4 under HF's default rules and two other ones.
BEAMS = {
    "beam": dict(length_penalty=1.0, early_stopping=False),  # generate()'s defaults
    "beam-never": dict(length_penalty=0.6, early_stopping="never"),
    "beam-early": dict(length_penalty=2.0, early_stopping=True),
}
DECODINGS = ["greedy", *BEAMS]


def decoding(name: str) -> tuple[GenerationConfig, dict]:
    """Our GenerationConfig and generate()'s keyword arguments for decoding ``name`` (one of DECODINGS)."""
    hf = dict(max_new_tokens=MAX_NEW, do_sample=False, num_beams=1)
    if name == "greedy":
        return GenerationConfig(strategy="greedy", max_new_tokens=MAX_NEW), hf
    beam = dict(num_beams=4, **BEAMS[name])
    return GenerationConfig(strategy="beam", max_new_tokens=MAX_NEW, **beam), hf | beam


def repeats_ngram(sequence: list[int], n: int) -> bool:
    """Whether some n-gram occurs twice in ``sequence``."""
    grams = [tuple(sequence[i: i + n]) for i in range(len(sequence) - n + 1)]
    return len(grams) != len(set(grams))


def assert_varied(outputs: list[list[int]]) -> None:
    """The inputs must exercise both endings: EOS before the limit, and the length limit."""
    lengths = [len(o) for o in outputs]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths


def peft_adapter(base: torch.nn.Module, directory: Path, seed: int, **fields) -> Path:
    """A PEFT LoRA adapter on HF model ``base`` (LoraConfig ``fields``), saved by peft: random non-zero A and B,
    and copies of ``modules_to_save`` (a SEQ_CLS adapter's head) moved off the base's."""
    import peft  # test-only, and only for the tests that make adapters

    adapted = peft.get_peft_model(base, peft.LoraConfig(**fields))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "modules_to_save" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    adapted.save_pretrained(directory)
    return directory
