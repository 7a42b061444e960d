"""Per-token log-probabilities and top-N alternatives of every search, against a float64 forward of the whole
sequence without a cache (the naive reference)."""

from __future__ import annotations

import pytest
import torch

from model.decoding import ConfigError, GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from tests.model.conftest import tiny_causal_lm, tiny_seq2seq
from tests.model.helpers import PROMPTS, eos_friendly

TOP = 5


def reference_causal(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax (float64) of the distribution each generated position was drawn from: (len(tokens) + 1, V)."""
    reference = tiny_causal_lm(max_len=64).double()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens]))[0]
    return torch.log_softmax(logits[len(prompt) - 1:], dim=-1)


def check(hyp, reference: torch.Tensor, top: int | None) -> None:
    n = len(hyp.tokens)
    assert len(hyp.token_logprobs) == n
    want = reference[torch.arange(n), torch.tensor(hyp.tokens)]
    torch.testing.assert_close(torch.tensor(hyp.token_logprobs, dtype=torch.float64), want, rtol=0, atol=2e-4)
    # The terminator's log-prob is in the total only.
    rest = hyp.logprob - sum(hyp.token_logprobs)
    if hyp.finish_reason == "eos":
        assert rest == pytest.approx(float(reference[n, 2]), abs=5e-4)
    else:
        assert rest == pytest.approx(0.0, abs=5e-4)
    if not top:
        assert hyp.top_logprobs is None
        return
    for position, alternatives in enumerate(hyp.top_logprobs):
        values, ids = reference[position].topk(top)
        assert [i for i, _ in alternatives] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in alternatives], dtype=torch.float64), values,
                                   rtol=0, atol=2e-4)


@pytest.mark.parametrize("top", [0, TOP])
@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam"])
def test_token_logprobs_and_alternatives_match_a_float64_forward(strategy, top):
    model = eos_friendly(tiny_causal_lm(max_len=64))
    fields = dict(num_beams=3, num_return_sequences=3) if strategy == "beam" else {}
    if strategy == "sample":
        fields = dict(seed=5, temperature=0.7, top_k=10, num_return_sequences=2)
    config = GenerationConfig(strategy=strategy, max_new_tokens=12, logprobs=top, eos_token_id=2, **fields)
    results = generate_causal(model, PROMPTS, config)
    finished = set()
    for prompt, hyps in zip(PROMPTS, results, strict=True):
        for hyp in hyps:
            check(hyp, reference_causal(model, prompt, hyp.tokens), top)
            finished.add(hyp.finish_reason)
    assert finished == {"eos", "length"}  # both ends checked


def test_greedy_tokens_are_their_positions_first_alternative():
    model = tiny_causal_lm(max_len=64)
    config = GenerationConfig(max_new_tokens=10, logprobs=3, eos_token_id=2)
    for hyps in generate_causal(model, PROMPTS, config):
        hyp = hyps[0]
        assert [alternatives[0][0] for alternatives in hyp.top_logprobs] == hyp.tokens


def test_seq2seq_beam_records_the_chosen_paths_logprobs():
    model = eos_friendly(tiny_seq2seq())
    sources = [[9, 10, 11, 12], [13, 14, 15]]
    config = GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=8, logprobs=2,
                              eos_token_id=2)
    reference = tiny_seq2seq().double()
    reference.load_state_dict(model.state_dict())
    for source, hyps in zip(sources, generate_seq2seq(model, sources, config), strict=True):
        for hyp in hyps:
            with torch.no_grad():
                logits = reference(torch.tensor([source]), torch.tensor([[model.config.bos_id] + hyp.tokens]))[0]
            check(hyp, torch.log_softmax(logits, dim=-1), 2)


def test_without_logprobs_nothing_is_recorded_and_the_cap_is_checked():
    hyp = generate_causal(tiny_causal_lm(max_len=64), PROMPTS[:1], GenerationConfig(max_new_tokens=4))[0][0]
    assert hyp.token_logprobs is None and hyp.top_logprobs is None
    with pytest.raises(ConfigError, match="logprobs"):
        GenerationConfig(logprobs=21)
    with pytest.raises(ConfigError, match="logprobs"):
        GenerationConfig(logprobs=-1)
