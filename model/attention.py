"""Multi-head scaled dot-product attention: softmax(Q K^T / sqrt(d_k)) V.

The fast path is ``torch.nn.functional.scaled_dot_product_attention`` (fused kernels on GPU);
``attention_weights=True`` takes the explicit path so the weights can be returned for introspection.
Blocks of up to 16 queries per row (decoding steps over the KV cache, short sentences, a [CLS]-only last
layer) go through :func:`decode_attention`: our AVX-512 / AVX2 kernel (model/kernels/decode_attention.cpp) on CPU
float32 inference, SDPA otherwise; longer blocks (a prompt's prefill) through :func:`blocked_sdpa`: our
prefill kernel (model/kernels/prefill_attention.cpp) where :func:`prefill_rows` holds, else SDPA by query blocks.
Masks are boolean, True where a query may attend, broadcastable to (B, H, Tq, Tk); or float, added to the scores
(T5's relative position bias, model.relative_position: the kernel leaves those to SDPA).
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from model import bf16_linear, native
from model.kernel_layers import Linear
from model.kv_cache import KVCache, within_window
from model.rope import Rotary, apply_rotary
from model.shared_prefix import SharedPrefix

KERNEL_MAX_QUERIES = 16  # longer query blocks (prefill) are SDPA's strength
KERNEL_MAX_HEAD_DIM = 256  # decode_attention.cpp kMaxChunks * 16 (Gemma 3: 256)
ENCODER_HEAD_DIM = 64  # the head dim of encoder_attention.cpp (an encoder's rows of more than 16 queries)
QUERY_BLOCK = 64  # a longer query block's SDPA on the CPU runs in blocks of this many queries (causal_sdpa)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, dropout: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention returning (output, weights); shapes (B, H, Tq, Dh) and (B, H, Tq, Tk)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = scores.softmax(dim=-1)
    return F.dropout(weights, p=dropout) @ v, weights


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    prefix: SharedPrefix | None = None, layer: int = 0, bf16_products: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)`` for a decoding step, no dropout;
    with ``prefix``, each row also attends to its prefix blocks of ``layer`` (ahead of ``k``/``v``, which hold its own
    positions). q (B, H, Tq, Dh); k, v (B, H_kv, T, Dh) with H_kv dividing H: query head h reads KV head
    h // (H / H_kv) (grouped-query attention, nothing expanded). ``bf16_products``: :func:`blocked_sdpa`'s.

    CPU float32 without autograd, up to 16 queries per head: our kernel, which reads each head's K/V once
    (2-3x faster than SDPA at one query; a query with nothing to attend to gets zeros, not NaN).
    """
    kernel = native.kernels()
    if (
        kernel is None
        or q.dtype != torch.float32
        or q.device.type != "cpu"
        or q.shape[2] > KERNEL_MAX_QUERIES
        or q.shape[3] > KERNEL_MAX_HEAD_DIM
        or q.requires_grad
        or k.stride(3) != 1
        or v.stride(3) != 1
        or k.stride(2) != v.stride(2)  # the kernel walks k and v alike (a partial rotary's k is a fresh tensor)
        or q.stride(3) != 1
        or (mask is not None and mask.dtype != torch.bool)
        or (prefix is not None and prefix.blocks[0].dtype != torch.float32)
    ):
        if prefix is not None:
            return prefix_attention(q, k, v, mask, prefix, layer)
        return blocked_sdpa(q, k, v, mask, bf16_products)
    if prefix is None:
        return kernel.decode_attention(q, k, v, mask)
    return kernel.decode_attention(q, k, v, mask, list(prefix.blocks), prefix.table, layer)


