"""model.attention.rotate: apply_rotary's bits, in place by the kernel (rows_rotate_rounded_) in CPU float32 inference;
apply_rotary itself where autograd needs a fresh tensor. And a long prompt's prefill on the PyTorch layer path, its
angles from the rotary's table: the logits and KV cache of apply_rotary with each layer's own cos_sin."""

from __future__ import annotations

import pytest
import torch

from model import attention, native
from model.hf import load_hf_model
from model.rope import Rotary, apply_rotary
from tests.model.test_hf_llama import save_llama

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ kernels do not run here")


def _heads(batch: int, heads: int, tokens: int, dh: int, seed: int) -> torch.Tensor:
    """(B, H, T, Dh) as MultiHeadAttention.split_heads views a fused projection: (B, T, (H + 2) Dh) narrowed."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, tokens, (heads + 2) * dh, generator=g) * 4
    return fused[..., : heads * dh].view(batch, tokens, heads, dh).transpose(1, 2)


@pytest.mark.parametrize(("batch", "heads", "tokens", "dh", "rotary_dim", "per_row"), [
    (1, 3, 37, 64, 64, False), (2, 5, 19, 32, 16, False), (3, 2, 11, 48, 48, True), (1, 4, 1, 128, 128, False)])
def test_rotate_is_apply_rotary_bit_for_bit_in_place(batch, heads, tokens, dh, rotary_dim, per_row, vector_bits):
    rotary = Rotary(dh, theta=10000.0, rotary_dim=rotary_dim)
    positions = torch.arange(tokens)[None] + (torch.tensor([[0], [7], [300]])[:batch] if per_row else 900)
    cos, sin = rotary.cos_sin(positions)
    expected = apply_rotary(_heads(batch, heads, tokens, dh, seed=tokens), cos, sin)
    y = _heads(batch, heads, tokens, dh, seed=tokens)  # the same values, a fresh projection to rotate in place
    with torch.inference_mode():
        out = attention.rotate(y, cos, sin)
    assert out is y  # rotated in place: the kernel ran
    assert torch.equal(out, expected)


def test_rotate_leaves_autograd_to_apply_rotary():
    rotary = Rotary(32)
    cos, sin = rotary.cos_sin(torch.arange(6)[None])
    x = _heads(1, 2, 6, 32, seed=1).clone().requires_grad_()
    out = attention.rotate(x, cos, sin)
    assert out is not x
    out.sum().backward()
    assert x.grad is not None and torch.equal(out, apply_rotary(x, cos, sin))


@pytest.mark.parametrize("ragged", [False, True])
def test_a_long_prompt_prefills_as_apply_rotary_does(monkeypatch, tmp_path, ragged):
    model = load_hf_model(save_llama(tmp_path, seed=3, num_key_value_heads=2, max_position_embeddings=160))[0].eval()
    ids = torch.randint(3, 90, (2, kernels.MAX_STEP_TOKENS + 9), generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([ids.shape[1], ids.shape[1] - 5 * ragged])

    def prefill():
        cache = model.new_cache(ids.shape[0], ids.shape[1] + 2)
        with torch.inference_mode():
            return model.prefill(ids, lengths, cache), cache

    calls, tables = [], []
    rotate, table = kernels.rows_rotate_rounded_, Rotary.cos_sin_from
    monkeypatch.setattr(kernels, "rows_rotate_rounded_", lambda *args: calls.append(1) or rotate(*args))
    monkeypatch.setattr(Rotary, "cos_sin_from", lambda *args: tables.append(1) or table(*args))
    fast, fast_cache = prefill()
    assert calls and len(tables) == len(model.decoder.layers)  # kernel rotations; right-padded rows too: table angles
    monkeypatch.setattr(attention, "rotate", apply_rotary)
    monkeypatch.setattr(Rotary, "cos_sin_from", lambda *args: None)  # every layer's angles by cos_sin
    slow, slow_cache = prefill()
    assert torch.equal(fast, slow)
    for mine, theirs in zip(fast_cache.keys + fast_cache.values, slow_cache.keys + slow_cache.values, strict=True):
        assert torch.equal(mine, theirs)
