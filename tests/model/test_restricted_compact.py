"""Restricted searches in their own width (model.restricted_vocab's compact logits, issue 39): a compacted
restriction's logits are the full ones' candidate columns, and a beam or greedy search over them finds the tokens and
scores of the same search over the full width, whatever its bans, finish tokens and mixed rows."""

from __future__ import annotations

import math

import pytest
import torch

from model.beam_search import BeamSearch
from model.decoding import GenerationConfig, GreedySearch
from model.kernel_layers import Linear
from model.restricted_vocab import VocabularyRestriction
from model.search import run_search
from model.tokenizer import pad_batch
from tests.model.conftest import tiny_seq2seq

SOURCES = [[5, 9, 14, 3, 22], [30, 7, 7, 12], [11, 25, 6, 18, 19, 4], [8, 33]]
# Per row its candidates (EOS 2 in each; rows of "different languages": different sets), or None (no map).
ROWS = [(2, 5, 6, 9, 14, 17, 21, 30), (2, 4, 7, 12, 13, 25, 31, 36, 37), (2, 3, 6, 10, 18, 19, 26), (2, 8, 9, 33, 39)]


class FullWidthBeamSearch(BeamSearch):
    """Today's path, the reference: the same search reading full-width logits only."""

    picks_by_columns = False


class FullWidthGreedySearch(GreedySearch):
    picks_by_columns = False


# strategy -> (the search, its full-width reference, the strategy's config fields)
STRATEGIES = {
    "beam 4": (BeamSearch, FullWidthBeamSearch,
               dict(strategy="beam", num_beams=4, num_return_sequences=2, early_stopping=False)),
    "greedy": (GreedySearch, FullWidthGreedySearch, dict(strategy="greedy", min_new_tokens=3)),  # EOS is likely
}


@pytest.fixture(scope="module")
def model():
    """The tiny model with a head bias making EOS (2) and the stop token (9) likely: hypotheses of every kind."""
    model = tiny_seq2seq()
    bias = torch.zeros(model.config.vocab_size)
    bias[2], bias[9] = 6.0, 6.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model


def search_with(model, search_type: type, config: GenerationConfig, rows) -> tuple[list, list[int]]:
    """run_search as model.generation.generate_seq2seq drives it: (hypotheses, the logits' width at each step)."""
    search = search_type(config, len(SOURCES), prefixes=[[model.config.bos_id]] * len(SOURCES))
    widths = []
    with torch.inference_mode():
        src, _ = pad_batch(SOURCES, model.config.pad_id)
        search.vocabulary = VocabularyRestriction.of_rows(rows, model.config.vocab_size, "cpu")
        first, cache = model.start(src, capacity=config.max_new_tokens + 1, vocabulary=search.vocabulary)

        def step(tokens: torch.Tensor) -> torch.Tensor:
            logits = model.decode_step(tokens, cache, search.vocabulary)
            widths.append(logits.shape[1])
            return logits

        return run_search(search, first, step, cache.select), widths


CONFIGS = {
    "plain": dict(),
    "min length, bans in and out of the union, stop token": dict(min_new_tokens=4, banned_token_ids=(6, 11),
                                                                 stop_token_ids=(9,)),
    "forced EOS, renormalized, length penalty": dict(forced_eos=True, renormalize=True, length_penalty=0.6),  # beam
    "no_repeat_ngram_size (full width)": dict(no_repeat_ngram_size=2),
    "logprobs (full width)": dict(logprobs=2),
}


@pytest.mark.parametrize("mixed", [False, True], ids=["every row mapped", "a row without a map"])
@pytest.mark.parametrize("case", list(CONFIGS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_compact_search_finds_the_full_widths_tokens_and_scores(model, strategy, case, mixed):
    search_type, reference_type, fields = STRATEGIES[strategy]
    if strategy == "greedy" and "renormalized" in case:
        pytest.skip("renormalize and length_penalty are beam search's")
    config = GenerationConfig(max_new_tokens=7, eos_token_id=model.config.eos_id, **{**fields, **CONFIGS[case]})
    rows = [None if mixed and i == 1 else r for i, r in enumerate(ROWS)]
    got, widths = search_with(model, search_type, config, rows)
    want, full_widths = search_with(model, reference_type, config, rows)
    vocab = model.config.vocab_size
    assert set(full_widths) == {vocab}
    if config.reads_history or config.logprobs is not None:
        assert set(widths) == {vocab}
    elif not mixed:  # compact from the second step on (with an unmapped row: once its sentence has finished)
        assert max(widths) < vocab
    assert {h.finish_reason for r in want for h in r} >= ({"eos", "stop"} if config.stop_token_ids else {"eos"})
    for row, (hyps, refs) in enumerate(zip(got, want, strict=True)):
        assert [h.tokens for h in hyps] == [h.tokens for h in refs]
        assert [h.finish_reason for h in hyps] == [h.finish_reason for h in refs]
        for hyp, ref in zip(hyps, refs, strict=True):
            assert math.isclose(hyp.score, ref.score, rel_tol=1e-6, abs_tol=1e-6)
            assert math.isclose(hyp.logprob, ref.logprob, rel_tol=1e-6, abs_tol=1e-6)
            assert hyp.token_logprobs == ref.token_logprobs and hyp.top_logprobs == ref.top_logprobs
            if rows[row] is not None:
                assert set(hyp.tokens) <= set(rows[row])


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced head", "head computed whole"])
def test_compacted_logits_are_the_full_logits_candidate_columns(sliced):
    torch.manual_seed(0)
    linear = Linear(16, 50, bias=True).eval()
    head = linear if sliced else torch.nn.Sequential(linear)
    restriction = VocabularyRestriction.of_rows([(1, 4, 9), (2, 4, 30, 49)], 50, "cpu")
    compact = restriction.compacted([2])
    assert compact.compact and compact.ids is restriction.ids
    hidden = torch.randn(2, 16)
    with torch.no_grad():
        full, small = restriction.logits(head, hidden), compact.logits(head, hidden)
    assert small.shape == (2, 6) and torch.equal(small, full[:, restriction.ids])
    assert compact.select(torch.tensor([1, 1, 0])).compact
    assert compact.columns([49, 3, 2, 1]) == (5, 1, 0)
    assert restriction.compacted([2, 3, 2]) is restriction  # a finish token outside the union: full width
    mixed = VocabularyRestriction.of_rows([(1, 4), None], 50, "cpu")
    assert mixed.compacted([1]) is mixed  # an unrestricted row: full width
