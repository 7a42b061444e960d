"""T5 v1.0, T5 v1.1 (Flan-T5's layout) and mT5 on the fast CPU path (model/fast_step.py, model/kernels): the relative
position bias as a float self-attention mask (added to the scores by decode_attention.cpp), the unscaled q.k of self-
and cross-attention, RMSNorms and the gated-GELU FFN, on the C++ decoding step and the C++ encoder against our PyTorch
path (LayerStack.forward, itself equal to transformers: tests/model/test_hf_t5.py, whose random directories these
are), float32 and int8, rows at different positions, verification steps and a restricted vocabulary.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from model import int8_kernel, native
from model.fast_step import plan_for, run_decoder
from model.hf import load_hf_model
from model.lora import LoRAConfig, add_adapter, use_adapters
from model.lora_layers import LoRALinear
from model.native_support import unsupported
from model.quantize import quantize
from model.restricted_vocab import VocabularyRestriction
from tests.hf_compare import ATOL
from tests.model.helpers import decode
from tests.model.hf_t5 import EOS, PAD, SOURCES, VARIANTS, VOCAB, padded_sources, save_t5
from tests.model.test_decoders_native import INT8_LOGIT_TOL
from tests.model.test_fast_step import general
from tests.model.test_native_step import _Watched

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ decode kernels do not run here")

PREFIXES = [[(7 * i + j) % (VOCAB - 2) + 2 for j in range(3 + 4 * i)] for i in range(len(SOURCES))]  # 3..19 tokens
SHORT = torch.tensor([[5, 17, 33, 9, 12, EOS], [7, EOS, PAD, PAD, PAD, PAD], [70, 3, 3, 12, 60, EOS]])  # <= 16 tokens


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module", params=list(VARIANTS))
def t5(request, tmp_path_factory):
    model, config = load_hf_model(save_t5(tmp_path_factory.mktemp("t5") / request.param, request.param, seed=3,
                                          eos_boost=2.5))
    assert unsupported(config) == [] and model.decoder.native and model.encoder.native
    return model


class _Counting:
    """A bound C++ stack counting its encoder forwards, otherwise the stack itself."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def __getattr__(self, name):
        return getattr(self.stack, name)

    def encode(self, *args):
        self.calls += 1
        return self.stack.encode(*args)


def _counting(stack) -> _Watched:
    """The stack's plan with its C++ step counting its calls."""
    plan = plan_for(stack)
    assert plan.native is not None  # the C++ step binds these blocks
    plan.native = _Watched(plan.native)
    return plan.native


def _both_paths(model, step) -> tuple[torch.Tensor, torch.Tensor]:
    """``step(model)`` through the plan (the C++ step) and through LayerStack.forward, each from the same state."""
    native_out = step(model)
    model.decoder.native = False
    try:
        python_out = step(model)
    finally:
        model.decoder.native = True
    return native_out, python_out


def _assert_steps_agree(model, tolerance: float = ATOL) -> None:
    """Rows at different positions (target prefixes of 3 to 19 tokens), then four one-token steps, a verification
    step of three tokens and a step restricted to a few target ids per row: the C++ step's logits against
    LayerStack.forward's (the plan takes 2 * 4 + 1 + 1 steps)."""
    src, _ = padded_sources()
    logits, cache = model.start(src, capacity=8, targets=PREFIXES)
    for _ in range(4):
        nxt = logits.argmax(-1)
        fast, slow = _both_paths(model, lambda m: m.decode_step(nxt, copy.deepcopy(cache)))  # noqa: B023
        assert (fast - slow).abs().max() < tolerance
        logits = model.decode_step(nxt, cache)
    draft = torch.randint(2, VOCAB, (len(SOURCES), 3), generator=torch.Generator().manual_seed(1))
    fast, slow = _both_paths(model, lambda m: m.verify_step(draft, copy.deepcopy(cache)))
    assert (fast - slow).abs().max() < tolerance
    rows = [sorted({EOS, 4 + i, 30 + 2 * i, 61}) for i in range(len(SOURCES))]
    restriction = VocabularyRestriction.of_rows(rows, VOCAB, "cpu")
    nxt = logits.argmax(-1)
    fast, slow = _both_paths(model, lambda m: m.decode_step(nxt, copy.deepcopy(cache), restriction))
    assert torch.equal(fast.isfinite(), slow.isfinite()) and int(fast.isfinite().sum()) == sum(map(len, rows))
    assert (fast - slow)[fast.isfinite()].abs().max() < tolerance


