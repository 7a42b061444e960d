"""Beam search's fused log-softmax + top-k (model/kernels/beam_topk.cpp) against torch, and the beam search on it
against the beam search on torch's full log-probs."""

import math

import pytest
import torch

from model import native
from model.decoding import GenerationConfig
from tests.model.test_decoding import PROMPTS, ToyLM, generate

needs_kernels = pytest.mark.skipif(native.kernels() is None, reason="the C++ kernels do not run here")


def torch_candidates(logits: torch.Tensor, scores: torch.Tensor, k: int, banned: list[int]):
    """What the beam search computes without the kernel: log_softmax, the bans, the beam scores, top-k."""
    logprobs = torch.log_softmax(logits, dim=-1)
    logprobs[:, banned] = -math.inf
    flat = (logprobs + scores.flatten()[:, None]).view(scores.shape[0], -1)
    return flat.topk(min(k, flat.shape[1]), dim=1)


@needs_kernels
@pytest.mark.parametrize("sentences, width, vocab, k, banned, case", [
    (1, 1, 256206, 8, [2], "plain"),  # NLLB's first step: one row
    (2, 4, 6000, 8, [2, 7], "plain"),
    (32, 4, 32768, 8, [2], "plain"),  # 4 x 2^20 logits: rows in parallel
    (1, 4, 3000, 12, [], "restricted"),  # a vocabulary map: most columns -inf
    (2, 3, 50, 8, [1], "forced"),  # one finite column: the rest are -inf ties, filled in column order
    (1, 3, 5, 12, [0], "dead beam"),  # a tiny vocabulary, fewer columns than k, an empty (-inf) beam
])
def test_fused_candidates_equal_torch(sentences, width, vocab, k, banned, case, vector_bits):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(sentences * width, vocab, generator=g) * 4
    scores = torch.randn(sentences, width, generator=g) * 3
    if case == "restricted":
        logits[:, torch.rand(vocab, generator=g) < 0.9] = -math.inf
    if case == "forced":
        logits[:] = -math.inf
        logits[:, 5] = 0.0
    if case == "dead beam":
        scores[0, 1] = -math.inf
    values, ids = native.kernels().beam_topk(logits, scores.flatten(), width, k, banned)
    expected_values, expected_ids = torch_candidates(logits.clone(), scores, k, banned)
    assert torch.allclose(values, expected_values, rtol=1e-5, atol=1e-5)
    finite = expected_values > -math.inf  # -inf ties come back in id order; torch.topk promises no order
    assert torch.equal(ids[finite], expected_ids[finite]) and torch.equal(values > -math.inf, finite)
    for row_ids, row_finite in zip(ids.tolist(), finite.tolist(), strict=True):
        tied = [i for i, f in zip(row_ids, row_finite, strict=True) if not f]
        assert tied == sorted(tied) and len(set(row_ids)) == len(row_ids)


@needs_kernels
@pytest.mark.parametrize("vocab, extra", [
    (6, {}),
    (6000, {"length_penalty": 2.0, "early_stopping": "never"}),
    (300, {"min_new_tokens": 4, "banned_token_ids": (3, 9), "stop_token_ids": (5,)}),
    (300, {"forced_eos": True, "early_stopping": False}),  # the forced EOS step takes torch's path
])
def test_beam_search_on_fused_candidates_equals_it_on_full_log_probs(kernel_options, vocab, extra):
    model = ToyLM(vocab=vocab, eos_slope=0.5, scale=3.0)
    config = GenerationConfig(strategy="beam", num_beams=4, num_return_sequences=3, max_new_tokens=8, **extra)
    fused = generate(model, PROMPTS, config)
    kernel_options(decode_kernels=False)
    full = generate(model, PROMPTS, config)
    for a, b in zip(fused, full, strict=True):
        assert [(h.tokens, h.finish_reason) for h in a] == [(h.tokens, h.finish_reason) for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)
