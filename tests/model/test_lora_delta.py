"""The native step's LoRA delta kernel (model/kernels/lora_delta.cpp) against float64, and its fallbacks."""

import pytest
import torch

from model import native
from model.layout import input_major

kernel = native.kernels()
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ kernels do not run here")


def _operands(rows: int, k: int, n: int, c: int, per_row: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, k, generator=g)
    a = torch.randn(c, k, generator=g) / k**0.5
    b = torch.randn(n, c, generator=g)
    scales = torch.randn(rows if per_row else 1, c, generator=g)
    scales[:, ::3] = 0  # columns of adapters a row does not select
    y = torch.randn(rows, 1, n, generator=g)
    return y, x, a, b, scales


def _reference(y, x, a, b, scales):
    h = x.double().reshape(x.shape[0], -1) @ a.double().t() * scales.double()
    return y.double() + (h @ b.double().t()).view(y.shape)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 32])
@pytest.mark.parametrize(("k", "n", "c"), [(512, 512, 8), (33, 7, 1), (64, 100, 17), (16, 2048, 64)])
@pytest.mark.parametrize("per_row", [True, False], ids=["per-row-scales", "one-scale-row"])
@pytest.mark.parametrize("layout", ["rows", "input-major", "a-input-major", "b-input-major"])
def test_kernel_equals_the_float64_reference(rows, k, n, c, per_row, layout):
    """Rows on one thread and spread over threads, A and B in either layout, sizes off the vector width."""
    y, x, a, b, scales = _operands(rows, k, n, c, per_row)
    a = input_major(a) if layout in ("input-major", "a-input-major") else a
    b = input_major(b) if layout in ("input-major", "b-input-major") else b
    expected = _reference(y, x, a, b, scales)
    with torch.no_grad():
        kernel.lora_delta_add_(y, x, a, b, scales)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-5)


def test_other_dtypes_and_autograd_take_aten():
    y, x, a, b, scales = (t.double() for t in _operands(2, 24, 10, 3, True))
    expected = _reference(y, x, a, b, scales)
    kernel.lora_delta_add_(y, x, a, b, scales)
    torch.testing.assert_close(y, expected)
    y, x, a, b, scales = _operands(2, 24, 10, 3, True)
    expected = _reference(y, x, a, b, scales)
    with torch.enable_grad():
        kernel.lora_delta_add_(y, x, a, b, scales)  # float32 under autograd: ATen's ops
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("broken", ["a-width", "b-rows", "scale-rows", "scale-columns"])
def test_shapes_that_disagree_raise(broken):
    y, x, a, b, scales = _operands(3, 16, 8, 4, True)
    if broken == "a-width":
        a = a[:, :-1]
    elif broken == "b-rows":
        b = b[:-1]
    elif broken == "scale-rows":
        scales = scales[:2]
    else:
        scales = scales[:, :-1]
    with pytest.raises(RuntimeError, match="shapes disagree"):
        kernel.lora_delta_add_(y, x, a, b, scales)
