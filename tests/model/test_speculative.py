"""Speculative decoding by prompt lookup: the drafter's lookups, outputs equal to plain decoding (greedy, seeded
sampling, EOS and stop strings inside a draft), and the sampled distribution against the model's exact one."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch

from model.decoding import GenerationConfig
from model.generation import generate_causal
from model.generation_config import ConfigError
from model.speculative import (
    ModelDrafter,
    NgramDrafter,
    SpeculativeConfig,
    check_draft_model,
    draft_model_for,
    speculative_for,
)
from tests.model.conftest import tiny_causal_lm
from tests.model.helpers import eos_friendly

REPETITIVE = [9, 10, 11, 12, 13, 9, 10, 11, 14, 15, 9, 10, 16, 17, 11, 12, 13, 9]


def counting_verify_steps(model) -> list[int]:
    """Record the width of every verification step of ``model`` (the real step runs)."""
    widths: list[int] = []
    step = model.verify_step

    def counted(ids, cache):
        widths.append(ids.shape[1])
        return step(ids, cache)

    model.verify_step = counted
    return widths


def test_the_drafter_continues_the_latest_earlier_occurrence_of_the_longest_tail():
    drafter = NgramDrafter(SpeculativeConfig(num_tokens=4), [5, 6, 7, 8, 1, 6, 7, 9, 2, 7])
    assert drafter.draft(3) == [9, 2, 7]  # tail (7,): its latest earlier occurrence is followed by 9, 2, 7
    drafter.append(8)  # tail (7, 8) occurred at the start: followed by 1, 6, 7, 9
    assert drafter.draft(4) == [1, 6, 7, 9]
    assert drafter.draft(2) == [1, 6]
    assert NgramDrafter(SpeculativeConfig(), [1, 2, 3]).draft(4) == []  # a tail never seen before
    drafter = NgramDrafter(SpeculativeConfig(ngram_min=2, ngram_max=2), [4, 5, 6, 4, 7, 4])
    assert drafter.draft(3) == []  # only (7, 4) is looked up, and it never occurred before


def test_model_defaults_are_parsed_per_model():
    assert speculative_for("none,code=ngram:4", "code") == SpeculativeConfig("ngram", 4)
    assert speculative_for("none,code=ngram:4", "translation") is None
    assert speculative_for("ngram:2", "any") == SpeculativeConfig("ngram", 2)
    for bad in ("ngram", "ngram:0", "ngram:17", "medusa:2"):
        with pytest.raises(ConfigError):
            speculative_for(bad, "any")


@pytest.mark.parametrize("num_tokens", [1, 3, 8])
@pytest.mark.parametrize("fields", [dict(), dict(strategy="sample", seed=11, temperature=0.7, top_k=12),
                                    dict(min_new_tokens=5)])
def test_speculative_outputs_equal_plain_decoding(num_tokens, fields):
    model = eos_friendly(tiny_causal_lm(max_len=128, vocab_size=24))
    widths = counting_verify_steps(model)
    spec = SpeculativeConfig(num_tokens=num_tokens)
    finished = set()
    for length in (4, 10, len(REPETITIVE)):
        prompt = REPETITIVE[:length]
        config = GenerationConfig(max_new_tokens=40, eos_token_id=2, logprobs=2, **fields)
        plain = generate_causal(model, [prompt], config)[0][0]
        fast = generate_causal(model, [prompt], config, speculative=spec)[0][0]
        assert (fast.tokens, fast.finish_reason) == (plain.tokens, plain.finish_reason)
        assert fast.logprob == pytest.approx(plain.logprob, abs=1e-4)
        assert fast.token_logprobs == pytest.approx(plain.token_logprobs, abs=1e-4)
        finished.add(plain.finish_reason)
    assert max(widths) > 1  # drafts were verified, not only single steps
    assert finished == {"eos", "length"}  # an EOS inside a draft, and the length limit


def test_a_stop_string_inside_an_accepted_draft_ends_where_plain_decoding_ends():
    model = tiny_causal_lm(max_len=128, vocab_size=24)
    config = GenerationConfig(max_new_tokens=30, eos_token_id=2)
    plain = generate_causal(model, [REPETITIVE], config)[0][0]
    stop_at = plain.tokens[5]
    seen: list[list[int]] = []

    def stop_fn(_input: int, tokens: list[int]) -> bool:
        seen.append(list(tokens))
        return tokens[-1] == stop_at

    want = generate_causal(model, [REPETITIVE], config, stop_fn=stop_fn)[0][0]
    got = generate_causal(model, [REPETITIVE], config, stop_fn=stop_fn, speculative=SpeculativeConfig(num_tokens=6))
    assert (got[0][0].tokens, got[0][0].finish_reason) == (want.tokens, "stop")
    assert all(t == plain.tokens[: len(t)] for t in seen)  # the hook sees the tokens so far, drafted ones too


@pytest.mark.parametrize("fields", [dict(), dict(stop_token_ids=(3,), logprobs=3), dict(min_new_tokens=6),
                                    dict(forced_eos=True, banned_token_ids=(5,)), dict(stop=True)])
def test_a_greedy_walk_in_one_call_records_what_the_stepwise_walk_records(fields):
    """verify() on a greedy search (choices_ahead + extend) against the same walk one advance per position, over
    random logits whose drafts agree for a random stretch: the verdicts, the results and the alternatives match."""
    from model.decoding import make_search
    from model.speculative import _verify_stepwise, verify

    generator = torch.Generator().manual_seed(0)
    stop_fn = (lambda _input, tokens: sum(tokens) % 7 == 0) if fields.pop("stop", False) else None  # noqa: E731
    config = GenerationConfig(max_new_tokens=12, eos_token_id=2, **fields)
    ended, at_once = set(), []
    for _ in range(40):
        searches = [make_search(config, 1, stop_fn) for _ in range(2)]
        ahead = searches[0].choices_ahead
        searches[0].choices_ahead = lambda logits, ahead=ahead: at_once.append(ahead(logits)) or at_once[-1]
        first = torch.randn(1, 8, generator=generator)
        for search in searches:
            search.advance(first)
        while not searches[0].done:
            logits = torch.randn(1 + int(torch.randint(0, 5, (1,), generator=generator)), 8, generator=generator)
            draft = logits[:-1].argmax(-1).tolist()  # the picks where nothing is banned ...
            cut = int(torch.randint(0, len(draft) + 1, (1,), generator=generator))
            draft[cut:] = [(t + 1) % 8 for t in draft[cut:]]  # ... up to a random disagreement
            room = config.max_new_tokens - searches[0].step
            logits, draft = logits[:room], draft[: room - 1]
            fast, slow = verify(searches[0], logits, draft), _verify_stepwise(searches[1], logits, draft)
            assert (fast.tokens, fast.accepted, fast.next_token is None) == (slow.tokens, slow.accepted,
                                                                               slow.next_token is None)
            assert searches[0].step == searches[1].step and searches[1].done == searches[0].done
        fast_result, slow_result = searches[0].results()[0][0], searches[1].results()[0][0]
        assert (fast_result.tokens, fast_result.finish_reason) == (slow_result.tokens, slow_result.finish_reason)
        assert fast_result.logprob == pytest.approx(slow_result.logprob, abs=1e-5)
        assert fast_result.top_logprobs == slow_result.top_logprobs or fast_result.top_logprobs == pytest.approx(
            slow_result.top_logprobs)
        ended.add(fast_result.finish_reason)
    assert len(ended) > 1 or config.forced_eos  # rows ended in more than one way (forced_eos: always "eos")
    assert sum(choice is not None for choice in at_once) > len(at_once) / 2  # mostly the one-call walk


def naive_greedy(model, tokens: list[int], count: int) -> list[int]:
    """``count`` argmax tokens after ``tokens``, each from a full forward pass without any cache."""
    tokens = list(tokens)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[-count:]


def test_a_draft_model_drafts_its_own_greedy_continuation_across_rejections():
    draft_model = tiny_causal_lm(max_len=64, vocab_size=24, d_model=16, d_ff=32)
    generator = torch.Generator().manual_seed(5)
    drafter = ModelDrafter(SpeculativeConfig("draft_model", 4), draft_model, REPETITIVE[:6])
    with torch.inference_mode():
        for _ in range(8):
            draft = drafter.draft(4)
            assert draft == naive_greedy(draft_model, drafter.tokens, 4)
            accepted = int(torch.randint(0, 5, (1,), generator=generator))  # some drafted tokens, then another one
            for token in [*draft[:accepted], int(torch.randint(3, 24, (1,), generator=generator))]:
                drafter.append(token)
        room = draft_model.config.max_len - len(drafter.tokens)
        assert len(drafter.draft(room + 5)) == room  # never past the draft model's positions


@pytest.mark.parametrize("fields", [dict(), dict(strategy="sample", seed=3, temperature=0.8), dict(logprobs=2)])
@pytest.mark.parametrize("draft", ["other", "itself"])
def test_drafts_of_a_draft_model_leave_outputs_as_plain_decoding_gives_them(fields, draft):
    """A different small model (some drafts rejected) or the model itself (every draft accepted) as the draft."""
    model = eos_friendly(tiny_causal_lm(max_len=128, vocab_size=24))
    draft_model = copy.deepcopy(model) if draft == "itself" else tiny_causal_lm(max_len=128, vocab_size=24,
                                                                                 d_model=16, d_ff=32)
    widths, seen = counting_verify_steps(model), []
    config = GenerationConfig(max_new_tokens=30, eos_token_id=2, **fields)
    for prompt in (REPETITIVE[:5], REPETITIVE[:11], REPETITIVE):
        plain = generate_causal(model, [prompt], config)[0][0]
        widths.clear()
        fast = generate_causal(model, [prompt], config, speculative=SpeculativeConfig("draft_model", 3),
                               draft_model=draft_model)[0][0]
        assert (fast.tokens, fast.finish_reason) == (plain.tokens, plain.finish_reason)
        assert fast.logprob == pytest.approx(plain.logprob, abs=1e-4)
        seen += widths
        if draft == "itself" and config.strategy == "greedy":  # every draft accepted: 4 tokens per step
            assert len(widths) <= math.ceil(len(plain.tokens) / 4) + 1
    assert max(seen) == 4  # drafts of 3 were verified


def test_a_draft_model_must_share_the_models_vocabulary_and_be_named_well():
    target, vocab = tiny_causal_lm(vocab_size=24), {f"t{i}": i for i in range(24)}
    check_draft_model(target, vocab, tiny_causal_lm(vocab_size=24, d_model=16), dict(vocab))
    with pytest.raises(ConfigError, match="vocabularies"):
        check_draft_model(target, vocab, tiny_causal_lm(vocab_size=30), {f"t{i}": i for i in range(30)})
    with pytest.raises(ConfigError, match="vocabularies"):
        check_draft_model(target, vocab, tiny_causal_lm(vocab_size=24), {**vocab, "t0": 5, "t5": 0})
    assert draft_model_for("code=code-small", "code") == "code-small"
    assert draft_model_for("code=code-small", "other") is None
    assert draft_model_for("small,big=medium", "big") == "medium" and draft_model_for("small", "small") is None
    assert draft_model_for("", "code") is None
    for bad in ("code=", "=small"):
        with pytest.raises(ConfigError):
            draft_model_for(bad, "code")


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """The chi-square quantile for a one-sided normal z (3.29: p = 0.0005), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampling_with_drafts_keeps_the_models_distribution():
    """The pair of the 2nd and 3rd sampled tokens (both picked in verification steps) over 1,500 seeds, against its
    exact probability under the model (float64, summed over the 1st token): a chi-square test at p = 0.0005."""
    vocab = 10
    model = tiny_causal_lm(max_len=64, vocab_size=vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.4)  # (tied to the embeddings) spread: about ten likely tokens per step
    widths = counting_verify_steps(model)
    prompt = [7, 8, 9, 7, 8, 9, 8, 7, 9, 9]  # every sampled token has occurred: there is always a draft
    samples = Counter()
    for seed in range(1500):
        config = GenerationConfig(strategy="sample", seed=seed, max_new_tokens=3, eos_token_id=2, min_new_tokens=3)
        tokens = generate_causal(model, [prompt], config, speculative=SpeculativeConfig(num_tokens=2))[0][0].tokens
        samples[tuple(tokens[1:3])] += 1
    assert sum(w > 1 for w in widths) > 500
    reference = tiny_causal_lm(max_len=64, vocab_size=vocab).double()
    reference.load_state_dict(model.state_dict())
    exact = torch.zeros(vocab, vocab, dtype=torch.float64)
    with torch.no_grad():
        banned = torch.tensor([2])  # min_new_tokens: EOS may not be sampled
        first = torch.log_softmax(reference(torch.tensor([prompt]))[0, -1].index_fill(0, banned, -math.inf), -1).exp()
        for a in range(vocab):
            second = reference(torch.tensor([prompt + [a]]))[0, -1].index_fill(0, banned, -math.inf).softmax(-1)
            for b in range(vocab):
                third = reference(torch.tensor([prompt + [a, b]]))[0, -1].index_fill(0, banned, -math.inf)
                exact[b] += first[a] * second[b] * third.softmax(-1)
    n = sum(samples.values())
    cells = [(samples[(b, c)], n * float(exact[b, c])) for b in range(vocab) for c in range(vocab)]
    big = [(o, e) for o, e in cells if e >= 5]
    rest = (sum(o for o, e in cells if e < 5), sum(e for o, e in cells if e < 5))
    bins = big + ([rest] if rest[1] > 0 else [])
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    assert len(big) >= 5
    assert statistic < chi_square_critical(len(bins) - 1), (statistic, len(bins))
