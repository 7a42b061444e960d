"""Continuing a translation from a target prefix: the decoder fed BOS and the prefix in one step gives the logits of a
teacher-forced forward, and greedy decoding from its own first tokens ends as it did from scratch."""

from __future__ import annotations

import torch

from model.decoding import GenerationConfig
from model.generation import generate_seq2seq
from tests.model.conftest import tiny_seq2seq

SOURCES = [[9, 10, 11, 12, 13], [14, 15, 16], [17, 18, 19, 20]]
TARGETS = [[21, 22, 23], [], [24]]  # ragged, one row without a prefix


def test_the_prefix_step_gives_the_teacher_forced_logits():
    model = tiny_seq2seq()
    src = torch.tensor([s + [0] * (5 - len(s)) for s in SOURCES])
    with torch.no_grad():
        logits, cache = model.start(src, capacity=8, targets=TARGETS)
        for row, (source, target) in enumerate(zip(SOURCES, TARGETS, strict=True)):
            want = model(torch.tensor([source]), torch.tensor([[model.config.bos_id, *target]]))[0, -1]
            torch.testing.assert_close(logits[row], want, rtol=1e-5, atol=1e-5)
        assert cache.lengths.tolist() == [1 + len(t) for t in TARGETS]
        # The next step continues each row at its own position.
        nxt = model.decode_step(torch.tensor([25, 26, 27]), cache)
        for row, (source, target) in enumerate(zip(SOURCES, TARGETS, strict=True)):
            tgt = torch.tensor([[model.config.bos_id, *target, 25 + row]])
            torch.testing.assert_close(nxt[row], model(torch.tensor([source]), tgt)[0, -1], rtol=1e-5, atol=1e-5)


def test_greedy_from_its_own_first_tokens_ends_as_from_scratch():
    model = tiny_seq2seq(vocab_size=60)
    # No token twice (the n-gram rule sees the target prefix too): a random model's greedy output varies.
    rule = dict(eos_token_id=2, no_repeat_ngram_size=1)
    whole = [h[0] for h in generate_seq2seq(model, SOURCES, GenerationConfig(max_new_tokens=12, **rule))]
    assert all(len(set(h.tokens)) == len(h.tokens) > 3 for h in whole)
    rest = generate_seq2seq(model, SOURCES, GenerationConfig(max_new_tokens=9, **rule),
                            targets=[h.tokens[:3] for h in whole])
    for h, r in zip(whole, rest, strict=True):
        assert r[0].tokens == h.tokens[3:] and r[0].finish_reason == h.finish_reason
