"""The CPU's report (model/cpu.py) read from /proc/cpuinfo and sysfs files, the panel GEMM's rule chosen from it for
each vendor, that rule set in the kernels when they load, and the same outputs under every rule."""

from pathlib import Path

import pytest
import torch

from model import native
from model.cpu import AMD, DEFAULT_L2_BYTES, INTEL, CpuInfo, PanelTuning, kernel_tuning, this_cpu

SAPPHIRE_RAPIDS = {"vendor_id": INTEL, "model name": "Intel(R) Xeon(R) Platinum 8480+", "cpu family": "6",
                   "model": "143"}
ZEN_4 = {"vendor_id": AMD, "model name": "AMD EPYC 9654 96-Core Processor", "cpu family": "25"}
CACHES = {"index0": ("1", "Data", "48K"), "index1": ("1", "Instruction", "32K"), "index2": ("2", "Unified", "2048K"),
          "index3": ("3", "Unified", "105M")}


def _cpuinfo(path: Path, fields: dict[str, str], processors: int = 2) -> Path:
    """A /proc/cpuinfo with ``processors`` blocks; every block after the first says something else."""
    blocks = [{"processor": str(i), **fields} if i == 0 else {"processor": str(i), "vendor_id": "Other",
                                                              "model name": "not the first"} for i in range(processors)]
    path.write_text("\n\n".join("\n".join(f"{k}\t: {v}" for k, v in block.items()) for block in blocks) + "\n\n")
    return path


def _caches(directory: Path, caches: dict[str, tuple[str, str, str]]) -> Path:
    for index, (level, kind, size) in caches.items():
        (directory / index).mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (directory / index / name).write_text(value + "\n")
    return directory


def test_the_first_processor_and_the_l2_data_cache_are_read(tmp_path):
    cpu = CpuInfo.read(_cpuinfo(tmp_path / "cpuinfo", SAPPHIRE_RAPIDS), _caches(tmp_path / "cache", CACHES))
    assert cpu == CpuInfo(vendor=INTEL, model_name="Intel(R) Xeon(R) Platinum 8480+", l2_bytes=2048 * 1024,
                          family_model="family 6 model 143")


def test_an_instruction_cache_at_the_level_is_skipped_and_sizes_in_megabytes_read(tmp_path):
    caches = {"index0": ("2", "Instruction", "64K"), "index1": ("2", "Unified", "1M")}
    cpu = CpuInfo.read(_cpuinfo(tmp_path / "cpuinfo", ZEN_4), _caches(tmp_path / "cache", caches))
    assert cpu.l2_bytes == 1 << 20


def test_what_cannot_be_read_falls_back(tmp_path):
    """A container that hides sysfs's caches, a /proc/cpuinfo without vendor (some hypervisors), none at all."""
    bare = _cpuinfo(tmp_path / "cpuinfo", {"model name": "Some CPU"})
    broken = _caches(tmp_path / "broken", {"index2": ("two", "Unified", "1024K"), "index3": ("2", "Unified", "")})
    assert CpuInfo.read(bare, tmp_path / "none") == CpuInfo(vendor="", model_name="Some CPU", l2_bytes=DEFAULT_L2_BYTES)
    assert CpuInfo.read(bare, broken).l2_bytes == DEFAULT_L2_BYTES
    assert CpuInfo.read(tmp_path / "missing", tmp_path / "none").vendor == ""


def test_each_vendor_gets_the_rule_measured_on_it():
    zen = kernel_tuning(CpuInfo(vendor=AMD, model_name="AMD EPYC", l2_bytes=1 << 20, flags=frozenset({"avx512f"})))
    zen3 = kernel_tuning(CpuInfo(vendor=AMD, model_name="AMD EPYC", l2_bytes=512 << 10))
    spr = kernel_tuning(CpuInfo(vendor=INTEL, model_name="Xeon", l2_bytes=2 << 20))
    unknown = kernel_tuning(CpuInfo(vendor="", model_name="?", l2_bytes=1 << 20))
    assert zen == PanelTuning(row_block_bytes=768 * 1024, prefetch_rows=32, streaming_tile_rows=4,
                              streaming_prefetch_rows=64, streaming_into_l2=True, gemv_panels=4)
    assert zen3 == PanelTuning(**{**zen.__dict__, "row_block_bytes": 384 * 1024, "gemv_prefetch": False})
    assert spr == PanelTuning(row_block_bytes=1536 * 1024, prefetch_rows=32, streaming_tile_rows=4,
                              streaming_prefetch_rows=32, streaming_into_l2=False, gemv_panels=1)
    assert unknown == PanelTuning(**{**spr.__dict__, "row_block_bytes": 768 * 1024})


