"""A sentence's beams read the self-attention positions they share once (decode_attention's beam_shared), with the
same floats as each beam reading its own copy."""

import pytest
import torch

from model import native
from model.generation import generate_causal, generate_seq2seq
from model.generation_config import GenerationConfig
from model.kv_cache import KVCache
from model.quantize import quantize_int8
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_seq2seq

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="the C++ decode kernels do not run here")


@pytest.mark.parametrize("mask", ["none", "bool", "bias"])
@pytest.mark.parametrize("dh", [64, 24])
def test_beams_read_their_shared_positions_from_the_first_beam_with_the_same_floats(threads, mask, dh):
    g = torch.Generator().manual_seed(dh)
    beams, heads, t = 4, 2, 37
    shared = torch.tensor([0, 5, 37, 16, 0, 0, 20, 36, 0, 33, 1, 17])  # per row; a sentence's first beam's unused
    b = shared.numel()
    k, v = (torch.randn(b, heads, 48, dh, generator=g) for _ in range(2))  # cache buffers: capacity 48, t in use
    for row, n in enumerate(shared.tolist()):  # each beam's shared positions: copies of its first beam's
        lead = row - row % beams
        k[row, :, :n], v[row, :, :n] = k[lead, :, :n], v[lead, :, :n]
    q = torch.randn(b, heads, 1, dh, generator=g)
    m = {"none": None, "bool": torch.rand(b, 1, 1, t, generator=g) > 0.2,
         "bias": torch.randn(b, heads, 1, t, generator=g)}[mask]
    kernel = native.kernels()

    def attend(beam_shared):
        return kernel.decode_attention(q, k[:, :, :t], v[:, :, :t], m, beam_group=beams, beam_shared=beam_shared)

    own, once = attend(None), attend(shared)
    assert torch.equal(once, own)
    k[1, :, :5] += 1.0  # a beam's own copy of its shared keys: no longer read
    assert torch.equal(attend(shared), once) and not torch.equal(attend(None)[1], own[1])


def test_bad_shared_counts_raise():
    q, k = torch.randn(4, 2, 1, 16), torch.randn(4, 2, 5, 16)
    kernel = native.kernels()
    for shared in (torch.tensor([0, 6, 0, 0]), torch.tensor([0, -1, 0, 0]), torch.tensor([0, 1, 0]),
                   torch.tensor([0.0, 1.0, 0.0, 0.0])):
        with pytest.raises(RuntimeError, match="beam_shared"):
            kernel.decode_attention(q, k, k, None, beam_group=2, beam_shared=shared)


def _generate(family: str, int8: bool, share: bool, monkeypatch) -> tuple[list, int]:
    """Beam 4 over three inputs; the largest position count any beam read from its first beam."""
    model = tiny_seq2seq() if family == "seq2seq" else tiny_causal_lm()
    if int8:
        quantize_int8(model)
    most = 0
    real = KVCache.share_beam_prefix

    def recorded(cache, shared, generated):
        nonlocal most
        if share:
            real(cache, shared, generated)
        if cache.beam_shared is not None:
            most = max(most, int(cache.beam_shared.view(-1, cache.beam_group)[:, 1:].max()))

    monkeypatch.setattr(KVCache, "share_beam_prefix", recorded)
    config = GenerationConfig(strategy="beam", num_beams=4, max_new_tokens=14, min_new_tokens=14)
    inputs = random_ids(3, 9).tolist()
    run = generate_seq2seq if family == "seq2seq" else generate_causal
    return [[(h.tokens, h.score) for h in hyps] for hyps in run(model, inputs, config)], most


@pytest.mark.parametrize("family", ["seq2seq", "causal_lm"])
@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_beam_search_reading_shared_positions_once_gives_the_same_hypotheses(family, int8, monkeypatch):
    shared, most = _generate(family, int8, True, monkeypatch)
    own, none = _generate(family, int8, False, monkeypatch)
    assert shared == own
    assert most > (1 if family == "seq2seq" else 9) and none == 0  # beams did share generated tokens' positions