def blocked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, bf16_products: bool = False
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask)`` (grouped K/V not expanded); more than QUERY_BLOCK
    queries on the CPU run in blocks of QUERY_BLOCK, each against the keys up to the last one its mask shows, so a
    causal prefill skips the upper triangle (SDPA with an explicit mask computes it all: 512 tokens, 7.6 -> 4.6 ms a
    layer at 9 / 3 heads of 64, 11.6 -> 7.2 ms at 14 / 2). Where :func:`encoder_rows` or :func:`prefill_rows` holds,
    our kernel computes it instead (the prefill's: 1.4 ms a layer at 9 / 3 heads of 64). ``bf16_products`` (a model
    whose GEMMs already round their inputs: :attr:`MultiHeadAttention.bf16_products`): encoder rows go through the
    bf16-product kernel where :func:`bf16_encoder_kernel` finds it."""
    kernel = native.kernels()
    if kernel is not None and not kernel.has_avx512():  # the encoder and prefill kernels are AVX-512 only
        kernel = None
    if kernel is not None and encoder_rows(q, k, v, mask):
        bf16 = bf16_encoder_kernel() if bf16_products else None
        return (kernel.encoder_attention(q, k, v, mask) if bf16 is None
                else bf16.encoder_attention_bf16(q, k, v, mask))
    if kernel is not None and prefill_rows(kernel, q, k, v, mask):
        return kernel.prefill_attention(q, k, v, mask)
    t, gqa = q.shape[2], k.shape[1] != q.shape[1]
    if mask is None or mask.dtype != torch.bool or t <= QUERY_BLOCK or mask.shape[-2] != t or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    seen = mask.flatten(0, -3).any(0)  # (Tq, Tk): the keys some row or head of each query may read
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    for start in range(0, t, QUERY_BLOCK):
        stop = min(t, start + QUERY_BLOCK)
        visible = seen[start:stop].any(0).nonzero()
        end = int(visible[-1]) + 1 if visible.numel() else 1
        out[:, :, start:stop] = F.scaled_dot_product_attention(
            q[:, :, start:stop], k[:, :, :end], v[:, :, :end], attn_mask=mask[..., start:stop, :end], enable_gqa=gqa)
    return out


def encoder_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether our encoder-attention kernel (model/kernels/encoder_attention.cpp: 2.3-2.4x SDPA on 8 rows x 12 heads
    x 128 tokens) computes this: CPU float32 inference, self-attention of rows with as many keys as queries and head
    dim 64 (BERT, RoBERTa, XLM-R, DistilBERT), unit stride along it, no mask or a bool key mask (B|1, 1, 1, T)."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and not q.requires_grad
            and q.dim() == 4 and q.shape == k.shape == v.shape and q.shape[3] == ENCODER_HEAD_DIM
            and q.stride(3) == k.stride(3) == v.stride(3) == 1 and k.stride() == v.stride()
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1
                                  and mask.shape[0] in (1, q.shape[0]) and mask.shape[3] == q.shape[2])))


def bf16_encoder_kernel() -> ModuleType | None:
    """The kernels whose ``encoder_attention_bf16`` (model/kernels/encoder_attention_bf16.cpp: q, k, v and the softmax's
    weights rounded to bf16, float32 sums; 1.35-1.5x encoder_attention on 32 rows x 12 heads x 128 tokens) runs on
    this CPU: the ones with AVX512-BF16, else None (float32 kept)."""
    module = bf16_linear.kernel()
    return module if module is not None and module.has_avx512_bf16() else None


def prefill_rows(
    kernel: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> bool:
    """Whether ``kernel``'s prefill attention (model/kernels/prefill_attention.cpp: 2.8-2.9x blocked SDPA on a
    512-token causal prompt at 9 / 3 heads of 64) computes this: CPU float32 inference, grouped-query K/V (B, H_kv,
    Tk, Dh) with H_kv dividing H, Dh a multiple of ``kernel.PREFILL_HEAD_DIM_MULTIPLE`` (64, 128, 256), at most
    ``kernel.PREFILL_MAX_KEYS`` keys, unit stride along Dh, no mask or a bool one (B|1, 1, Tq|1, Tk): causal, with a
    cached prefix, padded rows or a sliding window alike (the kernel computes only the keys each query block keeps)."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and not q.requires_grad
            and q.dim() == k.dim() == 4 and k.shape == v.shape and q.shape[0] == k.shape[0]
            and q.shape[3] == k.shape[3] and q.shape[3] % kernel.PREFILL_HEAD_DIM_MULTIPLE == 0
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0 and k.shape[2] <= kernel.PREFILL_MAX_KEYS
            and q.stride(3) == k.stride(3) == v.stride(3) == 1
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                                  and mask.shape[0] in (1, q.shape[0]) and mask.shape[2] in (1, q.shape[2])
                                  and mask.shape[3] == k.shape[2])))


def prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, prefix: SharedPrefix, layer: int
) -> torch.Tensor:
    """Attention of q (B, H, Tq, Dh) over each row's prefix blocks of ``layer`` and then its own k/v (B, H_kv, T, Dh)
    (``mask``, (B|1, 1, Tq, T), covers the own keys), in PyTorch ops; grouped-query attention without expanded K/V.
    The rows that read one chain (a system prompt) are attended together, and each group reads only its own chain's
    blocks: rows with histories of their own (multi-turn chat) cost what attention row by row costs. A group's
    blocks are put side by side once (one (H_kv, P, Dh) copy); then a few queries per row (a decoding step) are one
    GEMM of all the group's queries against that copy, while a prefill's many queries go through SDPA (fused: no
    (Tq, P) scores held) over each row's keys with the chain ahead (a copy per row, small next to the queries' work)."""
    groups = prefix.groups
    if len(groups) == 1:
        return _chain_attention(q, k, v, mask, prefix, layer, groups[0].chain)
    out = q.new_empty(q.shape)
    for group in groups:
        rows = group.index
        rows_mask = mask if mask is None or mask.shape[0] == 1 else mask[rows]
        out[rows] = _chain_attention(q[rows], k[rows], v[rows], rows_mask, prefix, layer, group.chain)
    return out


