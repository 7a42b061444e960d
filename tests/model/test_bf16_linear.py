"""The bf16 linear layer (model/bf16_linear.py): our kernel (AVX512-BF16, and its AVX2 twin, which AVX-512 CPUs run
at 256 bits) and the torch fallback against a float64 reference of the bf16-rounded x and weights, on shapes with
edge tiles; its rows; the CPU flags it is chosen by; and models whose linears are Bf16Linear through the C++
decoding step and encoder forward."""

import copy

import pytest
import torch

from model import native
from model.bf16_linear import Bf16Linear, kernel, pack, unpack
from model.cpu import CpuInfo
from model.fast_step import plan_for
from model.kernel_layers import is_plain
from tests.model.conftest import VECTOR_WIDTHS, random_ids, tiny_classifier, tiny_seq2seq
from tests.model.helpers import seq2seq_cache
from tests.model.test_cpu_tuning import ZEN_4, _cpuinfo
from tests.model.test_native_step import _assert_equal

needs_kernel = pytest.mark.skipif(kernel() is None, reason="the C++ kernels do not run here")
# the kernel at each vector width this CPU runs (512: VDPBF16PS where it has AVX512-BF16, else the twin), the fallback
BACKENDS = [*(f"kernel-{bits}" for bits in VECTOR_WIDTHS), "torch"]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 16, 17, 24, 31, 32, 33, 64, 100]
# (in, out): whole panels; in odd and not a multiple of 32, out not a multiple of 16; out under one vector; in over
# two of the AVX2 twin's blocks of 128 inputs (each block's successor prefetched during it), the last partial
SHAPES = [(64, 96), (33, 17), (31, 70), (8, 5), (300, 40)]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def backend(request, vector_bits_of):
    """A BACKENDS name -> the Bf16Linear backend, the kernels capped at its vector width for the test."""
    name, _, bits = request.param.partition("-")
    if bits:
        vector_bits_of(int(bits))
    return name


@pytest.fixture
def threads():
    """Run a test body at 1 and 2 threads: ``for _ in threads()``; the process's count restored after."""
    before = torch.get_num_threads()

    def each():
        for count in (1, 2):
            torch.set_num_threads(count)
            yield count

    yield each
    torch.set_num_threads(before)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, magnitude) in float64 of the bf16-rounded x and w: y = x w^T + b, magnitude = |x| |w|^T + |b|."""
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    y, magnitude = xb @ wb.T, xb.abs() @ wb.abs().T
    if bias is not None:
        y, magnitude = y + bias.double(), magnitude + bias.double().abs()
    return y, magnitude


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("inp", "out"), SHAPES)
def test_outputs_equal_the_float64_reference_of_the_rounded_operands(backend, rows, inp, out, threads):
    torch.manual_seed(rows * 1000 + inp)
    w, b, x = torch.randn(out, inp), torch.randn(out), torch.randn(2, rows, inp)[1]  # x a strided view's rows
    for bias in (b, None):
        layer = Bf16Linear(w, bias, backend)
        assert layer.backend == backend
        want, magnitude = _reference(x, w, bias)
        for _ in threads():
            y = layer(x)
            assert y.dtype == torch.float32 and y.shape == (rows, out)
            assert (y.double() - want).abs().max() <= 1e-6 * magnitude.max()


@needs_kernel
@pytest.mark.parametrize("rows", range(1, 33))
def test_a_few_rows_give_the_bits_they_give_in_a_wider_product(rows, threads, vector_bits):
    """2-32 rows take one pass over the weights a panel at a time (in groups of up to 10 rows; the twin: two rows at a
    time), 1 row and more than 32 tiles of 2 or 4 panels: each output is the same sum in the same order either way, so
    a row's outputs are the same bits alone or in a wide batch."""
    torch.manual_seed(rows)
    layer = Bf16Linear(torch.randn(70, 95), torch.randn(70), "kernel")
    x = torch.randn(40, 95)
    wide = layer(x)
    for _ in threads():
        assert torch.equal(layer(x[5:5 + rows]), wide[5:5 + rows])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_leading_dimensions_weight_bias_and_rows_of_the_layer(backend):
    torch.manual_seed(1)
    w, b, x = torch.randn(70, 31), torch.randn(70), torch.randn(2, 3, 31)
    layer = Bf16Linear(w, b, backend)
    assert torch.equal(layer.weight, w.bfloat16().float()) and torch.equal(layer.bias, b)
    y = layer(x)
    assert y.shape == (2, 3, 70)
    torch.testing.assert_close(y, layer(x.reshape(6, 31)).view(2, 3, 70), rtol=0, atol=0)
    ids = torch.tensor([69, 0, 33, 32, 5])
    part = layer.rows(ids)
    assert part.backend == backend and (part.out_features, part.in_features) == (5, 31)
    assert torch.equal(part.weight, layer.weight[ids]) and torch.equal(part.bias, b[ids])
    torch.testing.assert_close(part(x), y[..., ids], rtol=1e-6, atol=1e-6)


