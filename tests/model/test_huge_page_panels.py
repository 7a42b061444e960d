"""A float32 weight's panels of 2 MB and more (model.packed_weights.packed) live in a mapping of their own on 2 MB
pages (model.huge_pages): the same values and products as ordinary memory, advised MADV_HUGEPAGE, released with
the weight."""

from pathlib import Path

import pytest
import torch

from model import native
from model.huge_pages import HUGE_PAGE
from model.packed_weights import packed

kernel = native.kernels()  # the panel GEMM: AVX-512 or AVX2
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ kernels do not run here")

MAPS, THP = Path("/proc/self/smaps"), Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(address: int) -> list[str] | None:
    """The lines of /proc/self/smaps describing the mapping that holds ``address``; None where none does."""
    lines = MAPS.read_text().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" in span and ":" not in span:
            start, end = (int(part, 16) for part in span.split("-"))
            if start <= address < end:
                return [line, *lines[i + 1:i + 30]]
    return None


def _huge_page_eligible(address: int) -> bool:
    """Whether the mapping holding ``address`` may take 2 MB pages (smaps' THPeligible)."""
    mapping = _mapping(address) or []
    return any(line.split() == ["THPeligible:", "1"] for line in mapping)


def _thp_on_advice() -> bool:
    """Whether transparent huge pages go where advised, and only there (this machine: "madvise")."""
    return THP.is_file() and "[madvise]" in THP.read_text()


def _reference_panels(weight: torch.Tensor) -> torch.Tensor:
    """(ceil(N / 32), K, 32): strips of 32 output columns, zero past N."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 32) * 32, k)
    padded[:n] = weight
    return padded.view(-1, 32, k).transpose(1, 2).contiguous()


@pytest.mark.parametrize(("out_features", "in_features"), [(1040, 520), (33, 16384)])
def test_large_panels_start_on_a_huge_page_and_multiply_as_ordinary_ones(out_features, in_features):
    """Panels over 2 MB (a partial last panel in both; 33 x 16,384: two panels of 2 MB each)."""
    weight = torch.randn(out_features, in_features) / in_features**0.5
    panels = packed(kernel, weight)
    assert panels.numel() * 4 >= HUGE_PAGE
    assert panels.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(panels, _reference_panels(weight))
    x = torch.randn(3, in_features)
    with torch.no_grad():
        got = kernel.packed_linear(x, panels, out_features, None)
        assert torch.equal(got, kernel.packed_linear(x, panels.clone(), out_features, None))  # ordinary memory
    torch.testing.assert_close(got.double(), x.double() @ weight.double().t(), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not MAPS.is_file(), reason="no /proc/self/smaps")
def test_the_mapping_is_advised_and_goes_with_the_panels():
    weight = torch.randn(2048, 512)  # 4 MB
    address = packed(kernel, weight).data_ptr()
    assert _mapping(address) is not None
    if _thp_on_advice():
        assert _huge_page_eligible(address)  # MADV_HUGEPAGE took
    del weight  # the panels live on it
    assert _mapping(address) is None


def test_small_panels_take_ordinary_memory():
    """Under a huge page, no mapping of its own (one per small weight: no huge page fits, only more mappings)."""
    weight = torch.randn(64, 48)
    panels = packed(kernel, weight)
    assert torch.equal(panels, _reference_panels(weight))
    if MAPS.is_file():
        start = int(_mapping(panels.data_ptr())[0].split("-", 1)[0], 16)
        assert start != panels.data_ptr()  # inside the allocator's memory, not at the start of a mapping