def _chain_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, prefix: SharedPrefix, layer: int,
    chain: tuple[int, ...],
) -> torch.Tensor:
    """:func:`prefix_attention` of rows that all read the blocks ``chain`` (none: their own keys alone)."""
    gqa = k.shape[1] != q.shape[1]
    if not chain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    prefix_keys, prefix_values = prefix.keys(layer, chain).to(k.dtype), prefix.values(layer, chain).to(v.dtype)
    if q.shape[2] <= KERNEL_MAX_QUERIES:
        return _few_queries_attention(q, k, v, mask, prefix_keys, prefix_values)
    rows = q.shape[0]
    keys = torch.cat((prefix_keys.expand(rows, -1, -1, -1), k), dim=2)
    values = torch.cat((prefix_values.expand(rows, -1, -1, -1), v), dim=2)
    if mask is not None:  # every query sees the whole prefix
        mask = torch.cat((mask.new_ones(*mask.shape[:-1], prefix_keys.shape[1]), mask), dim=-1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


def _few_queries_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
) -> torch.Tensor:
    """:func:`prefix_attention` of rows that all read ``prefix_keys``/``prefix_values`` (H_kv, P, Dh): the prefix
    part is one GEMM per KV head, whose rows are the g = H / H_kv query heads of every row's queries."""
    b, heads, t, dh = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # scores and softmax in float32, as SDPA's kernels accumulate
        q, k, v = q.float(), k.float(), v.float()
        prefix_keys, prefix_values = prefix_keys.float(), prefix_values.float()
    shared = prefix_keys.shape[1]
    scale = dh**-0.5
    by_head = q.transpose(0, 1).reshape(kv_heads, group * b * t, dh)  # every row's queries of a KV head's group
    prefix_scores = (by_head @ prefix_keys.transpose(1, 2)).view(heads, b, t, shared).transpose(0, 1) * scale
    grouped = q.unflatten(1, (kv_heads, group))  # (B, H_kv, g, Tq, Dh) against k, v (B, H_kv, 1, T, Dh)
    own_scores = (grouped @ k[:, :, None].transpose(-2, -1)).flatten(1, 2) * scale
    if mask is not None:
        own_scores = own_scores.masked_fill(~mask, float("-inf"))
    weights = torch.cat((prefix_scores, own_scores), dim=-1).softmax(dim=-1)
    from_prefix = weights[..., :shared].transpose(0, 1).reshape(kv_heads, group * b * t, shared) @ prefix_values
    from_own = (weights[..., shared:].unflatten(1, (kv_heads, group)) @ v[:, :, None]).flatten(1, 2)
    return (from_prefix.view(heads, b, t, dh).transpose(0, 1) + from_own).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` of x (B, H, T, Dh), a view of this step's fresh projection (MultiHeadAttention.forward's q
    and k): in CPU float32 inference our kernel rotates it in place with the same float32 operations, each product
    rounded as ATen's (the same bits), without apply_rotary's four temporaries of x's size (SmolLM2's 512-token prompt:
    1.4 ms a layer for q, whose temporaries leave the L2 cache)."""
    kernel = native.kernels()
    if (kernel is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(3) != 1
            or (torch.is_grad_enabled() and x.requires_grad) or cos.dtype != torch.float32):
        return apply_rotary(x, cos, sin)
    kernel.rows_rotate_rounded_(x, cos.contiguous(), sin.contiguous())
    return x


def rotate_through_float32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, Dh) rotated as transformers' ModernBERT rotates it: x rounded to float32, times cos/sin (B|1, T, Dh)
    cast to x's dtype, in the promoted dtype (float64 stays float64, bfloat16 computes in float32), cast back."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    h = x.float()
    half = h.shape[-1] // 2
    return (h * cos + torch.cat((-h[..., half:], h[..., :half]), dim=-1) * sin).to(x.dtype)


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with separate q/k/v/out projections (the names LoRA targets).

    Optional: ``n_kv_heads`` < ``n_heads`` (grouped-query attention: K/V, and the cache, hold n_kv_heads, each read
    by n_heads / n_kv_heads consecutive query heads), a ``head_dim`` other than d_model / n_heads, and ``rotary``
    positions applied to q and k at each row's absolute position (before K is cached). Self-attention may also
    take ``qk_norm`` (norms of each head of q and of k, before rope), a ``scale`` of q.k other than 1/sqrt(head_dim),
    a ``window`` (a query sees the keys less than ``window`` positions back; the cache keeps them all; with
    ``bidirectional_window`` also less than ``window`` ahead: an encoder's local layers), ``rotary_float32``
    (:func:`rotate_through_float32`), and
    ``out_bias`` apart from the q/k/v projections' ``bias`` (None: the same).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, bias: bool = True, *,
                 n_kv_heads: int | None = None, head_dim: int | None = None, rotary: Rotary | None = None,
                 out_bias: bool | None = None, qk_norm: tuple[nn.Module, nn.Module] | None = None,
                 scale: float | None = None, window: int | None = None, bidirectional_window: bool = False,
                 rotary_float32: bool = False) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = head_dim or d_model // n_heads
        self.dropout = dropout
        inner, kv_inner = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = Linear(d_model, inner, bias=bias)
        self.k_proj = Linear(d_model, kv_inner, bias=bias)
        self.v_proj = Linear(d_model, kv_inner, bias=bias)
        self.out_proj = Linear(inner, d_model, bias=bias if out_bias is None else out_bias)
        self.rotary = rotary
        self.q_norm, self.k_norm = qk_norm if qk_norm is not None else (None, None)
        # the kernels and SDPA scale by 1/sqrt(head_dim): another scale multiplies q by its ratio to that one
        self.query_scale = 1.0 if scale is None else scale * math.sqrt(self.head_dim)
        self.window = window
        self.bidirectional_window = bidirectional_window
        self.rotary_float32 = rotary_float32
        # Optional (D -> 3D) projection computing q, k, v of self-attention in one GEMM (model.quantize
        # builds an int8 one); used only while q/k/v are still the modules it was built from, so a
        # LoRA wrapper around any of them switches back to the separate projections.
        self.qkv_proj: nn.Module | None = None
        self._qkv_of: tuple[nn.Module, ...] = ()
        # Inference attention of an encoder's rows with bf16 products (blocked_sdpa's bf16_products): set by
        # model.quantize.prepare_for_inference for the bf16 mode, whose GEMMs round their inputs to bf16 already.
        self.bf16_products = False

    @property
    def fused(self) -> bool:
        """Whether self-attention takes the fused q/k/v projection."""
        return self.qkv_proj is not None and (self.q_proj, self.k_proj, self.v_proj) == self._qkv_of

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H*Dh) -> (B, H, T, Dh) (H: query or K/V heads, by the width)."""
        b, t, _ = x.shape
        return x.view(b, t, -1, self.head_dim).transpose(1, 2)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output (B, T, (H + 2 H_kv) Dh) -> q (B, H, T, Dh), k and v (B, H_kv, T, Dh)."""
        kv = self.n_kv_heads * self.head_dim
        q, k, v = qkv.split((self.n_heads * self.head_dim, kv, kv), dim=-1)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    @staticmethod
    def merge_heads(out: torch.Tensor) -> torch.Tensor:
        """(B, H, T, Dh) -> (B, T, D), the out projection's input."""
        b, _, t, _ = out.shape
        return out.transpose(1, 2).reshape(b, t, -1)

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``source`` (B, S, D), each (B, H, S, Dh); cached once for cross-attention."""
        return self.split_heads(self.k_proj(source)), self.split_heads(self.v_proj(source))

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        source: torch.Tensor | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        attention_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``x`` (B, T, D) to itself, to ``source`` (cross), or to precomputed ``kv``.

        With ``cache`` (self-attention while decoding) this step's K/V are written into the cache
        at each row's position and the query attends to everything the cache holds for its row.
        """
        if source is None and kv is None and self.fused:
            q, k, v = self.split_qkv(self.qkv_proj(x))
        else:
            q = self.split_heads(self.q_proj(x))  # (B, H, T, Dh)
            k, v = kv if kv is not None else self.project_kv(x if source is None else source)
        if self.q_norm is not None and kv is None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None and source is None and kv is None:
            cos, sin = self._angles(x, cache)  # once for q and k
            if self.rotary_float32 and q.dtype != torch.float32:
                q, k = rotate_through_float32(q, cos, sin), rotate_through_float32(k, cos, sin)
            else:
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if cache is not None and kv is None:
            k, v = cache.write(layer, k, v)  # (B, H_kv, K, Dh): each K/V head serves a group of consecutive query heads
        if self.window is not None and source is None and kv is None:
            queries = self._own_positions(x, cache)
            mask = within_window(mask, queries, k.shape[2], self.window)
            if self.bidirectional_window:  # and less than window ahead: keys k - q < window
                mask = mask & (torch.arange(k.shape[2], device=x.device) - queries[:, None, :, None] < self.window)
        dropout = self.dropout if self.training else 0.0
        if k.dtype != q.dtype:  # a cache kept in another dtype
            k, v = k.to(q.dtype), v.to(q.dtype)
        if cache is not None and kv is None and cache.prefix is not None:
            if attention_weights or dropout:
                raise ValueError("a shared prefix is read for inference only: no attention weights, no dropout")
            out = decode_attention(q, k, v, mask, cache.prefix, layer)
            weights = None
        elif attention_weights:  # the explicit path reads expanded K/V
            groups = self.n_heads // self.n_kv_heads
            out, weights = attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), mask, dropout)
        elif dropout:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 enable_gqa=self.n_kv_heads != self.n_heads)
            weights = None
        else:  # a few queries (a short sentence, a decoding step, a [CLS]-only last layer): our kernel; else SDPA
            out = decode_attention(q, k, v, mask, bf16_products=self.bf16_products)
            weights = None
        return self.out_proj(self.merge_heads(out)), weights

    def _angles(self, x: torch.Tensor, cache: KVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary's cos and sin at x's positions: sliced from its table (Rotary.cos_sin_from: the same bits) while
        every row writes at the same positions, no shared prefix ahead (as model.fast_step's C++ step takes them),
        so a prompt on the layer path computes no trig per layer (0.1 ms a layer at 512 tokens)."""
        if cache is not None and cache.uniform and cache.prefix is None:
            found = self.rotary.cos_sin_from(cache.max_length, x.shape[1], x.device)
            if found is not None:
                return found
        return self.rotary.cos_sin(self._positions(x, cache))

    @staticmethod
    def _own_positions(x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Positions of ``x``'s tokens among the keys this step attends to (B|1, T): the cache's write positions in
        its rows' own buffers, else 0..T-1."""
        if cache is None:
            return torch.arange(x.shape[1], device=x.device)[None, :]
        if cache.prefix is not None:
            raise ValueError("sliding-window attention does not read a shared prefix")
        return cache.write_positions

    @staticmethod
    def _positions(x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Each row's absolute positions of ``x``'s tokens (B|1, T): the cache's write positions (the ones position
        embeddings get from :meth:`KVCache.begin_step`, a shared prefix counted), else 0..T-1."""
        if cache is None:
            return torch.arange(x.shape[1], device=x.device)[None, :]
        positions = cache.write_positions
        if positions is None:
            raise RuntimeError("rotary attention over a cache needs KVCache.begin_step first")
        return positions + cache.prefix.lengths[:, None] if cache.prefix is not None else positions
