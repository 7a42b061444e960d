"""Packed copies of float32 weights: what every float32 linear layer of inference multiplies by.

Our panel GEMM (model/kernels/packed_linear.cpp) reads a copy of the weight laid out in 32-column panels,
one contiguous run per strip of columns. It beat MKL's GEMM by 1.3-1.45x on the batched decoding step and
by 2-4x at the 16-64 rows of a sentence (MKL repacks the weight on every call), and from one row on it
matched or beat the few-rows GEMV over the weights as stored (model/kernels/few_rows_linear.cpp): 1.1-1.3x
end to end at batch 1 (docs/benchmarks.md, "Levers of issue 19"). :func:`packed` makes that copy the first
time a layer multiplies, keeps it beside the weight for as long as the weight lives, and makes it again
when the weight changed since (an in-place change such as a LoRA merge bumps its version counter;
re-laying it, as model/layout.py does, moves its data). Changes made through ``weight.data`` in place bump
no counter the Parameter shows and go unseen: change weights through the Parameter (under
``torch.no_grad``) or ``load_state_dict``, as this project does. The copy is as large as the weight:
``TSERVE_PACKED_WEIGHTS=off`` (``model.native.options().packed_weights``) keeps the few-rows GEMV and MKL
on the weights as stored instead.
"""

from __future__ import annotations

from types import ModuleType

import torch

from model import huge_pages, native

# Up to this many rows the few-rows GEMV reads the weights as stored instead (few_rows_linear.cpp). It was 4;
# with the panel GEMM ahead from one row on (1.1-1.3x at batch 1 end to end), none.
MAX_GEMV_ROWS = 0

# The attribute a weight keeps its copy in: ((its version, its data pointer) when packed, the panels). On the
# tensor itself, it lives and dies with the weight, and reading it is an attribute lookup (0.08 us; the
# weak-keyed dictionary it replaces took 1.1 us a call, every linear layer of every step).
_ATTRIBUTE = "_tserve_packed"


def enabled() -> bool:
    """Whether batched steps may use packed copies (``TSERVE_PACKED_WEIGHTS``, default on)."""
    return native.options().packed_weights


def packed(kernels: ModuleType, weight: torch.Tensor) -> torch.Tensor | None:
    """The panels of ``weight`` (out, in) for ``kernels.packed_linear``, up to date, in 2 MB pages from 2 MB on
    (model.huge_pages); None where it has none (not a float32 CPU tensor, or an inference tensor, whose changes
    cannot be seen)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.is_inference():
        return None
    state = (weight._version, weight.data_ptr())
    entry = getattr(weight, _ATTRIBUTE, None)
    if entry is None or entry[0] != state:
        panels = huge_pages.floats((-(-weight.shape[0] // 32), weight.shape[1], 32))
        entry = (state, kernels.pack_weight(weight, panels))
        setattr(weight, _ATTRIBUTE, entry)
    return entry[1]
