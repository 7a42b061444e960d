"""The C++ decoding step (model/kernels/decode_step.cpp) computes what the decode plan's Python replay computes."""

import copy

import pytest
import torch

from model import native
from model.fast_step import plan_for, run_decoder
from model.layout import use_input_major_weights
from model.lora import (
    LoRAConfig,
    add_adapter,
    delete_adapter,
    merge_adapter,
    unmerge_adapter,
    use_adapters,
)
from model.lora_layers import LoRALinear
from model.quantize import quantize_int8
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_seq2seq
from tests.model.helpers import causal_cache, decode, seq2seq_cache

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="the C++ decode kernels do not run here")


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


class _Watched:
    """A plan's native step that counts its calls (or fails them), otherwise the step itself."""

    def __init__(self, native, fail: bool = False):
        self.native, self.fail, self.calls = native, fail, 0

    def __getattr__(self, name):
        return getattr(self.native, name)

    def __call__(self, *args):
        if self.fail:
            pytest.fail("the native step ran where it must not")
        self.calls += 1
        return self.native(*args)


def _native_and_python(model, cache, steps: int = 4):
    """Decoder outputs of ``steps`` one-token steps through the C++ step and through the Python replay,
    each from its own copy of ``cache``, with the caches they leave behind."""
    tokens = [random_ids(cache.batch_size, 1, seed=s)[:, 0] for s in range(steps)]
    plan = plan_for(model.decoder)
    native = plan.native
    assert native is not None
    counted = _Watched(native)
    results = {}
    for name in ("native", "python"):
        plan.native = counted if name == "native" else None
        copied = copy.deepcopy(cache)
        results[name] = decode(model, run_decoder, tokens, copied), copied
    plan.native = native
    assert counted.calls == steps  # the native step really ran
    return results["native"], results["python"]


