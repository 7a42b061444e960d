"""A tiny float64 model named like the real ones (layers.N.self_attn.q_proj, ...) for the LoRA tests."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.lora import LoRAConfig, adapter_names, add_adapter, use_adapters
from model.lora_layers import LoRALinear

D = 8
ATTN = LoRAConfig(r=4, lora_alpha=12.0)  # scaling 3
MIXED = LoRAConfig(r=2, lora_alpha=2.0, target_modules=("v_proj", "fc1", "fc2"))  # scaling 1
ROWS = ["a", None, "b", "a"]


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if x.dim() == 3:  # (B, T, D): softmax attention over T
            h = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1) @ v
        else:  # (B, D): one token per row, as in a decode step
            h = torch.tanh(q * k) * v
        return self.out_proj(h)


class FFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.ffn = Attention(), FFN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x)
        return x + self.ffn(x)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 5)  # never targeted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def toy() -> Toy:
    torch.manual_seed(0)
    return Toy().double().eval()


def randomize(model: nn.Module, name: str, seed: int) -> None:
    """Nonzero B (and fresh A) for adapter `name`, so it actually changes outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear) and name in m.lora_A:
                for w in (m.lora_A[name].weight, m.lora_B[name].weight):
                    w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * 0.3)


def with_adapters(*names: str) -> Toy:
    model = toy()
    for i, name in enumerate(names):
        add_adapter(model, name, MIXED if name == "b" else ATTN, seed=i)
        randomize(model, name, seed=100 + i)
    return model


def run(model: nn.Module, x: torch.Tensor, adapters) -> torch.Tensor:
    with torch.no_grad(), use_adapters(model, adapters):
        return model(x)


def inputs(dim: int, rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    shape = (rows, D) if dim == 2 else (rows, 3, D)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def snapshot(model: nn.Module) -> tuple:
    return (
        [(n, type(m)) for n, m in model.named_modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        adapter_names(model),
    )


def assert_unchanged(model: nn.Module, snap: tuple) -> None:
    modules, state, names = snapshot(model)
    assert modules == snap[0] and names == snap[2]
    assert state.keys() == snap[1].keys()
    assert all(torch.equal(state[k], snap[1][k]) for k in state)
