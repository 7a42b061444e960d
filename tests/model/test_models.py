"""Model-level invariants: causality, padding, cached == uncached decoding, batched == alone."""

import pytest
import torch

from model.kv_cache import KVCache
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_classifier, tiny_seq2seq


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_future_tokens_never_change_earlier_logits(norm, positions):
    model = tiny_causal_lm(norm=norm, positions=positions).double()
    ids = random_ids(2, 10)
    changed = ids.clone()
    changed[:, 6:] = random_ids(2, 4, seed=9)
    a, b = model(ids), model(changed)
    assert (a[:, :6] - b[:, :6]).abs().max() == 0
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-6


def test_seq2seq_decoder_is_causal():
    model = tiny_seq2seq().double()
    src, tgt = random_ids(2, 6), random_ids(2, 8, seed=2)
    changed = tgt.clone()
    changed[:, 5:] = 9
    assert (model(src, tgt)[:, :5] - model(src, changed)[:, :5]).abs().max() == 0


def test_pad_tokens_never_change_non_pad_outputs(norm):
    clf = tiny_classifier(norm=norm).double()
    ids = random_ids(1, 6)
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    h1, _ = clf.encode(ids)
    h2, _ = clf.encode(padded)
    assert (h1 - h2[:, :6]).abs().max() < 1e-12
    assert (clf(ids) - clf(padded)).abs().max() < 1e-12

    s2s = tiny_seq2seq(norm=norm).double()
    tgt = random_ids(1, 4, seed=3)
    assert (s2s(ids, tgt) - s2s(padded, tgt)).abs().max() < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_cached_decoding_equals_uncached_causal_lm(norm, dtype, tol):
    model = tiny_causal_lm(norm=norm).to(dtype)
    ids = random_ids(3, 20)
    full = model(ids)
    cache = model.new_cache(3, capacity=4)  # small capacity: the cache must grow while decoding
    logits = model.prefill(ids[:, :5], torch.full((3,), 5), cache)
    assert (logits - full[:, 4]).abs().max() < tol
    for t in range(5, 20):
        logits = model.decode_step(ids[:, t], cache)
        assert (logits - full[:, t]).abs().max() < tol
    assert cache.capacity >= 20


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_cached_decoding_equals_uncached_seq2seq(norm, dtype, tol):
    model = tiny_seq2seq(norm=norm).to(dtype)
    src = random_ids(2, 7)
    src[1, 4:] = 0  # a padded source
    tgt = random_ids(2, 12, seed=5)
    tgt[:, 0] = model.config.bos_id
    full = model(src, tgt)
    logits, cache = model.start(src, capacity=3)
    assert (logits - full[:, 0]).abs().max() < tol
    for t in range(1, 12):
        logits = model.decode_step(tgt[:, t], cache)
        assert (logits - full[:, t]).abs().max() < tol


def test_ragged_prefill_equals_each_prompt_alone():
    model = tiny_causal_lm().double()
    lengths = torch.tensor([3, 9, 6])
    ids = random_ids(3, 9)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    cache = model.new_cache(3, 16)
    logits = model.prefill(ids, lengths, cache)
    nxt = random_ids(3, 1, seed=4)[:, 0]
    step = model.decode_step(nxt, cache)
    for b, n in enumerate(lengths.tolist()):
        alone = model(torch.cat([ids[b : b + 1, :n], nxt[b : b + 1, None]], dim=1))
        assert (logits[b] - alone[0, n - 1]).abs().max() < 1e-10
        assert (step[b] - alone[0, n]).abs().max() < 1e-10


def test_cache_select_and_concat_follow_rows():
    model = tiny_causal_lm().double()
    ids = random_ids(3, 6)
    caches = []
    for b in range(3):
        cache = model.new_cache(1, 8 + 4 * b)  # different capacities
        model.prefill(ids[b : b + 1, : 3 + b], torch.tensor([3 + b]), cache)
        caches.append(cache)
    joined = KVCache.concat(caches)
    joined.select(torch.tensor([2, 0, 0]))
    nxt = torch.tensor([11, 12, 13])
    out = model.decode_step(nxt, joined)
    for row, b in enumerate([2, 0, 0]):
        alone = model(torch.cat([ids[b : b + 1, : 3 + b], nxt[row].view(1, 1)], dim=1))
        assert (out[row] - alone[0, -1]).abs().max() < 1e-10


def test_seq2seq_cache_concat_with_different_source_lengths():
    model = tiny_seq2seq().double()
    sources = [random_ids(1, 4), random_ids(1, 9, seed=2)]
    starts = [model.start(src, capacity=4) for src in sources]
    joined = KVCache.concat([cache for _, cache in starts])
    tok = torch.tensor([8, 9])
    out = model.decode_step(tok, joined)
    for i, src in enumerate(sources):
        tgt = torch.tensor([[model.config.bos_id, tok[i].item()]])
        assert (out[i] - model(src, tgt)[0, -1]).abs().max() < 1e-10


def test_classifier_heads_and_pooling_shapes():
    clf = tiny_classifier()
    ids = random_ids(2, 5)
    ids[1, 3:] = 0
    mlm, order = clf.pretraining_logits(ids, torch.zeros_like(ids))
    assert mlm.shape == (2, 5, 40) and order.shape == (2, 2)
    mean = clf.embed_texts(ids, pooling="mean")
    hidden, _ = clf.encode(ids)
    assert torch.allclose(mean[1], hidden[1, :3].mean(0), atol=1e-6)
    assert torch.equal(clf.embed_texts(ids, pooling="cls"), hidden[:, 0])
    assert torch.equal(clf.embed_texts(ids, pooling="max")[1], hidden[1, :3].amax(0))
    with pytest.raises(ValueError, match="pooling"):
        clf.embed_texts(ids, pooling="sum")


def test_a_classifier_without_labels_has_no_head_and_still_embeds():
    clf = tiny_classifier(num_labels=0)
    ids = random_ids(2, 5)
    assert clf.classifier is None and not any(name.startswith("classifier.") for name in clf.state_dict())
    with pytest.raises(ValueError, match="no classification head"):
        clf(ids)
    assert clf.embed_texts(ids, pooling="max").shape == (2, 32)