@needs_kernel
def test_the_kernel_rounds_x_to_bf16_as_torch_does(vector_bits):
    """One input, weight 1: no sum, so the output is x's bf16 rounding exactly (ties to even, NaN, infinities)."""
    step = 2.0 ** -8  # half a bf16 ulp at 1
    x = torch.tensor([1 + step, 1 + 3 * step, -(1 + step), 1 + step * 1.01, 3.0e38, float("inf"), float("nan"),
                      -0.0, 1e-3, 65504.0, 1 / 3]).unsqueeze(1)
    ones = torch.ones(1, 1)
    ours, fallback = Bf16Linear(ones, None)(x), Bf16Linear(ones, None, "torch")(x)
    assert torch.equal(ours.isnan(), fallback.isnan())
    kept = ~ours.isnan()
    assert torch.equal(ours[kept], fallback[kept]) and torch.equal(ours[kept], x.bfloat16().float()[kept])


def test_packing_round_trips_and_zero_pads_the_edges():
    w = torch.randn(70, 31).bfloat16()
    packed = pack(w)
    assert packed.shape == (3, 16, 32, 2) and torch.equal(unpack(packed, 70, 31), w)
    assert packed[2, :, 6:].abs().sum() == 0 and packed[:, 15, :, 1].abs().sum() == 0


def test_an_unknown_or_unavailable_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        Bf16Linear(torch.ones(2, 2), None, "amx")
    if kernel() is None:
        with pytest.raises(RuntimeError, match="kernel"):
            Bf16Linear(torch.ones(2, 2), None, "kernel")


def test_with_autograd_on_the_layer_computes_the_same_sums_through_torch():
    torch.manual_seed(2)
    layer = Bf16Linear(torch.randn(17, 33), torch.randn(17))
    x = torch.randn(4, 33)
    with torch.enable_grad():
        y = layer(x)
    torch.testing.assert_close(y, layer(x), rtol=1e-6, atol=1e-6)


def test_the_cpu_flags_the_kernels_choose_by_are_read(tmp_path):
    info = _cpuinfo(tmp_path / "cpuinfo", {**ZEN_4, "flags": "fpu sse2 avx512f avx512_vnni avx512_bf16 amx_fake"})
    assert CpuInfo.read(info, tmp_path / "none").flags == {"avx512f", "avx512_vnni", "avx512_bf16"}


def _to_bf16(stack: torch.nn.Module) -> None:
    """Every plain linear layer of ``stack``'s layers replaced by a Bf16Linear of it."""
    for parent in list(stack.modules()):
        for name, child in list(parent.named_children()):
            if is_plain(child):
                setattr(parent, name, Bf16Linear.from_linear(child))


@needs_kernel
@pytest.mark.skipif(native.kernels() is None, reason="the C++ decoding step does not run here")
def test_the_native_decoding_step_runs_bf16_layers(vector_bits):
    mt = tiny_seq2seq()
    _to_bf16(mt.decoder.layers)
    assert plan_for(mt.decoder).native is not None  # the C++ step binds the bf16 projections
    _assert_equal(mt, seq2seq_cache(mt, False), tol=1e-5)


@needs_kernel
@pytest.mark.skipif(native.kernels() is None, reason="the C++ encoder forward does not run here")
def test_the_native_encoder_forward_runs_bf16_layers(norm, vector_bits):
    model = tiny_classifier(norm=norm, n_layers=2)
    _to_bf16(model.encoder.layers)
    ids = random_ids(3, 12, seed=4)
    plan = plan_for(model.encoder)
    assert plan.native is not None
    with torch.inference_mode():
        logits = model(ids)
    reference = copy.deepcopy(model)
    with native.using_options(decode_kernels=False), torch.inference_mode():
        assert plan_for(reference.encoder).native is None
        want = reference(ids)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
