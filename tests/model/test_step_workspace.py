"""The native step's workspace (decode_step.cpp: one set of buffers per thread, reused across layers and steps):
its results survive later steps, and models or threads stepping in turn or at once get what each gets alone."""

import threading

import pytest
import torch

from model import int8_kernel, native
from model.fast_step import plan_for, run_decoder
from model.quantize import quantize_int8
from tests.model.conftest import random_ids, tiny_causal_lm
from tests.model.helpers import causal_cache

pytestmark = pytest.mark.skipif(native.kernels() is None or int8_kernel.kernel() is None,
                                reason="the C++ decode kernels or our int8 kernel do not run here")

STEPS = 6


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def _int8_lm(seed: int, **overrides):
    """A tiny int8 Llama-like model (RMSNorms, rotary positions, grouped KV heads, a gated FFN)."""
    lm = tiny_causal_lm(positions="rope", norm_type="rms", n_kv_heads=2, ffn="gated", activation="silu", **overrides)
    torch.manual_seed(seed)
    for p in lm.parameters():
        p.normal_(0, 0.3)
    quantize_int8(lm)
    assert plan_for(lm.decoder).native is not None
    return lm


class _Recorded:
    """A plan's native step that keeps each result and a copy of it taken when it was returned."""

    def __init__(self, step):
        self.step, self.results, self.copies = step, [], []

    def __getattr__(self, name):
        return getattr(self.step, name)

    def __call__(self, *args):
        out = self.step(*args)
        self.results.append(out)
        self.copies.append(out.clone())
        return out


def _stepper(model, seed: int):
    """A generator of the model's decoder outputs (3 ragged rows), one native step per next()."""
    cache = causal_cache(model, True)
    for s in range(STEPS):
        t = random_ids(cache.batch_size, 1, seed=seed + s)
        positions, mask = cache.begin_step(1)
        out = run_decoder(model.decoder, model.embed(t, positions), mask, cache, None)
        cache.end_step(1)
        yield out


def _alone(model, seed: int = 0) -> list[torch.Tensor]:
    return list(_stepper(model, seed))


def test_a_step_result_is_not_overwritten_by_the_next_steps():
    lm = _int8_lm(0)
    plan = plan_for(lm.decoder)
    recorded = _Recorded(plan.native)
    plan.native = recorded
    try:
        _alone(lm)
    finally:
        plan.native = recorded.step
    assert len(recorded.results) == STEPS
    for kept, copied in zip(recorded.results, recorded.copies, strict=True):
        assert torch.equal(kept, copied)


def test_models_stepping_in_turn_on_one_thread_get_what_each_gets_alone():
    models = [_int8_lm(0), _int8_lm(1), _int8_lm(2, d_model=48, d_ff=80, n_heads=6)]  # same shapes, and another
    expected = [_alone(m) for m in models]
    steppers = [_stepper(m, 0) for m in models]
    got = [[], [], []]
    for _ in range(STEPS):
        for i, s in enumerate(steppers):
            got[i].append(next(s))
    for g, e in zip(got, expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, e, strict=True))


def test_threads_stepping_at_once_get_what_each_gets_alone():
    models = [_int8_lm(0), _int8_lm(1)]
    expected = [_alone(m) for m in models]
    matched = [0, 0]
    start = threading.Barrier(2)

    @torch.no_grad()  # grad mode is per thread (the fixture's is the main thread's)
    def run(i: int) -> None:
        start.wait()
        for _ in range(20):  # repeated: the steps of the two threads interleave
            got = _alone(models[i])
            matched[i] += all(torch.equal(a, b) for a, b in zip(got, expected[i], strict=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert matched == [20, 20]

