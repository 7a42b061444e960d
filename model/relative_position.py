"""T5's relative position bias: a learned scalar per head and distance bucket, added to the attention scores.

The distance key - query falls into one of ``num_buckets`` buckets: exact buckets for the short distances, then
logarithmically wider ones up to ``max_distance``, beyond which all distances share the last bucket. A
bidirectional stack (an encoder) gives half the buckets to keys after the query; a causal one (a decoder) uses
them all for keys at or before it. One table per stack (transformers keeps it in layer 0) serves every layer's
self-attention; cross-attention has no position bias.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.kv_cache import KVCache


def relative_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """The bucket (int64, in [0, num_buckets)) of each distance ``relative`` = key position - query position
    (transformers' ``T5Attention._relative_position_bucket``, the same operations in the same order)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).to(torch.long) * num_buckets
        distance = relative.abs()
    else:
        distance = -torch.min(relative, torch.zeros_like(relative))
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """The bias table (num_buckets, heads) of one stack, and the attention masks it turns into."""

    def __init__(self, num_buckets: int, max_distance: int, n_heads: int, bidirectional: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_buckets, n_heads)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        # the bias of every relative position (_by_relative) and the weight tensor and version it was built from
        self._table: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def _by_relative(self, span: int) -> tuple[torch.Tensor, int]:
        """(bias (H, 2S - 1), S - 1): the bias of every relative position -(S-1)..S-1 in column r + S - 1, for some
        S >= ``span`` and past ``max_distance`` (farther positions share the last bucket: clamped to +-(S - 1) they
        read the same column): the embedding rows of their buckets, so a lookup gives the floats the buckets of each
        position give. Built without autograd and kept while the weight is the same tensor at the same version (S
        doubling as needed): a decoding step's bias is a slice of it instead of the buckets' ~20 tensor ops (0.16 ms
        a step of Flan-T5-base's decoder, 3% of it; docs/benchmarks.md, helper T, session 24)."""
        weight = self.embedding.weight
        if self._table is not None and self._table[0] is weight and not weight.is_inference() \
                and self._table[1] == weight._version:
            table = self._table[2]
            if table.shape[1] >= 2 * span - 1:
                return table, table.shape[1] // 2
        size = max(64, 1 << (span - 1).bit_length(), 1 << self.max_distance.bit_length())
        buckets = relative_bucket(torch.arange(1 - size, size, device=weight.device), self.bidirectional,
                                  self.num_buckets, self.max_distance)
        with torch.no_grad():
            table = self.embedding(buckets).t().contiguous()
        # A weight made under torch.inference_mode (a checkpoint loaded there) has no version to follow: made anew
        self._table = None if weight.is_inference() else (weight, weight._version, table)
        return table, size - 1

    def forward(self, queries: torch.Tensor, keys: int) -> torch.Tensor:
        """The bias (B|1, H, t, K) of queries at positions ``queries`` (B|1, t) over keys at positions 0..K-1."""
        relative = torch.arange(keys, device=queries.device)[None, None, :] - queries[:, :, None]  # (B|1, t, K)
        if not torch.is_grad_enabled():  # a lookup of the relative positions, contiguous along K (no host sync:
            table, center = self._by_relative(keys)  # a CUDA graph captures it in the static step)
            return table[:, relative.clamp(-center, center) + center].permute(1, 0, 2, 3)
        buckets = relative_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.embedding(buckets).permute(0, 3, 1, 2)

    def attention_mask(self, mask: torch.Tensor | None, tokens: int, cache: KVCache | None) -> torch.Tensor:
        """The float mask (B|1, H, t, K) a self-attention of ``tokens`` new positions adds to its scores: the bias
        where boolean ``mask`` (broadcastable to (B, 1, t, K); None: every key) lets a query attend, the dtype's
        lowest value elsewhere (as transformers masks). Queries sit at the cache's write positions (0..t-1 without
        a cache) and see the keys at positions 0..K-1 of their rows' own buffers."""
        if cache is None:
            queries, keys = torch.arange(tokens, device=self.embedding.weight.device)[None, :], tokens
        else:
            if cache.prefix is not None:
                raise ValueError("a relative position bias does not read a shared prefix")
            queries, keys = cache.write_positions, cache.max_length + tokens
            if queries is None:
                raise RuntimeError("a relative position bias over a cache needs KVCache.begin_step first")
            if cache.uniform and tokens == 1 and mask is None and not torch.is_grad_enabled():
                # a decoding step: the query at keys - 1 sees relative positions -(K-1)..0, one slice (1, H, 1, K)
                table, center = self._by_relative(keys)
                return table.narrow(1, center + 1 - keys, keys)[None, :, None, :]
            queries = queries[:1] if cache.uniform else queries
        bias = self(queries, keys)
        if mask is None:
            return bias
        return torch.where(mask, bias, torch.finfo(bias.dtype).min)
