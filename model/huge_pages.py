"""Weights in 2 MB pages: anonymous mappings advised ``MADV_HUGEPAGE`` (2 MB pages where transparent huge pages
are "madvise" or "always").

A decoding step reads every weight once from memory; over 2 MB pages the stream walks no 4 KB page tables
mid-way: the int8 1-row GEMV ran 3-4% faster (docs/benchmarks.md, "Decoding steps at a few rows") and the float32
panels of Qwen2.5's step ~6% ("Packed fp32 weights on 2 MB pages"). The one place that maps them: the int8
weights' arena (model/int8_kernel.py), the float32 panels (model/packed_weights.py) and the KV caches' buffers
(model/kv_cache.py: a decoding step reads every cached key and value once too).
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20


def mapping(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh zeroed memory (int8) starting on a 2 MB boundary, advised MADV_HUGEPAGE where the OS has
    it; the mapping lives while any view of it does."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(nbytes, dtype=torch.int8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.int8)  # holds the mapping for as long as any view of it lives
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(advice, start, nbytes)
    except OSError as error:  # no transparent huge pages in this kernel: ordinary pages
        logger.debug("weights: madvise(MADV_HUGEPAGE) refused: %s", error)
    return whole[start:start + nbytes]


def floats(shape: tuple[int, ...]) -> torch.Tensor:
    """A zeroed float32 tensor of ``shape`` in a mapping of its own where it spans a 2 MB page or more; ordinary
    memory under that (a mapping per small weight: no huge page fits, only more mappings)."""
    nbytes = math.prod(shape) * 4
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape)
    return mapping(nbytes).view(torch.float32).view(shape)


def buffers(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
            zeroed: bool = True) -> list[torch.Tensor]:
    """``count`` tensors of ``shape``: on CPU, where together they span a 2 MB page or more, views of one fresh
    mapping (zeroed whatever ``zeroed`` says), since each alone is often far smaller (a KV cache's layer at batch 1:
    ~0.2-0.5 MB) and a mapping of its own gets no huge page; else tensors of their own (``torch.zeros``, or
    ``torch.empty`` where not ``zeroed``). No view overlaps another; the mapping lives while any of them does."""
    nbytes = count * math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE:
        make = torch.zeros if zeroed else torch.empty
        return [make(shape, dtype=dtype, device=device) for _ in range(count)]
    return list(mapping(nbytes).view(dtype).view(count, *shape).unbind(0))
