"""Which int8 GEMM the int8 layers use, and the weight layout of ours (model/kernels/int8_gemm.cpp).

``model.native.options().int8_kernel`` (``TSERVE_INT8_KERNEL``) picks: ``auto`` (default: our kernel where the
C++ kernels build (model/native.py) and the CPU has AVX512-VNNI or AVX2 with FMA, fbgemm otherwise), ``kernel``
(ours or an error) or ``fbgemm``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

from model import native
from model.huge_pages import mapping

logger = logging.getLogger(__name__)

ENV = native.KernelOptions.env("int8_kernel")  # named in errors


class KernelUnavailable(RuntimeError):
    """``TSERVE_INT8_KERNEL`` is not a known choice, or asks for ``kernel`` where it cannot run."""


def kernel_choice() -> str:
    """The int8 GEMM asked for, one of ``native.INT8_KERNELS``."""
    choice = native.options().int8_kernel
    if choice not in native.INT8_KERNELS:
        raise KernelUnavailable(f"{ENV}={choice!r}: expected one of {list(native.INT8_KERNELS)}")
    return choice


def available() -> tuple[ModuleType | None, str]:
    """(the C++ kernels, "") where our int8 kernel runs on this CPU, else (None, why not)."""
    module, why = native.load()
    if module is not None and not module.has_int8_kernel():
        return None, "this CPU has neither AVX512-VNNI nor AVX2 with FMA"
    return module, why


def kernel() -> ModuleType | None:
    """The C++ kernels when the int8 option (``TSERVE_INT8_KERNEL``) allows ours and it runs here; None: fbgemm."""
    choice = kernel_choice()
    if choice == "fbgemm":
        return None
    module, why = available()
    if module is None:
        if choice == "kernel":
            raise KernelUnavailable(f"{ENV}=kernel: {why}")
        _warn_once(why)
    return module


@functools.cache
def _warn_once(why: str) -> None:
    logger.warning("int8 layers use fbgemm: %s", why)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 weights (out, in) -> the kernel's [out/16][in/4][16][4] layout, zero-padded; inside
    :func:`huge_pages`, in its arena's 2 MB pages."""
    out, inp = q.shape
    padded = torch.zeros(-(-out // 16) * 16, -(-inp // 4) * 4, dtype=torch.int8)
    padded[:out, :inp] = q
    layout = padded.view(-1, 16, padded.shape[1] // 4, 4).permute(0, 2, 1, 3)
    arena = getattr(_packing, "arena", None)
    return layout.contiguous() if arena is None else arena.take(layout.shape).copy_(layout)


_packing = threading.local()


@contextlib.contextmanager
def huge_pages() -> Iterator[None]:
    """Weights packed inside (one model's quantisation) share one fresh :class:`HugePageArena`, in the order a step
    reads them; packs outside (a restricted head's rows, per request) take ordinary memory, so no short-lived weight
    holds a mapping that a model's weights live in, and an unloaded model's mappings go with it."""
    previous = getattr(_packing, "arena", None)
    _packing.arena = HugePageArena()
    try:
        yield
    finally:
        _packing.arena = previous


class HugePageArena:
    """Packed int8 weights placed one after another in 2 MB-page mappings (model.huge_pages: a decoding step reads
    every weight once from memory). Weights of one model land in load order, contiguous, the order a step reads
    them. A mapping lives while any weight in it does (each weight is a view of it)."""

    CHUNK = 64 << 20  # bytes mapped at a time; a larger weight gets a mapping of its own
    ALIGN = 64  # each weight starts on a cache line

    def __init__(self) -> None:
        self._free = torch.empty(0, dtype=torch.int8)  # the current mapping's unused tail

    def take(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """An uninitialised int8 tensor of ``shape``, contiguous, in huge-page memory where possible."""
        nbytes = math.prod(shape)
        span = -(-nbytes // self.ALIGN) * self.ALIGN
        if span > self._free.numel():
            self._free = mapping(max(self.CHUNK, span))
        block, self._free = self._free[:nbytes], self._free[span:]
        return block.view(shape)


def unpack(packed: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The inverse of :func:`pack`: int8 weights (out, in)."""
    blocks, steps = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, steps * 4)[:out, :inp]


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor, inp: int) -> torch.Tensor:
    """Rows ``ids`` of :func:`unpack`'s weights (len(ids), in), read straight from the packed layout (a restricted
    vocabulary's head: a few thousand of 256k rows without unpacking the rest)."""
    return packed[ids // 16, :, ids % 16, :].reshape(ids.shape[0], -1)[:, :inp]
