"""The C++ encoder forward (DecoderStack.encode, model/fast_step.run_encoder) computes what the layers compute."""

import copy

import pytest
import torch

from model import int8_kernel, native
from model.fast_step import plan_for
from model.layout import use_input_major_weights
from model.lora import LoRAConfig, add_adapter, use_adapters
from model.lora_layers import LoRALinear
from model.quantize import quantize_int8
from tests.model.conftest import random_ids, tiny_classifier, tiny_seq2seq

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="the C++ kernels do not run here")


class _CountingStack:
    """A bound DecoderStack whose encode calls are counted."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def encode(self, *args):
        self.calls += 1
        return self.stack.encode(*args)


def _counted(encoder) -> _CountingStack:
    plan = plan_for(encoder)
    assert plan.native is not None
    plan.native.stack = counting = _CountingStack(plan.native.stack)
    return counting


def _padded_ids(batch: int = 3, length: int = 12):
    ids = random_ids(batch, length, seed=4)
    ids[1, 5:] = 0  # a padded row (pad id 0)
    return ids


@pytest.mark.parametrize("length", [1, 12, 16, 40, 64])
def test_classifier_logits_and_hidden_states_equal_the_float64_reference(norm, length):
    model = tiny_classifier(norm=norm, n_layers=3)
    reference = copy.deepcopy(model).double()
    use_input_major_weights(model)
    ids = _padded_ids(length=length)
    if length == 1:
        ids[1] = 5
    counting = _counted(model.encoder)
    with torch.inference_mode():
        logits, (hidden, _) = model(ids), model.encode(ids)
    assert counting.calls == 2  # the [CLS]-only forward and the full encode
    with torch.no_grad():
        want_logits, (want_hidden, _) = reference(ids), reference.encode(ids)
    torch.testing.assert_close(logits.double(), want_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.double(), want_hidden, rtol=0, atol=1e-5)


@pytest.mark.parametrize("length", [12, 40])
@pytest.mark.skipif(int8_kernel.kernel() is None, reason="the C++ encoder runs our int8 kernel (AVX512-VNNI or AVX2)")
def test_int8_with_the_fused_projection_equals_the_layers_python_path(length):
    """Past 16 queries both paths attend through the kernel the layers pick, so int8's roundings agree too."""
    model = tiny_classifier(n_layers=2)
    quantize_int8(model)
    assert model.encoder.layers[0].self_attn.fused
    ids = _padded_ids(length=length)
    counting = _counted(model.encoder)
    with torch.inference_mode():
        native_logits, (native_hidden, _) = model(ids), model.encode(ids)
        assert counting.calls == 2
        plan_for(model.encoder).native = None  # the layers themselves (plan_for keeps this plan: nothing changed)
        python_logits, (python_hidden, _) = model(ids), model.encode(ids)
    assert counting.calls == 2
    torch.testing.assert_close(native_logits, python_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(native_hidden, python_hidden, rtol=0, atol=1e-5)


def test_a_translators_encoder_memory_equals_the_float64_reference(norm):
    model = tiny_seq2seq(norm=norm)
    reference = copy.deepcopy(model).double()
    src = _padded_ids(length=9)
    counting = _counted(model.encoder)
    with torch.inference_mode():
        memory, mask, maps = model.encode(src)
    assert counting.calls == 1 and len(maps) == len(model.encoder.layers)
    with torch.no_grad():
        want, want_mask, _ = reference.encode(src)
    assert torch.equal(mask, want_mask)
    torch.testing.assert_close(memory.double(), want, rtol=0, atol=1e-5)


def test_the_layers_compute_what_the_native_forward_does_not_take(monkeypatch):
    """Long rows, attention maps, autograd, training and active adapters go through the layers."""
    model = tiny_classifier(n_layers=2)
    counting = _counted(model.encoder)
    monkeypatch.setattr(native.kernels(), "MAX_ENCODE_TOKENS", 16)  # below the tiny model's 64 positions
    with torch.inference_mode():
        model(_padded_ids(length=17))  # past the kernel's limit
        model.encode(_padded_ids(), attention_weights=True)
    model(_padded_ids())  # autograd on
    assert counting.calls == 0
    add_adapter(model, "x", LoRAConfig(r=2, target_modules=["q_proj", "fc1"]), seed=0)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            for b in module.lora_B.values():
                torch.nn.init.normal_(b.weight)
    counting = _counted(model.encoder)  # wrapping q_proj and fc1 rebuilt the plan
    ids = _padded_ids()
    with torch.inference_mode():
        plain = model(ids)
        with use_adapters(model, "x"):
            adapted = model(ids)
    assert counting.calls == 1  # without the adapter only
    assert not torch.allclose(plain, adapted, atol=1e-3)