def _assert_equal(model, cache, tol=1e-6):
    """Outputs and caches agree to ``tol``, absolute near zero and relative elsewhere: float32 sums taken in
    another order differ by a few ulps of the sum, which grow with its size (1.5e-5 at 14 seen on Zen 4)."""
    (native, native_cache), (python, python_cache) = _native_and_python(model, cache)
    for a, b in zip(native, python, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    for a, b in zip(native_cache.keys + native_cache.values, python_cache.keys + python_cache.values, strict=True):
        torch.testing.assert_close(a[:, :, : native_cache.max_length], b[:, :, : python_cache.max_length], atol=tol,
                                   rtol=tol)


def _verification_step(model, cache, tokens: int, native: bool) -> torch.Tensor:
    """One step of ``tokens`` tokens per row (a speculative verification) through the decode plan, natively or
    through the Python replay, on a copy of ``cache``."""
    plan = plan_for(model.decoder)
    kept, counted = plan.native, _Watched(plan.native)
    plan.native = counted if native else None
    try:
        copied = copy.deepcopy(cache)
        ids = random_ids(cache.batch_size, tokens, seed=7)
        causal = hasattr(model, "embed")
        embed, memory_mask = (model.embed, None) if causal else (model.tgt_embed, copied.cross.mask)
        positions, mask = copied.begin_step(tokens)
        out = run_decoder(model.decoder, embed(ids, positions), mask, copied, memory_mask)
    finally:
        plan.native = kept
    assert counted.calls == (1 if native else 0)
    return out


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
@pytest.mark.parametrize("adapter", [None, ["x", None, "y"]], ids=["base", "per-row-adapters"])
def test_native_step_over_several_tokens_per_row_equals_the_python_replay(ragged, adapter):
    """A verification step (the fed token and a 4-token draft per row) runs natively: causal masks among the new
    tokens, ragged rows, per-row LoRA deltas repeated for each token of a row."""
    lm = _with_adapters(tiny_causal_lm())
    cache = causal_cache(lm, ragged)
    with use_adapters(lm, adapter):
        native = _verification_step(lm, cache, 5, native=True)
        python = _verification_step(lm, cache, 5, native=False)
    torch.testing.assert_close(native, python, atol=1e-5, rtol=1e-5)
    mt = tiny_seq2seq()
    mt_cache = seq2seq_cache(mt, ragged)
    torch.testing.assert_close(_verification_step(mt, mt_cache, 3, native=True),
                               _verification_step(mt, mt_cache, 3, native=False), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_native_step_equals_the_python_replay(norm, ragged, vector_bits):
    """Pre-/post-LN, GELU/ReLU, uniform and ragged caches (per-row writes, masks), padded sources."""
    lm = tiny_causal_lm(norm=norm, activation="gelu_tanh")
    _assert_equal(lm, causal_cache(lm, ragged))
    mt = tiny_seq2seq(norm=norm, activation="gelu")
    _assert_equal(mt, seq2seq_cache(mt, ragged))


def test_native_step_runs_silu():
    """OPUS-MT's swish: elementwise.cpp's SiLU in the C++ step."""
    mt = tiny_seq2seq(norm="post", activation="silu")
    _assert_equal(mt, seq2seq_cache(mt, True))


def test_native_step_over_input_major_weights_equals_the_python_replay():
    """The service's weight layout: the native step's projections of up to 4 rows run on the few-rows GEMV
    (the same sums as the replay's F.linear, in another order)."""
    lm = tiny_causal_lm()
    use_input_major_weights(lm)
    _assert_equal(lm, causal_cache(lm, True), tol=1e-5)
    mt = tiny_seq2seq()
    use_input_major_weights(mt)
    _assert_equal(mt, seq2seq_cache(mt, False), tol=1e-5)


def test_native_step_follows_weights_changed_in_place_or_re_laid_between_steps():
    """The step keeps its packed copies between steps; a weight changed in place (its version) or re-laid (its
    data) since is packed again, so the step keeps computing what the replay does."""
    lm = tiny_causal_lm()
    cache = causal_cache(lm, False)
    _assert_equal(lm, cache)
    fc1 = lm.decoder.layers[0].ffn.fc1.weight
    before = plan_for(lm.decoder).native.panels(native.kernels(), 2)
    with torch.no_grad():
        fc1.mul_(3.0)
    _assert_equal(lm, cache)
    after = plan_for(lm.decoder).native.panels(native.kernels(), 2)
    assert any(a is not b for a, b in zip(before, after, strict=True))
    use_input_major_weights(lm)  # new data for every weight, the same Parameters
    _assert_equal(lm, cache, tol=1e-5)


def test_native_step_with_beams_sharing_their_source():
    mt = tiny_seq2seq()
    cache = seq2seq_cache(mt, True)
    cache.select(torch.arange(3).repeat_interleave(3))
    assert cache.cross.group_size == 3
    _assert_equal(mt, cache)


def test_native_step_runs_our_int8_layers_and_their_fused_projection():
    from model import int8_kernel

    if int8_kernel.kernel() is None:
        pytest.skip("our int8 kernel does not run here")
    mt = tiny_seq2seq()
    quantize_int8(mt)
    assert all(layer.self_attn.fused for layer in mt.decoder.layers)
    _assert_equal(mt, seq2seq_cache(mt, False))
    assert plan_for(mt.decoder).native.panels(native.kernels(), 64) == []  # no float32 weight: no panels passed


def _with_adapters(model, targets=("q_proj", "fc2")):
    """``model`` with adapters "x" (r 2) and "y" (r 3) on ``targets``, both changing the outputs."""
    add_adapter(model, "x", LoRAConfig(r=2, target_modules=targets), seed=0)
    add_adapter(model, "y", LoRAConfig(r=3, lora_alpha=6, target_modules=targets), seed=1)
    for module in model.modules():  # B starts at zero: make the adapters change the outputs
        if type(module) is LoRALinear:
            for b in module.lora_B.values():
                b.weight.normal_(0, 0.5)
    return model


def test_steps_selecting_no_adapter_run_natively_on_the_bases():
    lm = _with_adapters(tiny_causal_lm())
    assert plan_for(lm.decoder).native.adapted
    _assert_equal(lm, causal_cache(lm, True))  # no adapter selected: the bases alone
    merge_adapter(lm, "x")
    with use_adapters(lm, "x"):  # the merged adapter selected: in the bases already
        _assert_equal(lm, causal_cache(lm, False))


SELECTIONS = {"all-rows": "x", "per-row": ["x", None, "y"], "per-row-pair": ["y", "y", "x"]}


@pytest.mark.parametrize("selection", list(SELECTIONS.values()), ids=list(SELECTIONS))
@pytest.mark.parametrize("merged", [None, "x"], ids=["unmerged", "x-merged"])
def test_native_step_adds_the_adapter_deltas_of_the_python_replay(selection, merged):
    """Every row's own adapter (the merged one subtracted where a row selects another), ragged caches too."""
    lm = _with_adapters(tiny_causal_lm())
    if merged:
        merge_adapter(lm, merged)
    cache = causal_cache(lm, False)
    tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(2)]
    base = decode(lm, run_decoder, tokens, copy.deepcopy(cache))
    with use_adapters(lm, selection):
        adapted = decode(lm, run_decoder, tokens, copy.deepcopy(cache))
        _assert_equal(lm, cache, tol=1e-5)
        _assert_equal(lm, causal_cache(lm, True), tol=1e-5)
    assert (adapted[-1] - base[-1]).abs().max() > 1e-3  # the deltas were added


def _assert_native_equals_the_loop(model, cache, tokens):
    """The native step (deltas kept by LoRALinear.row_deltas between steps) against the per-group loop that
    autograd mode takes (nothing stacked, nothing kept)."""
    native = decode(model, run_decoder, tokens, copy.deepcopy(cache))
    with torch.enable_grad():
        loop = decode(model, run_decoder, tokens, copy.deepcopy(cache))
    torch.testing.assert_close(native[-1], loop[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("selection", list(SELECTIONS.values())[:2], ids=list(SELECTIONS)[:2])
def test_deltas_kept_between_steps_follow_in_place_changes_and_new_adapters(selection):
    lm = _with_adapters(tiny_causal_lm())
    cache = causal_cache(lm, False)
    tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(2)]
    with use_adapters(lm, selection):  # one routing object throughout
        _assert_native_equals_the_loop(lm, cache, tokens)
        for module in lm.modules():
            if type(module) is LoRALinear:
                module.lora_B["x"].weight.mul_(3.0)  # in place: the same Parameter, a new version
        _assert_native_equals_the_loop(lm, cache, tokens)
        add_adapter(lm, "z", LoRAConfig(r=4, target_modules=("q_proj", "fc2")), seed=2)
        _assert_native_equals_the_loop(lm, cache, tokens)
        merge_adapter(lm, "y")
        _assert_native_equals_the_loop(lm, cache, tokens)
        unmerge_adapter(lm)
        _assert_native_equals_the_loop(lm, cache, tokens)


def test_an_adapter_removed_and_added_again_under_its_name_is_not_taken_for_the_old_one():
    """Fresh tensors start at version 0 again: the stacked adapters must still be rebuilt."""
    lm = _with_adapters(tiny_causal_lm())
    cache = causal_cache(lm, False)
    tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(2)]
    with use_adapters(lm, ["x", None, "y"]):
        _assert_native_equals_the_loop(lm, cache, tokens)
    delete_adapter(lm, "y")  # the last adapter: added again, it takes the same place among them
    add_adapter(lm, "y", LoRAConfig(r=3, lora_alpha=6, target_modules=("q_proj", "fc2")), seed=7)
    for module in lm.modules():
        if type(module) is LoRALinear:
            module.lora_B["y"].weight.normal_(0, 0.5)
    with use_adapters(lm, ["x", None, "y"]):
        _assert_native_equals_the_loop(lm, cache, tokens)


def test_native_step_adds_deltas_on_every_projection_of_a_seq2seq_decoder():
    mt = _with_adapters(tiny_seq2seq(), targets=("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"))
    use_input_major_weights(mt)
    cache = seq2seq_cache(mt, True)
    cache.select(torch.arange(3).repeat_interleave(2))  # beams sharing their source
    with use_adapters(mt, ["x", "x", None, "y", "y", "x"]):
        _assert_equal(mt, cache, tol=1e-5)


def test_steps_the_native_step_cannot_add_take_the_python_replay(monkeypatch):
    lm = _with_adapters(tiny_causal_lm())
    cache = causal_cache(lm, False)
    plan = plan_for(lm.decoder)
    monkeypatch.setattr(plan, "native", _Watched(plan.native, fail=True))
    tokens = [random_ids(3, 1)[:, 0]]
    with use_adapters(lm, "x"):
        lm.train()  # training mode: the replay's LoRALinear (dropout)
        decode(lm, run_decoder, tokens, copy.deepcopy(cache))
        lm.eval()
    layer = next(m for m in lm.decoder.modules() if type(m) is LoRALinear)
    layer.lora_A["y"].weight[0, 0] = float("nan")
    with use_adapters(lm, ["x", None, "y"]):  # mixed rows over non-finite weights: the per-group loop
        outputs = decode(lm, run_decoder, tokens, copy.deepcopy(cache))
    assert outputs[-1][:2].isfinite().all()  # the NaN stays in the row selecting "y"


def test_one_adapter_for_every_row_needs_only_its_own_weights_finite():
    lm = _with_adapters(tiny_causal_lm())
    layer = next(m for m in lm.decoder.modules() if type(m) is LoRALinear)
    layer.lora_A["y"].weight[0, 0] = float("nan")
    with use_adapters(lm, "x"):
        _assert_equal(lm, causal_cache(lm, False), tol=1e-5)


def test_what_the_native_step_does_not_run_takes_the_python_replay(monkeypatch, kernel_options):
    fbgemm = tiny_seq2seq()
    kernel_options(int8_kernel="fbgemm")
    quantize_int8(fbgemm)
    assert plan_for(fbgemm.decoder).native is None
    double = tiny_causal_lm().double()
    assert plan_for(double.decoder).native is None
    lm = tiny_causal_lm()
    cache = causal_cache(lm, False)
    plan = plan_for(lm.decoder)
    monkeypatch.setattr(plan, "native", _Watched(plan.native, fail=True))
    with torch.enable_grad():
        decode(lm, run_decoder, [random_ids(3, 1)[:, 0]], cache)  # autograd on: the Python replay


def test_a_decoder_stack_whose_lists_disagree_is_refused():
    """The bound stack checks its per-layer lists once, where the plan builds it."""
    kernels = native.kernels()
    projections = plan_for(tiny_causal_lm().decoder).native.projections
    with pytest.raises(RuntimeError, match="per-layer argument counts disagree"):
        kernels.DecoderStack(projections=projections[:-1], norms=[], eps=[], heads=4, pre_norm=True,
                             activation=kernels.Activation.gelu)
