"""Decoding on each target: cached vs uncached, batched vs alone, beam 1 vs greedy, and the float64 CPU reference
(greedy tokens identical to the CPU's in float32; logits within the dtype's tolerance of float64)."""

from __future__ import annotations

import pytest
import torch

from model.decoding import GenerationConfig
from model.generation import generate_causal
from tests.cuda.conftest import FAMILIES, Target, assert_close, assert_same_tokens, targets
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_classifier, tiny_seq2seq
from tests.model.helpers import PROMPTS, eos_friendly

GREEDY = GenerationConfig(max_new_tokens=12)
BEAM = GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=10)


def _model(family: str, target: Target) -> torch.nn.Module:
    make = FAMILIES[family][0]
    return target.place(eos_friendly(make(tie_embeddings=False)))


def _assert_same_hypotheses(target: Target, got: list, want: list, model, family: str, prompt) -> None:
    """Per hypothesis: tokens as :func:`assert_same_tokens` says; in float32 also the scores and finish reasons."""
    logits_at = FAMILIES[family][2](model, prompt)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_same_tokens(target, g.tokens, w.tokens, model.config.eos_id, logits_at)
        if target.exact:
            assert g.finish_reason == w.finish_reason and g.score == pytest.approx(w.score, abs=1e-4)


@pytest.mark.parametrize("target", targets())
def test_cached_decoding_equals_uncached(target):
    model = target.place(tiny_causal_lm())
    ids = target.tensor(random_ids(3, 20))
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(3, capacity=4)  # small: the cache grows while decoding
        logits = model.prefill(ids[:, :5], torch.full((3,), 5, device=target.device), cache)
        assert_close(logits, full[:, 4], target.tol, "prefill")
        for t in range(5, 20):
            assert_close(model.decode_step(ids[:, t], cache), full[:, t], target.tol, f"step {t}")

    cached = generate_causal(model, PROMPTS, GREEDY)
    uncached = generate_causal(model, PROMPTS, GREEDY, use_cache=False)
    for prompt, a, b in zip(PROMPTS, cached, uncached, strict=True):
        _assert_same_hypotheses(target, a, b, model, "causal_lm", prompt)


@pytest.mark.parametrize("target", targets())
def test_seq2seq_cached_decoding_equals_teacher_forcing(target):
    model = target.place(tiny_seq2seq())
    src = random_ids(2, 7)
    src[1, 4:] = 0  # a padded source
    tgt = random_ids(2, 12, seed=5)
    tgt[:, 0] = model.config.bos_id
    src, tgt = target.tensor(src), target.tensor(tgt)
    with torch.inference_mode():
        full = model(src, tgt)
        logits, cache = model.start(src, capacity=3)
        assert_close(logits, full[:, 0], target.tol, "first step")
        for t in range(1, 12):
            assert_close(model.decode_step(tgt[:, t], cache), full[:, t], target.tol, f"step {t}")


@pytest.mark.parametrize("config", [GREEDY, BEAM], ids=lambda c: c.strategy)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target", targets())
def test_batched_equals_alone(target, family, config):
    model, generate = _model(family, target), FAMILIES[family][1]
    batched = generate(model, PROMPTS, config)
    for prompt, hyps in zip(PROMPTS, batched, strict=True):
        _assert_same_hypotheses(target, hyps, generate(model, [prompt], config)[0], model, family, prompt)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target", targets())
def test_beam_of_one_equals_greedy(target, family):
    model, generate = _model(family, target), FAMILIES[family][1]
    greedy = generate(model, PROMPTS, GenerationConfig(max_new_tokens=10))
    beam = generate(model, PROMPTS, GenerationConfig(strategy="beam", num_beams=1, length_penalty=0.0,
                                                     max_new_tokens=10))
    for prompt, g, b in zip(PROMPTS, greedy, beam, strict=True):
        _assert_same_hypotheses(target, g, b, model, family, prompt)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target", targets())
def test_greedy_matches_the_cpu(target, family):
    """float32: the same tokens as the CPU in float32; lower precision: the float64 CPU's up to ties."""
    make, generate, _ = FAMILIES[family]
    reference = Target("cpu", torch.float32 if target.exact else torch.float64)
    cpu_model = reference.place(eos_friendly(make(tie_embeddings=False)))
    want = generate(cpu_model, PROMPTS, GREEDY)
    got = generate(_model(family, target), PROMPTS, GREEDY)
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        _assert_same_hypotheses(target, g, w, cpu_model, family, prompt)


@pytest.mark.parametrize("target", targets())
def test_logits_within_tolerance_of_float64_cpu(target):
    ids, tgt = random_ids(3, 12), random_ids(3, 9, seed=4)
    ids[2, 7:] = 0  # padding
    lm, lm64 = target.place(tiny_causal_lm()), tiny_causal_lm().double()
    s2s, s2s64 = target.place(tiny_seq2seq()), tiny_seq2seq().double()
    clf, clf64 = target.place(tiny_classifier()), tiny_classifier().double()
    with torch.inference_mode():
        assert_close(lm(target.tensor(ids)), lm64(ids), target.tol, "causal_lm logits")
        assert_close(s2s(target.tensor(ids), target.tensor(tgt)), s2s64(ids, tgt), target.tol, "seq2seq logits")
        assert_close(clf(target.tensor(ids)), clf64(ids), target.tol, "classifier logits")
        for pooling in ("cls", "mean"):
            assert_close(clf.embed_texts(target.tensor(ids), pooling=pooling), clf64.embed_texts(ids, pooling=pooling),
                         target.tol, f"{pooling} embeddings")


def test_tokens_may_part_only_at_a_tie():
    """The rule low-precision searches are held to, on made-up logits (tokens 3 and 4 tie after [5])."""
    logits = {(): torch.tensor([0.0, 0, 0, 1, 0, 2]), (5,): torch.tensor([0.0, 0, 0, 1.9995, 2, 0])}

    def logits_at(prefix: list[int]) -> torch.Tensor:
        return logits[tuple(prefix)]

    low, exact = Target("cpu", torch.bfloat16), Target("cpu", torch.float32)
    assert_same_tokens(low, [5, 3, 1], [5, 4], 2, logits_at)
    assert_same_tokens(low, [5, 3], [5, 3], 2, logits_at)
    with pytest.raises(AssertionError, match="part at step 0"):
        assert_same_tokens(low, [3], [5], 2, logits_at)  # 1 vs 2: no tie
    with pytest.raises(AssertionError):
        assert_same_tokens(exact, [5, 3], [5, 4], 2, logits_at)  # float32: no parting at all