kernel = native.kernels()  # the panel GEMM: AVX-512 or AVX2
needs_kernels = pytest.mark.skipif(kernel is None, reason="the C++ kernels do not run here")


def _in_force() -> PanelTuning:
    got = kernel.panel_tuning()
    return PanelTuning(**{name: getattr(got, name) for name in PanelTuning.__dataclass_fields__})


@pytest.fixture
def restore_tuning():
    before = _in_force()
    yield
    native.apply_tuning(kernel, before)


@needs_kernels
def test_the_kernels_load_with_this_cpus_rule(restore_tuning):
    native.apply_tuning(kernel, PanelTuning(1024, 8, 2, 8, False, 2))
    module, why = native.load_from(native.options().kernel_dir)  # the built module imported again
    assert why == "" and module is not None
    assert _in_force() == kernel_tuning(this_cpu())


@needs_kernels
def test_a_rule_the_kernel_cannot_run_is_refused(restore_tuning):
    with pytest.raises(RuntimeError, match="streaming_tile_rows at most 12"):
        native.apply_tuning(kernel, PanelTuning(768 * 1024, 32, 13, 64, True, 4))
    with pytest.raises(RuntimeError, match="must be positive"):
        native.apply_tuning(kernel, PanelTuning(0, 32, 4, 64, True, 4))
    with pytest.raises(RuntimeError, match="gemv_panels must be 1, 2 or 4"):
        native.apply_tuning(kernel, PanelTuning(768 * 1024, 32, 4, 64, True, 3))
    with pytest.raises(RuntimeError, match="vector_bits must be 512 or 256"):
        native.apply_tuning(kernel, PanelTuning(768 * 1024, 32, 4, 64, True, 4, vector_bits=128))
    assert _in_force() == kernel_tuning(this_cpu())


RULES = [
    kernel_tuning(CpuInfo(vendor=AMD, model_name="", l2_bytes=1 << 20, flags=frozenset({"avx512f"}))),
    kernel_tuning(CpuInfo(vendor=INTEL, model_name="", l2_bytes=2 << 20)),
    PanelTuning(row_block_bytes=4096, prefetch_rows=0, streaming_tile_rows=12, streaming_prefetch_rows=512,
                streaming_into_l2=False, gemv_panels=2),  # tiny blocks; every tile "streaming"
    PanelTuning(row_block_bytes=64 << 20, prefetch_rows=200, streaming_tile_rows=0, streaming_prefetch_rows=0,
                streaming_into_l2=True, gemv_panels=4),  # one block; no tile streaming
    PanelTuning(row_block_bytes=384 * 1024, prefetch_rows=32, streaming_tile_rows=4, streaming_prefetch_rows=64,
                streaming_into_l2=True, gemv_panels=4, vector_bits=256, gemv_prefetch=False),  # a Zen 3's rule
    PanelTuning(row_block_bytes=4096, prefetch_rows=0, streaming_tile_rows=12, streaming_prefetch_rows=512,
                streaming_into_l2=False, gemv_panels=1, vector_bits=256),  # AVX2, tiny blocks, every tile streaming
]


@needs_kernels
@pytest.mark.parametrize("tuning", RULES, ids=["zen4", "sapphire-rapids", "small-blocks", "one-block", "avx2",
                                               "avx2-small-blocks"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 70, 300), (1, 250, 64), (1, 512, 33), (2, 200, 100), (2, 8000, 64), (4, 100, 64), (13, 40, 128),
    (700, 70, 300), (150, 100, 3000)])
def test_every_rule_gives_the_float64_reference(restore_tuning, tuning, rows, out_features, in_features):
    """Rows in blocks of several sizes (700 x 300 is 820 KB: one block under Sapphire Rapids' rule, two under Zen
    4's), tiles of 1-12 rows (AVX2: 1-6, whole panels or halves) under either prefetch rule; 1-2 rows over panels
    walked 1, 2 or 4 at a time, with panel counts (per thread) that are and are not multiples of them and a last
    panel cut short (70, 250, 200). A CPU without AVX-512 runs the 512-bit rules in AVX2's tiles."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    bias, x = torch.randn(out_features, generator=g), torch.randn(rows, in_features, generator=g)
    native.apply_tuning(kernel, tuning)
    with torch.no_grad():
        got = kernel.packed_linear(x, kernel.pack_weight(weight), out_features, bias)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().t() + bias.double(), atol=1e-4, rtol=1e-5)
