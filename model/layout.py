"""Weight layout for CPU inference: nn.Linear weights stored input-major.

``nn.Linear`` keeps its weight as (out, in), row-major, so ``F.linear`` calls ``addmm(b, x, W.t())``
with a transposed operand. For the few-row GEMMs of decoding (2 to 64 rows: beams, batched
greedy) MKL handles that operand poorly: with the same numbers laid out (in, out) the same call
ran 1.2-2.3x faster on this project's 2-core CPU at 4-64 rows, and equal or faster at 1 row and at
thousands of rows (benchmarks/layout.py measures it). :func:`use_input_major_weights` re-lays each
weight in place of the old storage; the parameter keeps its (out, in) shape, only its strides
change, so every consumer (LoRA merge, state_dict, tied embeddings) keeps working. Saving copies
to contiguous tensors, so checkpoints are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) with the same values, stored so that ``weight.t()`` is contiguous."""
    return weight.t().contiguous().t()


def use_input_major_weights(model: nn.Module) -> int:
    """Re-lay every float ``nn.Linear`` weight of a CPU model in ``model`` input-major, except those tied to an
    embedding (input-major, a lookup of one token reads a strided column: 80 us for 16 tokens instead of 10);
    returns how many.

    For inference: call it after loading (and after quantisation, which replaces the layers it
    converts). A model on another device is left alone (cuBLAS takes either layout at full speed).
    """
    count = 0
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, nn.Linear):
                continue
            weight = module.weight
            if weight.device.type != "cpu" or not weight.is_floating_point() or weight.t().is_contiguous():
                continue
            if id(weight) in embeddings:  # a tied head: its lookups read rows (the head multiplies a packed copy)
                continue
            weight.data = input_major(weight.data)
            count += 1
    return count
