"""model.kernel_layers: which kernel computes (the rules in its docstring), against float64 references and torch."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model import native, packed_weights
from model.classifier import TransformerClassifier
from model.config import ClassifierConfig
from model.kernel_layers import LayerNorm, Linear, activate, is_plain, linear
from model.layers import RMSNorm
from model.layout import use_input_major_weights
from model.quantize import prepare_for_inference

kernel = native.kernels()  # AVX-512 or AVX2
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ kernels do not run here")


class _Recording:
    """The kernels module, recording which of its GEMMs ran."""

    def __init__(self, module, calls: list[str]):
        self.module, self.calls = module, calls

    def __getattr__(self, name):
        attribute = getattr(self.module, name)
        if name in ("few_rows_linear", "packed_linear"):
            def record(*args):
                self.calls.append(name)
                return attribute(*args)
            return record
        return attribute


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    recorded: list[str] = []

    def kernels():
        return _Recording(kernel, recorded)

    kernels.cache_clear = native.kernels.cache_clear  # as native.using_options (kernel_options) expects
    monkeypatch.setattr(native, "kernels", kernels)
    return recorded


def _layer(out_features: int = 40, in_features: int = 24, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias)
    use_input_major_weights(layer)
    return layer


@pytest.mark.parametrize("gemv_rows", [packed_weights.MAX_GEMV_ROWS, 4])  # the setting, and a GEMV range
@pytest.mark.parametrize("shape", [(1, 24), (2, 2, 24), (5, 24), (3, 7, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_inference_rows_pick_the_gemv_or_the_panel_gemm(calls, monkeypatch, gemv_rows, shape, bias):
    monkeypatch.setattr(packed_weights, "MAX_GEMV_ROWS", gemv_rows)
    layer = _layer(bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        got = layer(x)
    rows = x.numel() // 24
    assert calls == ["few_rows_linear" if rows <= gemv_rows else "packed_linear"]
    reference = x.double() @ layer.weight.double().t() + (layer.bias.double() if bias else 0)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)


def test_training_other_dtypes_and_packing_off_take_f_linear(calls, kernel_options):
    layer = _layer()
    x = torch.randn(6, 24)
    out = layer(x)  # autograd on: F.linear, gradients flow
    out.sum().backward()
    assert calls == [] and layer.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(linear(x.double(), layer.weight.double(), layer.bias.double()),
                                   F.linear(x.double(), layer.weight.double(), layer.bias.double()))
        assert calls == []
        kernel_options(packed_weights=False)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == ["few_rows_linear"]  # which hands more than 4 rows to MKL itself


def test_a_changed_weight_is_multiplied_as_changed(calls):
    layer = _layer()
    x = torch.randn(8, 24)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2)  # in place, through the Parameter: the packed copy is refreshed
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == ["packed_linear", "packed_linear"]


def test_a_served_classifier_runs_every_projection_on_our_kernels_and_agrees_with_mkl(calls):
    """A 16-token sentence through an inference-prepared encoder: every projection on the panel GEMM (the
    [CLS]-only last layer's and the heads' on the GEMV), logits as F.linear's within float32 rounding."""
    config = ClassifierConfig(vocab_size=60, d_model=32, n_heads=4, d_ff=64, n_layers=2, num_labels=3,
                              max_len=32, dropout=0.0)
    model = prepare_for_inference(TransformerClassifier(config).eval(), "none")
    ids = torch.randint(5, 60, (1, 16))
    with torch.no_grad():
        got = model(ids)
        assert "packed_linear" in calls and set(calls) <= {"packed_linear", "few_rows_linear"}
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(native, "kernels", lambda: None)
            expected = model(ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_plain_means_float_linear_layers_only():
    assert is_plain(Linear(2, 3)) and is_plain(nn.Linear(2, 3))
    assert not is_plain(nn.LayerNorm(3)) and not is_plain(nn.Sequential(Linear(2, 3)))


def test_layer_norm_inference_on_the_kernel_equals_torch_in_float64(vector_bits):
    torch.manual_seed(0)
    norm = LayerNorm(44, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 5, 44) * 3 + 1
    with torch.no_grad():
        got = norm(x)
    reference = F.layer_norm(x.double(), (44,), norm.weight.double(), norm.bias.double(), 1e-5)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    norm(x.requires_grad_(True)).sum().backward()  # training: torch's op, gradients flow
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_inference_on_the_kernel_equals_torch_in_float64(offset, monkeypatch, vector_bits):
    """RMSNorm's inference (a prefill's norms, the final norm of a step) takes the kernels' one-pass row norm; its
    values are the float64 reference's, and training keeps torch's ops (gradients flow)."""
    kernels, calls = native.kernels(), []

    class Recording:  # the kernels, counting row norms
        def __getattr__(self, name: str) -> object:
            return getattr(kernels, name)

        def rows_rms_norm(self, *args: object) -> torch.Tensor:
            calls.append(args)
            return kernels.rows_rms_norm(*args)

    monkeypatch.setattr(native, "kernels", Recording)
    torch.manual_seed(0)
    norm = RMSNorm(44, eps=1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 44) * 3 + 1
    with torch.no_grad():
        got = norm(x)
    assert len(calls) == 1
    x64 = x.double()
    scale = (1.0 + norm.weight.double()) if offset else norm.weight.double()
    reference = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    norm(x.requires_grad_(True)).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_activations_on_the_kernel_equal_torch_in_float64(activation, vector_bits):
    h = torch.randn(4, 7, 50) * 4
    reference = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu,
                 "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation](h.double())
    with torch.no_grad():
        got = activate(h.clone(), activation)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    strided = h.transpose(0, 1)  # not contiguous: torch's op, the input untouched
    with torch.no_grad():
        torch.testing.assert_close(activate(strided, activation).double(), reference.transpose(0, 1),
                                   rtol=1e-5, atol=1e-5)
