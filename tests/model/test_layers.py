"""Components against their formulas and a naive float64 reference."""

import math

import torch

from model.attention import MultiHeadAttention
from model.layers import causal_mask, sinusoidal_table


def test_positional_encoding_matches_the_formula():
    d, table = 16, sinusoidal_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)


def naive_attention(mha: MultiHeadAttention, x, source, mask):
    """Per-head loops with explicit softmax(QK^T / sqrt(d_k)) V, in float64."""
    b, t, d = x.shape
    h, dh = mha.n_heads, mha.head_dim
    q, k, v = mha.q_proj(x), mha.k_proj(source), mha.v_proj(source)
    out = torch.zeros(b, t, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            sl = slice(hi * dh, (hi + 1) * dh)
            scores = q[bi, :, sl] @ k[bi, :, sl].T / math.sqrt(dh)
            if mask is not None:
                m = mask[bi if mask.shape[0] > 1 else 0, 0].expand(t, source.shape[1])
                scores = scores.masked_fill(~m, float("-inf"))
            out[bi, :, sl] = torch.softmax(scores, -1) @ v[bi, :, sl]
    return mha.out_proj(out)


def test_attention_matches_naive_reference_self_cross_and_masked():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    src = torch.randn(2, 7, 16, dtype=torch.float64)
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[1, ..., 4:] = False
    for query, source, mask in [(x, x, None), (x, x, causal_mask(5, x.device)), (x, src, pad)]:
        fused, _ = mha(query, mask, source=source)
        explicit, weights = mha(query, mask, source=source, attention_weights=True)
        ref = naive_attention(mha, query, source, mask)
        assert (fused - ref).abs().max() < 1e-10
        assert (explicit - ref).abs().max() < 1e-10
        assert torch.allclose(weights.sum(-1), torch.ones_like(weights.sum(-1)))


def test_attention_weights_respect_masks():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    _, weights = mha(x, causal_mask(6, x.device), attention_weights=True)
    assert torch.all(weights.triu(1) == 0)
