"""The native step's LayerNorm, activations and residual add (model/kernels/elementwise.cpp) against float64."""

import pytest
import torch
import torch.nn.functional as F

from model import native

kernel = native.kernels()
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ kernels do not run here")


@pytest.mark.parametrize(("rows", "d"), [(1, 512), (3, 37), (64, 512), (2, 16), (1, 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_equals_the_float64_reference(rows, d, affine):
    x = torch.randn(rows, 1, d) * 3 + 1
    weight, bias = (torch.randn(d), torch.randn(d)) if affine else (torch.empty(0), torch.empty(0))
    got = kernel.rows_layer_norm(x, weight, bias, 1e-5)
    expected = F.layer_norm(x.double(), (d,), weight.double() if affine else None, bias.double() if affine else None,
                            1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("activation", "reference"), [("relu", F.relu), ("gelu", F.gelu),
                                                        ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
                                                        ("silu", F.silu)])
@pytest.mark.parametrize("rows", [1, 40])
def test_activations_equal_the_float64_reference_in_place(activation, reference, rows):
    x = torch.linspace(-12, 12, rows * 2051).view(rows, 2051)  # both tails, zero, odd widths
    h = x.clone()
    got = kernel.rows_activate_(h, kernel.Activation.__members__[activation])
    assert got.data_ptr() == h.data_ptr()  # in place
    torch.testing.assert_close(got.double(), reference(x.double()), rtol=1e-6, atol=1e-6)


def test_add_in_place():
    y, x = torch.randn(5, 1, 33), torch.randn(5, 1, 33)
    expected = y + x
    got = kernel.rows_add_(y, x)
    assert got.data_ptr() == y.data_ptr() and torch.equal(got, expected)


def test_what_they_do_not_run_goes_to_aten():
    """float64, non-contiguous inputs and mismatched shapes: the ATen op's result."""
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(kernel.rows_layer_norm(x, torch.ones(8, dtype=torch.float64),
                                                      torch.zeros(8, dtype=torch.float64), 1e-5),
                               F.layer_norm(x, (8,)))
    strided = torch.randn(4, 16)[:, ::2]
    assert not strided.is_contiguous()
    torch.testing.assert_close(kernel.rows_activate_(strided, kernel.Activation.gelu), F.gelu(strided))
    torch.testing.assert_close(kernel.rows_activate_(strided, kernel.Activation.silu), F.silu(strided))
    torch.testing.assert_close(kernel.rows_add_(torch.ones(2, 3), torch.ones(3)), torch.full((2, 3), 2.0))


@pytest.mark.parametrize("layout", ["contiguous", "head_split_view"])
def test_cache_write_fills_one_position_of_every_row_and_head(layout):
    cache = torch.zeros(3, 4, 10, 8)
    if layout == "contiguous":
        src = torch.randn(3, 4, 1, 8)
    else:  # a projection's (B, 1, D) output seen as heads, as the native step passes it
        src = torch.randn(3, 1, 32).view(3, 1, 4, 8).transpose(1, 2)
    kernel.rows_cache_write(cache, 6, src)
    assert torch.equal(cache[:, :, 6:7], src)
    assert cache[:, :, :6].abs().sum() == 0 and cache[:, :, 7:].abs().sum() == 0


def test_cache_write_outside_the_buffer_raises():
    with pytest.raises(RuntimeError):
        kernel.rows_cache_write(torch.zeros(1, 2, 4, 8), 4, torch.randn(1, 2, 1, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_copy_windows_moves_each_rows_window_reading_sources_before_writes(dtype):
    """Rows swapped (each both a source and a target) and one duplicated, in buffers of two shapes: each target
    row gets its source's positions [2, 5) as they were before the call; everything else stays."""
    buffers = [torch.randn(4, 3, 8, 5).to(dtype), torch.randn(4, 2, 8, 7).to(dtype)]
    before = [b.clone() for b in buffers]
    targets, sources = [0, 1, 3], [1, 0, 1]
    assert kernel.rows_copy_windows(buffers, targets, sources, 2, 5)
    for old, new in zip(before, buffers, strict=True):
        want = old.clone()
        want[targets, :, 2:5] = old[sources, :, 2:5]
        assert torch.equal(new, want)


def test_rows_copy_windows_declines_what_it_does_not_cover_and_copies_nothing():
    buffer = torch.randn(3, 2, 6, 4)
    strided = torch.randn(3, 6, 2, 4).transpose(1, 2)  # (3, 2, 6, 4), not contiguous
    before = buffer.clone()
    assert not kernel.rows_copy_windows([buffer, strided], [0], [1], 0, 4)
    assert not kernel.rows_copy_windows([buffer], [0], [3], 0, 4)  # a source past the rows
    assert not kernel.rows_copy_windows([buffer], [0], [1], 0, 7)  # past the capacity
    assert torch.equal(buffer, before)
