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


# Per row, its run's first row (a sentence's first beam) and the positions it shares with it: runs of 4 beams, or
# runs of different widths and rows alone (the serving engine's requests side by side).
RUNS = {
    "beams 4": ([0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8], [0, 5, 37, 16, 0, 0, 20, 36, 0, 33, 1, 17]),
    "mixed": ([0, 0, 0, 3, 4, 4, 6, 7, 7, 7, 7, 11], [0, 30, 12, 0, 0, 37, 0, 0, 3, 36, 19, 0]),
}


@pytest.mark.parametrize("runs", RUNS)
@pytest.mark.parametrize("mask", ["none", "bool", "bias"])
@pytest.mark.parametrize("dh", [64, 24])
def test_beams_read_their_shared_positions_from_the_first_beam_with_the_same_floats(threads, runs, mask, dh):
    g = torch.Generator().manual_seed(dh)
    heads, t = 2, 37
    lead, shared = (torch.tensor(x) for x in RUNS[runs])
    b = shared.numel()
    k, v = (torch.randn(b, heads, 48, dh, generator=g) for _ in range(2))  # cache buffers: capacity 48, t in use
    for row, (first, n) in enumerate(zip(lead.tolist(), shared.tolist(), strict=True)):  # shared: first's copies
        k[row, :, :n], v[row, :, :n] = k[first, :, :n], v[first, :, :n]
    q = torch.randn(b, heads, 1, dh, generator=g)
    m = {"none": None, "bool": torch.rand(b, 1, 1, t, generator=g) > 0.2,
         "bias": torch.randn(b, heads, 1, t, generator=g)}[mask]
    kernel = native.kernels()

    def attend(beams):
        lead_rows, shared_positions = beams if beams is not None else (None, None)
        return kernel.decode_attention(q, k[:, :, :t], v[:, :, :t], m, beam_lead=lead_rows,
                                       beam_shared=shared_positions)

    own, once = attend(None), attend((lead, shared))
    assert torch.equal(once, own)
    row = next(r for r, (first, n) in enumerate(zip(lead.tolist(), shared.tolist(), strict=True)) if first != r and n)
    k[row, :, :1] += 1.0  # a beam's own copy of its shared keys: no longer read
    assert torch.equal(attend((lead, shared)), once) and not torch.equal(attend(None)[row], own[row])


@pytest.mark.parametrize(("lead", "shared", "message"), [
    ([0, 0, 0, 0], [0, 6, 0, 0], "beam_shared outside"),
    ([0, 0, 0, 0], [0, -1, 0, 0], "beam_shared outside"),
    ([0, 0, 0], [0, 1, 0], "int64 \\(B,\\)"),
    ([0, 0, 0, 0], [0.0, 1.0, 0.0, 0.0], "int64 \\(B,\\)"),
    ([0, 0, 2, 0], [0, 1, 0, 1], "each run's first row"),  # a run of rows 0, 1 and 3
    ([1, 1, 2, 3], [0, 1, 0, 1], "each run's first row"),  # a lead after its row
    ([0, 0, 0, 0], None, "together"),
])
def test_bad_beam_runs_raise(lead, shared, message):
    q, k = torch.randn(4, 2, 1, 16), torch.randn(4, 2, 5, 16)
    with pytest.raises(RuntimeError, match=message):
        native.kernels().decode_attention(q, k, k, None, beam_lead=torch.tensor(lead),
                                          beam_shared=None if shared is None else torch.tensor(shared))


def _generate(family: str, int8: bool, share: bool, monkeypatch, ragged: bool = False) -> tuple[list, int]:
    """Beam 4 over three inputs (ragged: prompts of 9, 5 and 7 tokens); the most generated tokens' positions any beam
    read from its first beam."""
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
            led = cache.beam_lead != torch.arange(cache.batch_size)  # rows reading their run's first row
            before = cache.lengths - (generated - 1)  # each row's positions ahead of its generated tokens
            most = max(most, int((cache.beam_shared - before)[led].max()))

    monkeypatch.setattr(KVCache, "share_beam_prefix", recorded)
    config = GenerationConfig(strategy="beam", num_beams=4, max_new_tokens=14, min_new_tokens=14)
    inputs = [ids[:n] for ids, n in zip(random_ids(3, 9).tolist(), (9, 5, 7) if ragged else (9, 9, 9), strict=True)]
    run = generate_seq2seq if family == "seq2seq" else generate_causal
    return [[(h.tokens, h.score) for h in hyps] for hyps in run(model, inputs, config)], most


@pytest.mark.parametrize(("family", "ragged"), [("seq2seq", False), ("causal_lm", False), ("causal_lm", True)],
                         ids=["seq2seq", "causal_lm", "causal_lm-ragged"])
@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_beam_search_reading_shared_positions_once_gives_the_same_hypotheses(family, ragged, int8, monkeypatch):
    shared, most = _generate(family, int8, True, monkeypatch, ragged)
    own, none = _generate(family, int8, False, monkeypatch, ragged)
    assert shared == own
    assert most > 0 and none == 0  # beams did read generated tokens' positions from their first beam
