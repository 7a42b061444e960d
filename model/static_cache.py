"""A KV cache whose tensors never move: what a captured CUDA graph of the decoding step reads and writes.

:class:`StaticKVCache` has the :class:`model.kv_cache.KVCache` interface the attention calls (``begin_step``,
``write``, ``write_positions``, ``end_step``), so the model's own forward runs over it unchanged. Every buffer is
allocated once for ``rows`` rows (the largest batch size the step serves) and ``capacity`` positions, and a step only
writes into them in place: this step's key/value of row b lands at position ``lengths[b]`` by a scatter, the lengths
advance by an in-place add, and attention reads the whole (rows, H, capacity, Dh) buffer under a (rows, 1, 1, capacity)
mask of each row's visible positions. No shape depends on the rows' lengths, so one captured graph serves every step.
:meth:`StaticKVCache.view` gives the first ``b`` rows (views of the same memory: a smaller captured batch size).

Rows past the live ones (padding up to a captured batch size) keep length 0 and a visible first cross-attention key, so
their values stay finite (a NaN in a masked value still poisons a softmax-weighted sum: 0 * NaN).
Cross-attention K/V (encoder-decoder) sit in static (rows, H, source_capacity, Dh) buffers under a key mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.kv_cache import CrossAttentionMemory, KVCache, kv_buffers


@dataclass
class StaticKVCache(KVCache):
    """Self-attention K/V (rows, H_kv, capacity, Dh) per layer, written in place by index at each row's length."""

    key_positions: torch.Tensor | None = None  # (capacity,) 0..capacity-1, for the mask

    @classmethod
    def allocate(cls, n_layers: int, rows: int, n_heads: int, head_dim: int, capacity: int,
                 device: torch.device | str, dtype: torch.dtype) -> StaticKVCache:
        """Zeroed buffers for ``rows`` rows of ``capacity`` positions (zeros: masked positions stay finite), on 2 MB
        pages as :meth:`KVCache.empty` makes them."""
        keys, values = kv_buffers(n_layers, (rows, n_heads, capacity, head_dim), dtype, device)
        return cls(keys=keys, values=values,
                   lengths=torch.zeros(rows, dtype=torch.long, device=device),
                   max_length=capacity - 1, uniform=False,  # a step sees max_length + t = capacity keys (begin_step)
                   key_positions=torch.arange(capacity, device=device))

    def add_cross(self, n_layers: int, n_heads: int, head_dim: int, source_capacity: int) -> None:
        """Static cross-attention buffers (rows, H, source_capacity, Dh) and their key mask (rows, 1, 1, S)."""
        rows, device, dtype = self.batch_size, self.lengths.device, self.keys[0].dtype
        shape = (rows, n_heads, source_capacity, head_dim)
        mask = torch.zeros(rows, 1, 1, source_capacity, dtype=torch.bool, device=device)
        mask[..., 0] = True  # padding rows: one finite key to attend to
        keys, values = kv_buffers(n_layers, shape, dtype, device)
        self.cross = CrossAttentionMemory(keys=keys, values=values, mask=mask,
                                          sources=torch.arange(rows, device=device))

    def view(self, rows: int) -> StaticKVCache:
        """The first ``rows`` rows, sharing this cache's memory (a smaller captured batch size)."""
        cross = None
        if self.cross is not None:
            cross = CrossAttentionMemory(keys=[k[:rows] for k in self.cross.keys],
                                         values=[v[:rows] for v in self.cross.values],
                                         mask=self.cross.mask[:rows], sources=self.cross.sources[:rows])
        return StaticKVCache(keys=[k[:rows] for k in self.keys], values=[v[:rows] for v in self.values],
                             lengths=self.lengths[:rows], max_length=self.max_length, uniform=False, cross=cross,
                             key_positions=self.key_positions)

    def begin_step(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions (B, t) = each row's length onwards, and the mask (B, 1, t, capacity) of the keys up to each.
        ``max_length`` becomes capacity - t: a step of t tokens sees max_length + t = capacity keys (what T5's
        relative position bias spans), whatever the rows' own lengths."""
        self.max_length = self.capacity - num_tokens
        positions = self.lengths[:, None] + torch.arange(num_tokens, device=self.lengths.device)
        positions = positions.clamp(max=self.capacity - 1)  # a padding row never writes out of bounds
        self._write_positions = positions
        return positions, (self.key_positions <= positions[:, :, None])[:, None]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter this step's (B, H, t, Dh) keys/values of ``layer`` to each row's positions; return the buffers."""
        positions = self._write_positions
        if positions is None:
            raise RuntimeError("StaticKVCache.write called before begin_step")
        keys, values = self.keys[layer], self.values[layer]
        index = positions[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])  # (B, H, t, Dh)
        keys.scatter_(2, index, k.to(keys.dtype))
        values.scatter_(2, index, v.to(values.dtype))
        return keys, values

    def end_step(self, advance: torch.Tensor | int, max_advance: int | None = None) -> None:
        """Advance every row by ``advance`` positions, in place (the graph reads and writes this same tensor)."""
        if not isinstance(advance, int) or advance < 1:
            raise ValueError("a static cache advances every row alike, by a positive int")
        self.lengths.add_(advance)
        self._write_positions = None

    def load(self, cache: KVCache) -> None:
        """Copy the rows of an eagerly prefilled ``cache`` (uniform or right-padded) into rows 0..n-1; later rows get
        length 0 (padding)."""
        n, used = cache.batch_size, cache.max_length
        if n > self.batch_size or used >= self.capacity:
            raise ValueError(f"a cache of {n} rows x {used} positions does not fit {self.batch_size} x {self.capacity}")
        if cache.prefix is not None:
            raise ValueError("a static cache holds no shared prefix")
        for mine, theirs in zip(self.keys + self.values, cache.keys + cache.values, strict=True):
            mine[:n, :, :used] = theirs[:, :, :used]
        self.lengths[:n] = cache.lengths
        self.lengths[n:] = 0
        if cache.cross is not None:
            self._load_cross(cache.cross, n)

    def _load_cross(self, cross: CrossAttentionMemory, n: int) -> None:
        if self.cross is None:
            raise ValueError("this static cache has no cross-attention buffers (add_cross)")
        source = cross.mask.shape[-1]
        if source > self.cross.mask.shape[-1]:
            raise ValueError(f"a source of {source} tokens exceeds the static cross-attention buffers")
        for mine, theirs in zip(self.cross.keys + self.cross.values, cross.keys + cross.values, strict=True):
            mine[:n, :, :source] = theirs
            mine[:n, :, source:] = 0
        self.cross.mask[:n] = False
        self.cross.mask[:n, ..., :source] = cross.mask
        self.cross.mask[n:] = False
        self.cross.mask[n:, ..., 0] = True

    def select(self, index: torch.Tensor, tails: torch.Tensor | None = None, used: int | None = None) -> None:
        """Rows 0..m-1 become old rows ``index`` (m,) (beams reordered, finished rows dropped, samples spread), by
        index copies into the same buffers; rows from m on become padding (length 0). ``tails`` (as for
        :meth:`KVCache.select`, when m keeps the row count) limits the self-attention copy to the positions that may
        differ, up to ``used`` (the longest row's length; None: the capacity)."""
        m = index.shape[0]
        if m > self.batch_size:
            raise ValueError(f"{m} rows exceed the static cache's {self.batch_size}")
        targets = torch.arange(m, device=index.device)
        moved = index != targets
        start = 0
        if tails is not None and used is not None:
            lengths = self.lengths[:m]
            start = max(int(torch.where(moved, lengths - tails, used).min()), 0)
        stop = self.capacity if used is None else used
        rows, sources = targets[moved], index[moved]
        if rows.numel():
            for buffer in self.keys + self.values:
                window = buffer[:, :, start:stop]
                window[rows] = window.index_select(0, sources)
            if self.cross is not None:
                for buffer in [*self.cross.keys, *self.cross.values, self.cross.mask]:
                    buffer[rows] = buffer.index_select(0, sources)
        self.lengths[:m] = self.lengths.index_select(0, index)
        self.lengths[m:] = 0
        if self.cross is not None:
            self.cross.mask[m:] = False
            self.cross.mask[m:, ..., 0] = True
