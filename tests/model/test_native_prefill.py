"""A short prompt's prefill on the C++ step (model.fast_step.run_prefill): the logits and KV cache of
LayerStack.forward, for uniform and right-padded rows, float32 and int8; a longer prompt takes LayerStack.forward."""

from __future__ import annotations

import copy

import pytest
import torch

from model import causal_lm, int8_kernel, native
from model.fast_step import plan_for
from model.hf import load_hf_model
from model.quantize import quantize
from tests.model.test_hf_llama import save_llama
from tests.model.test_native_step import _Watched

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ decode kernels do not run here")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = save_llama(tmp_path_factory.mktemp("llama"), seed=5, num_key_value_heads=2,
                           max_position_embeddings=160)
    return load_hf_model(directory)[0].eval()


def _prefill(model, ids: torch.Tensor, lengths: torch.Tensor, native_path: bool):
    """(logits after each prompt, the cache's keys and values) of one prefill, on the C++ step or LayerStack.forward."""
    original = causal_lm.run_prefill
    if not native_path:
        causal_lm.run_prefill = lambda stack, x, mask, cache: stack(x, mask, cache=cache)[0]
    try:
        cache = model.new_cache(ids.shape[0], ids.shape[1] + 4)
        logits = model.prefill(ids, lengths, cache)
    finally:
        causal_lm.run_prefill = original
    return logits, cache


@pytest.mark.parametrize("precision", ["float32", "int8"])
@pytest.mark.parametrize("ragged", [False, True])
def test_short_prompts_prefill_on_the_c_step_as_the_pytorch_path_does(llama, precision, ragged):
    if precision == "int8" and int8_kernel.kernel() is None:
        pytest.skip("our int8 kernel does not run here")
    model = llama if precision == "float32" else quantize(copy.deepcopy(llama), "int8")
    length = kernels.MAX_STEP_TOKENS
    ids = torch.randint(3, 90, (3, length), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([length, length - 9, length - 30]) if ragged else torch.full((3,), length)
    plan = plan_for(model.decoder)
    plan.native = watched = _Watched(plan.native)
    prefill = watched.native.prefill
    calls = []
    watched.native.prefill = lambda *args: calls.append(1) or prefill(*args)
    with torch.inference_mode():
        fast, fast_cache = _prefill(model, ids, lengths, native_path=True)
        slow, slow_cache = _prefill(model, ids, lengths, native_path=False)
    del watched.native.prefill
    assert calls == [1] and watched.calls == 0  # one prefill on the C++ step, counted apart from decoding steps
    # int8: the same int8 layers on both paths; only float sums in another order ahead of a quantisation differ
    tolerance = 1e-4 if precision == "float32" else 0.05 * slow.abs().max().item()
    assert (fast - slow).abs().max() < tolerance
    for layer in range(len(model.decoder.layers)):
        for row, n in enumerate(lengths.tolist()):  # the prompt's own positions (past them: padding's keys)
            for mine, theirs in ((fast_cache.keys, slow_cache.keys), (fast_cache.values, slow_cache.values)):
                assert (mine[layer][row, :, :n] - theirs[layer][row, :, :n]).abs().max() < max(tolerance, 1e-5)


def test_a_prompt_beyond_the_step_takes_the_pytorch_path(llama):
    plan = plan_for(llama.decoder)
    plan.native = _Watched(plan.native, fail=True)
    prefill = plan.native.native.prefill
    plan.native.native.prefill = lambda *args: pytest.fail("a long prompt ran on the C++ step")
    try:
        ids = torch.randint(3, 90, (1, kernels.MAX_STEP_TOKENS + 1), generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            fast, _ = _prefill(llama, ids, torch.tensor([ids.shape[1]]), native_path=True)
            slow, _ = _prefill(llama, ids, torch.tensor([ids.shape[1]]), native_path=False)
    finally:
        plan.native.native.prefill = prefill
    assert torch.equal(fast, slow)