@pytest.mark.parametrize("shape", [(3, 4, 1), (3, 4, 3), (1, 4, 1)], ids=["per-row", "queries", "broadcast"])
def test_the_attention_kernel_adds_a_float_mask_as_sdpa_does(shape):
    """A float mask (T5's bias, masked keys at the lowest float; a permuted view, as RelativePositionBias makes it)
    added to the scores, broadcast over rows: SDPA's output."""
    g = torch.Generator().manual_seed(0)
    rows, heads, queries = shape
    q = torch.randn(3, heads, queries, 12, generator=g)
    k, v = torch.randn(3, heads, 9, 12, generator=g), torch.randn(3, heads, 9, 12, generator=g)
    bias = torch.randn(rows, queries, 9, heads, generator=g).permute(0, 3, 1, 2)  # (B|1, H, t, K), not contiguous
    keep = torch.rand(rows, 1, queries, 9, generator=g) > 0.3
    keep[..., 0] = True
    mask = torch.where(keep, bias, torch.finfo(bias.dtype).min)
    got = kernels.decode_attention(q, k, v, mask)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-5)


def test_the_c_step_computes_what_the_pytorch_path_does(t5):
    """Decoding, verification and restricted steps of rows at different positions (past the far bucket): the C++
    step, which really runs, against LayerStack.forward."""
    counted = _counting(t5.decoder)
    assert counted.calls == 0
    _assert_steps_agree(t5)
    assert counted.calls == 2 * 4 + 1 + 1


def _assert_encoder_agrees(t5) -> None:
    """Short padded sources through the C++ encoder (the bidirectional bias as a float mask): the PyTorch stack's
    memory."""
    plan = plan_for(t5.encoder)
    counted = plan.native.stack = _Counting(plan.native.stack)
    memory, _, _ = t5.encode(SHORT)
    assert counted.calls == 1
    t5.encoder.native = False
    try:
        expected, _, _ = t5.encode(SHORT)
    finally:
        t5.encoder.native = True
    real = SHORT != PAD
    assert (memory - expected)[real].abs().max() < ATOL


def test_the_c_encoder_computes_what_the_pytorch_path_does(t5):
    _assert_encoder_agrees(t5)


def test_the_python_replay_computes_what_the_pytorch_path_does_in_float64(t5):
    """The decode plan without the C++ step (float64): the bias mask made once per step, the scaled cross-attention
    queries, to float64 rounding, over rows at different positions."""
    model = copy.deepcopy(t5).double()
    assert plan_for(model.decoder).native is None
    src, _ = padded_sources()
    _, cache = model.start(src, capacity=8, targets=PREFIXES)
    tokens = [torch.randint(2, VOCAB, (len(SOURCES),), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    fast = decode(model, run_decoder, tokens, copy.deepcopy(cache))
    slow = decode(model, general, tokens, copy.deepcopy(cache))
    for f, s in zip(fast, slow, strict=True):
        torch.testing.assert_close(f, s, rtol=0, atol=1e-12)


def test_int8_t5_takes_the_c_step(t5):
    """int8 projections (the fused q/k/v): close to float32, and the C++ step and encoder compute what the PyTorch
    path computes with the same int8 layers."""
    if int8_kernel.kernel() is None:
        pytest.skip("our int8 kernel does not run here")
    model = quantize(copy.deepcopy(t5), "int8")
    assert model.decoder.native and model.decoder.layers[0].self_attn.fused
    src, _ = padded_sources()
    tgt = torch.tensor([[PAD, *PREFIXES[2]]])
    want = t5(src[2:3], tgt)
    assert (model(src[2:3], tgt) - want).abs().max() < INT8_LOGIT_TOL * want.abs().max()
    counted = _counting(model.decoder)
    _assert_steps_agree(model)
    assert counted.calls == 2 * 4 + 1 + 1
    _assert_encoder_agrees(model)


def test_per_row_lora_adapters_take_the_c_step(t5):
    """Adapters on every projection (self- and cross-attention, the FFN), one per row or none: the C++ step adds the
    deltas before cross-attention's query scale, as the PyTorch path does."""
    model = copy.deepcopy(t5)
    targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "up", "fc2")
    add_adapter(model, "x", LoRAConfig(r=2, target_modules=targets), seed=0)
    add_adapter(model, "y", LoRAConfig(r=3, lora_alpha=6, target_modules=targets), seed=1)
    for module in model.modules():  # B starts at zero: make the adapters change the outputs
        if type(module) is LoRALinear:
            for b in module.lora_B.values():
                b.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    counted = _counting(model.decoder)
    with use_adapters(model, ["x", None, "y", "x", None]):
        _assert_steps_agree(model, tolerance=3e-4)  # float32 sums in another order, larger with the random LoRAs
    assert counted.calls == 2 * 4 + 1 + 1
