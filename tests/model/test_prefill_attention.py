"""The AVX-512 prefill-attention kernel (model/kernels/prefill_attention.cpp) against a float64 reference and SDPA,
where model.attention dispatches to it, and a Llama-style prefill through it against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import native
from model.attention import blocked_sdpa, prefill_rows
from model.hf import load_hf_model
from model.kv_cache import within_window
from tests.model.test_hf_llama import hf_model, save_llama

kernel = native.kernels()
pytestmark = pytest.mark.skipif(kernel is None or not kernel.has_avx512(), reason="the prefill kernel needs AVX-512")


def _reference(q, k, v, mask):
    """Float64 attention with K/V expanded to the query heads; a query that keeps no key gets zeros."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).nan_to_num(0.0) @ v


def _inputs(b, kv_heads, group, tq, tk, dh, seed=0):
    """q (B, H, Tq, Dh) as a view of a fused projection's output; k, v the first Tk positions of cache buffers."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(b, tq, heads * dh + 8, generator=g)[..., :heads * dh].view(b, tq, heads, dh).transpose(1, 2)
    k, v = (torch.randn(b, kv_heads, tk + 5, dh, generator=g)[:, :, :tk] for _ in range(2))
    return q, k, v


def _causal(tq, tk):
    """(1, 1, Tq, Tk): the last Tq of Tk positions, each seeing the keys up to its own (a prompt after a prefix)."""
    return (torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None])[None, None]


def _check(q, k, v, mask):
    """The kernel's output against the float64 reference (every query) and SDPA (the queries that keep a key)."""
    got = kernel.prefill_attention(q, k, v, mask)
    assert got.shape == q.shape and got.transpose(1, 2).is_contiguous()  # (B, Tq, H, Dh): merging heads is a view
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    live = (torch.ones(q.shape[:3], dtype=torch.bool) if mask is None
            else mask.any(-1).expand(q.shape[0], q.shape[1], q.shape[2]))
    torch.testing.assert_close(got[live], sdpa[live], rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize("t", [1, 15, 16, 17, 100, 513])  # blocks of 8 queries, spans of 16 keys, 32-key tiles
@pytest.mark.parametrize("group", [1, 3, 7])  # query heads per KV head
@pytest.mark.parametrize("dh", [64, 128])
def test_causal_prompts_with_a_left_padded_row_equal_the_float64_reference_and_sdpa(t, group, dh):
    q, k, v = _inputs(2, 2, group, t, t, dh, seed=t + group + dh)
    pad = t // 3
    mask = _causal(t, t).expand(2, 1, t, t) & (torch.arange(t) >= torch.tensor([0, pad])[:, None])[:, None, None]
    got = _check(q, k, v, mask)
    assert torch.equal(got[1, :, :pad], torch.zeros_like(got[1, :, :pad]))  # padding queries keep no key: zeros


@pytest.mark.parametrize(
    "kind", ["none", "key padding", "cached prefix", "sliding window", "window after a prefix", "random"])
def test_other_masks_equal_the_float64_reference_and_sdpa(kind):
    tq, tk = (40, 100) if "prefix" in kind else (100, 100)
    q, k, v = _inputs(2, 3, 3, tq, tk, 64)
    if kind == "none":
        mask = None
    elif kind == "key padding":  # (B, 1, 1, Tk), every query of a row alike
        mask = (torch.arange(tk) < torch.tensor([tk, 61])[:, None])[:, None, None]
    elif kind == "random":
        mask = torch.rand(2, 1, tq, tk, generator=torch.Generator().manual_seed(3)) > 0.7
    else:
        positions = torch.arange(tk - tq, tk)[None]
        causal = _causal(tq, tk)
        mask = within_window(causal, positions, tk, 24) if "window" in kind else causal
    _check(q, k, v, mask)


def test_two_threads_give_one_threads_outputs():
    q, k, v = _inputs(1, 3, 3, 200, 200, 64)
    mask = _causal(200, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.prefill_attention(q, k, v, mask)
        torch.set_num_threads(2)
        two = kernel.prefill_attention(q, k, v, mask)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each query block is one thread's whole sum, whatever the split


def test_prefill_shapes_take_the_kernel_and_others_sdpa():
    q, k, v = _inputs(1, 3, 3, 100, 100, 64)
    mask = _causal(100, 100)
    assert prefill_rows(kernel, q, k, v, mask)
    torch.testing.assert_close(blocked_sdpa(q, k, v, mask), kernel.prefill_attention(q, k, v, mask), rtol=0, atol=0)
    assert not prefill_rows(kernel, q.double(), k.double(), v.double(), mask)
    assert not prefill_rows(kernel, q.requires_grad_(), k, v, mask)
    q = q.detach()
    assert not prefill_rows(kernel, q[..., :48], k[..., :48], v[..., :48], mask)  # a head dim the kernel has not
    assert not prefill_rows(kernel, q, k, v, torch.zeros(1, 1, 100, 100))  # a float bias (T5's)
    assert not prefill_rows(kernel, q, k, v, mask.expand(1, 9, 100, 100))  # a mask per head
    assert not prefill_rows(kernel, q[:, :8], k, v, mask)  # KV heads that do not divide the query heads


def test_bad_inputs_raise():
    q, k, v = _inputs(1, 2, 2, 20, 20, 64)
    with pytest.raises(RuntimeError, match="prefill attention"):
        kernel.prefill_attention(q.double(), k.double(), v.double(), None)
    with pytest.raises(RuntimeError, match="prefill attention"):
        kernel.prefill_attention(q[:, :3], k, v, None)
    with pytest.raises(RuntimeError, match="prefill attention"):
        kernel.prefill_attention(q, k, v, torch.ones(1, 1, 20, 19, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="prefill attention"):
        kernel.prefill_attention(q[..., :48], k[..., :48], v[..., :48], None)


def test_a_llama_prefill_through_the_kernel_equals_transformers(tmp_path, monkeypatch):
    """Prompts longer than the C++ step takes run LayerStack.forward, whose attention is the kernel's (SDPA refused
    while ours runs): the logits after each right-padded prompt within 1e-4 of transformers' on the prompt alone."""
    directory = save_llama(tmp_path / "llama", seed=5, num_key_value_heads=2, num_attention_heads=6, head_dim=64,
                           hidden_size=96, max_position_embeddings=256)
    lengths = torch.tensor([kernel.MAX_STEP_TOKENS + 37, kernel.MAX_STEP_TOKENS + 9])
    ids = torch.randint(3, 90, (2, int(lengths.max())), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        hf = hf_model(directory)
        expected = torch.stack([hf(ids[i: i + 1, :n]).logits[0, -1] for i, n in enumerate(lengths.tolist())])
        ours = load_hf_model(directory)[0].eval()

        def refused(*args, **kwargs):
            raise AssertionError("the prefill's attention took SDPA")

        monkeypatch.setattr(F, "scaled_dot_product_attention", refused)
        logits = ours.prefill(ids, lengths, ours.new_cache(2, ids.shape[1] + 4))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
