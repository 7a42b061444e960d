"""torchrun support: process-group setup, DDP wrapping, and the few collectives the trainer needs.

A run is distributed when torchrun's WORLD_SIZE is above 1: gloo on CPU, nccl on CUDA (one
device per process, ``cuda:LOCAL_RANK``). Everything here degrades to a no-op for one process.
Collectives move plain tensors only (no pickled objects).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from model.build import resolve_device
from training.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def user_device(name: str) -> torch.device:
    """``--device`` as a torch device; unknown names and missing CUDA are UserErrors."""
    try:
        device = resolve_device(name)
    except RuntimeError as e:
        raise UserError(f"--device {name}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    return device


def init_distributed(device: str = "auto") -> DistContext:
    """Join torchrun's process group when launched by it; pick this process's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext(device=user_device(device))
    rank = int(os.environ["RANK"])
    torch_device = user_device(device)
    if torch_device.type == "cuda":
        torch_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(torch_device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch_device.type == "cuda" else "gloo")
    logger.info("rank %d of %d on %s", rank, world_size, torch_device)
    return DistContext(rank, world_size, torch_device)


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(module: nn.Module, ctx: DistContext, find_unused_parameters: bool = False) -> nn.Module:
    """DDP around ``module`` when distributed; ``find_unused_parameters`` when some go without gradients."""
    if not ctx.distributed:
        return module
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # The models' only buffers are constant sinusoid tables: nothing to re-broadcast every forward.
    return DistributedDataParallel(
        module, device_ids=device_ids, find_unused_parameters=find_unused_parameters, broadcast_buffers=False
    )


def all_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Element-wise sum of ``values`` over all processes (float64)."""
    if not ctx.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_flag(flag: bool, ctx: DistContext) -> bool:
    """Rank 0's ``flag`` on every process."""
    if not ctx.distributed:
        return flag
    t = torch.tensor([int(flag)], device=ctx.device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def all_gather_bytes(data: bytes, ctx: DistContext) -> list[bytes]:
    """Every process's ``data``, indexed by rank."""
    if not ctx.distributed:
        return [data]
    size = torch.tensor([len(data)], dtype=torch.long, device=ctx.device)
    sizes = [torch.zeros_like(size) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    padded = bytearray(data) + bytes(longest - len(data))
    mine = torch.tensor(list(padded), dtype=torch.uint8, device=ctx.device)
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine)
    return [g.cpu().numpy().tobytes()[: int(s.item())] for g, s in zip(gathered, sizes, strict=True)]


def broadcast_bytes(data: bytes | None, ctx: DistContext) -> bytes:
    """Rank 0's ``data`` on every process (other ranks pass None)."""
    if not ctx.distributed:
        assert data is not None
        return data
    return all_gather_bytes(data if ctx.is_main else b"", ctx)[0]
