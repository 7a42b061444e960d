"""Vocabulary maps (CTranslate2's vmap format, built by co-occurrence) and decoding restricted to them: logits
against a float64 reference of the full head masked per row, outputs within each row's candidates, a row's
output independent of its batch, and an all-allowing map giving the unrestricted outputs exactly."""

from __future__ import annotations

import pytest
import torch

from model.bf16_linear import Bf16Linear
from model.decoding import GenerationConfig
from model.generation import generate_seq2seq
from model.int8_linear import Int8Linear
from model.kernel_layers import Linear
from model.restricted_vocab import VocabularyRestriction
from model.vocab_map import VocabularyMap, VocabularyMapError, build_vocabulary_map
from tests.model.conftest import tiny_seq2seq

WORDS = {"<s>": 1, "</s>": 2, "the": 7, "cat": 8, "sat": 9, "le": 10, "chat": 11, "assis": 12, "fichier": 13}


def test_a_map_reads_ngrams_and_the_always_line_and_names_bad_lines():
    text = "\tle </s>\ncat\tchat\nthe cat\tle chat\nsat\tassis\n"
    vmap = VocabularyMap.parse(text, WORDS.get, WORDS.get, always=[2], copy_source=False)
    assert vmap.always == {10, 2} and vmap.entries[(7, 8)] == (10, 11)
    assert vmap.candidates([8, 7]) == [2, 10, 11]  # "cat the": no bigram "the cat"
    assert vmap.candidates([7, 8, 9]) == [2, 10, 11, 12]
    shared = VocabularyMap(vmap.always, vmap.entries, copy_source=True)
    assert shared.candidates([9, 13]) == [2, 9, 10, 12, 13]  # the source's own tokens too
    again = VocabularyMap.parse(vmap.dump({v: k for k, v in WORDS.items()}.get, {v: k for k, v in WORDS.items()}.get),
                                WORDS.get, WORDS.get, always=(), copy_source=False)
    assert again == vmap
    with pytest.raises(VocabularyMapError, match="line 2: target token 'chien'"):
        VocabularyMap.parse("\tle\ncat\tchien\n", WORDS.get, WORDS.get, always=(), copy_source=False)
    with pytest.raises(VocabularyMapError, match="line 1: expected"):
        VocabularyMap.parse("cat chat\n", WORDS.get, WORDS.get, always=(), copy_source=False)


def test_a_built_map_ranks_a_tokens_translation_above_words_every_sentence_has():
    pairs = [([7, 8], [10, 11]), ([7, 9], [10, 12]), ([8, 9], [11, 12, 10]), ([7], [10])]
    vmap = build_vocabulary_map(pairs, per_token=1, always_frequent=1, always=[2])
    assert vmap.entries[(8,)] == (11,) and vmap.entries[(9,)] == (12,)  # not 10, in every target
    assert vmap.always == {10, 2}


def reference_logits(head: Linear, hidden: torch.Tensor, rows) -> torch.Tensor:
    full = hidden.double() @ head.weight.double().T + (head.bias.double() if head.bias is not None else 0)
    allowed = torch.ones(len(rows), head.out_features, dtype=torch.bool)
    for row, ids in enumerate(rows):
        if ids is not None:
            allowed[row] = False
            allowed[row, list(ids)] = True
    return full.masked_fill(~(allowed if hidden.dim() == 2 else allowed[:, None]), float("-inf"))


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("tokens", [None, 3])
def test_restricted_logits_equal_the_full_heads_masked_per_row(mixed, tokens):
    torch.manual_seed(0)
    head = Linear(16, 50, bias=True).eval()
    rows = [(1, 4, 9), (2, 4, 30, 49), None if mixed else (0,)]
    restriction = VocabularyRestriction.of_rows(rows, 50, "cpu")
    assert (restriction.ids is None) == mixed  # a row without a map: every logit is computed
    hidden = torch.randn(3, 16) if tokens is None else torch.randn(3, tokens, 16)
    with torch.no_grad():
        got = restriction.logits(head, hidden)
    want = reference_logits(head, hidden, rows)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got.double()[~torch.isinf(want)], want[~torch.isinf(want)], rtol=1e-5, atol=1e-5)
    kept = restriction.select(torch.tensor([1, 1]))  # only restricted rows left: the union is computed again
    assert kept.rows == (rows[1], rows[1]) and kept.ids is not None
    if not mixed:
        assert kept.ids is restriction.ids  # a superset is kept, with its gathered weights
    joined = VocabularyRestriction.concat([kept, None], [2, 1])
    assert joined.rows == (rows[1], rows[1], None) and joined.ids is None


def sources_and_map():
    generator = torch.Generator().manual_seed(1)
    sources = [torch.randint(4, 40, (n,), generator=generator).tolist() for n in (7, 11, 5)]
    entries = {(t,): tuple(sorted({(t * 7) % 36 + 4, (t * 3) % 36 + 4})) for t in range(4, 40)}
    return sources, VocabularyMap(frozenset({2, 5, 6}), entries, copy_source=False)


@pytest.mark.parametrize("beams", [1, 3])
def test_translations_keep_to_their_sources_candidates_whatever_their_batch(beams):
    model = tiny_seq2seq()
    sources, vmap = sources_and_map()
    config = GenerationConfig(max_new_tokens=8, num_beams=beams, eos_token_id=model.config.eos_id)
    together = generate_seq2seq(model, sources, config, vocab_map=vmap)
    for source, hypotheses in zip(sources, together, strict=True):
        allowed = set(vmap.candidates(source))
        assert all(set(h.tokens) <= allowed for h in hypotheses)
        alone = generate_seq2seq(model, [source], config, vocab_map=vmap)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in hypotheses]


def test_a_map_allowing_everything_changes_nothing():
    model = tiny_seq2seq()
    sources, _ = sources_and_map()
    everything = VocabularyMap(frozenset(range(model.config.vocab_size)), {}, copy_source=False)
    config = GenerationConfig(max_new_tokens=8, num_beams=2, eos_token_id=model.config.eos_id)
    plain = generate_seq2seq(model, sources, config)
    mapped = generate_seq2seq(model, sources, config, vocab_map=everything)
    assert [[h.tokens for h in r] for r in plain] == [[h.tokens for h in r] for r in mapped]


@pytest.mark.parametrize("quantized", [Int8Linear, Bf16Linear])
@pytest.mark.parametrize("tokens", [None, 3])
def test_a_quantized_head_is_sliced_to_the_same_quantized_rows(tokens, quantized):
    """The union's rows of an int8 or bf16 head (``rows``: its int8 weights and scales, or bf16 weights, not
    quantised again from floats) give exactly the full head's logits on the allowed tokens."""
    torch.manual_seed(0)
    head = quantized.from_linear(torch.nn.Linear(16, 50, bias=True))
    rows = [(1, 4, 9), (2, 4, 30, 49)]
    restriction = VocabularyRestriction.of_rows(rows, 50, "cpu")
    hidden = torch.randn(2, 16) if tokens is None else torch.randn(2, tokens, 16)
    got, full = restriction.logits(head, hidden), head(hidden)
    for row, allowed in enumerate(rows):
        exact = 0 if quantized is Int8Linear else 1e-6  # bf16 tiles of other widths sum in another order
        torch.testing.assert_close(got[row][..., list(allowed)], full[row][..., list(allowed)], rtol=exact, atol=exact)
        assert torch.isinf(got[row]).sum() == got[row].numel() - len(allowed) * (tokens or 1)
    assert type(restriction._slices.by_head[id(head)]) is quantized
