"""The decoder's key/value cache: an explicit object passed to every decoding step.

Each row of the batch keeps its own length, so rows can sit at different positions: a right-padded
prompt batch, beams, and the serving engine's continuously batched requests all share one layout.
Self-attention K/V live in preallocated buffers (B, H, capacity, Dh) that grow in chunks; a new
token of row b is written in place at position ``lengths[b]``. Keys at positions a query may not
see (padding, or beyond the query's own position) are masked by ``attention_mask``.
While every row holds the same number of tokens (``uniform``: offline greedy and beam search,
seq2seq decoding) a step writes one slice for all rows and a single new token needs no mask.
Cross-attention K/V (encoder-decoder) are computed once per source and only reordered.
Rows may start from a shared prefix (model.shared_prefix: cached prompt blocks read in place): their buffers
then hold their own positions only, and a row's token positions count from its prefix's length.
Sliding-window layers keep every position too; :func:`within_window` narrows their mask to the window.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model import huge_pages, native
from model.shared_prefix import SharedPrefix

GROWTH = 64  # positions added when a buffer runs out; amortises the copy


@dataclass
class CrossAttentionMemory:
    """Per-layer encoder keys/values (B, H, S, Dh) and the source padding mask (B, 1, 1, S)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    sources: torch.Tensor | None = None  # (B,) which encoded source each row holds; rows alike share K/V

    def __post_init__(self) -> None:
        if self.sources is None:
            self.sources = torch.arange(self.mask.shape[0], device=self.mask.device)

    @functools.cached_property
    def group_size(self) -> int:
        """g > 1 when the rows come in consecutive runs of exactly g rows of one source (the beams of a
        sentence): their K/V rows are copies, so attention may read one row per run. 1 otherwise."""
        rows = self.sources.shape[0]
        if rows < 2:
            return 1
        group = int((self.sources != self.sources[0]).long().argmax()) or rows  # length of the first run
        if group == 1 or rows % group:
            return 1
        runs = self.sources.view(-1, group)
        return group if bool((runs == runs[:, :1]).all()) else 1

    @functools.cached_property
    def leads(self) -> torch.Tensor | None:
        """Each row's run's first row, the runs consecutive rows of one source of any lengths (requests of different
        beam widths side by side): the C++ step's cross-attention reads that row's copy for the whole run. None where
        every row is its own source or :attr:`group_size` runs serve (their queries attend together)."""
        rows = self.sources.shape[0]
        if rows < 2 or self.group_size > 1:
            return None
        starts = torch.ones(rows, dtype=torch.bool, device=self.sources.device)
        starts[1:] = self.sources[1:] != self.sources[:-1]
        if bool(starts.all()):
            return None
        index = torch.arange(rows, device=self.sources.device)
        return torch.where(starts, index, 0).cummax(0).values

    @functools.cached_property
    def attention_mask(self) -> torch.Tensor | None:
        """``mask`` for attention, or None when no source has padding (SDPA's unmasked path is faster)."""
        return None if bool(self.mask.all()) else self.mask

    @classmethod
    def of_sources(cls, sources: list[torch.Tensor]) -> CrossAttentionMemory:
        """The memory of rows whose sources' K/V were computed apart: each (layers, 2, H, S_i, Dh), right-padded
        to the longest (the padding masked), as model.prefix_cache keeps them."""
        longest = max(kv.shape[3] for kv in sources)
        layers = sources[0].shape[0]
        lengths = torch.tensor([kv.shape[3] for kv in sources], device=sources[0].device)
        mask = (torch.arange(longest, device=lengths.device) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
        return cls(keys=[_cat_padded([kv[layer, 0][None] for kv in sources], 2, longest) for layer in range(layers)],
                   values=[_cat_padded([kv[layer, 1][None] for kv in sources], 2, longest) for layer in range(layers)],
                   mask=mask)

    def select(self, index: torch.Tensor) -> CrossAttentionMemory:
        """The memory for rows ``index``; beams reordered within their source keep the K/V as they are."""
        sources = self.sources.index_select(0, index)
        if sources.shape == self.sources.shape and torch.equal(sources, self.sources):
            return self
        return CrossAttentionMemory(
            keys=[k.index_select(0, index) for k in self.keys],
            values=[v.index_select(0, index) for v in self.values],
            mask=self.mask.index_select(0, index),
            sources=sources,
        )


@dataclass
class KVCache:
    """Self-attention K/V for every decoder layer plus per-row lengths."""

    keys: list[torch.Tensor]  # per layer (B, H, capacity, Dh)
    values: list[torch.Tensor]
    lengths: torch.Tensor  # (B,) tokens already cached per row in its own buffer
    max_length: int = 0  # host-side upper bound of lengths, to slice buffers without a device sync
    cross: CrossAttentionMemory | None = None
    uniform: bool = True  # every row holds exactly max_length tokens (host-side, no device sync)
    prefix: SharedPrefix | None = None  # cached blocks each row reads ahead of its own K/V
    # Beams: each row's first beam_shared[r] positions equal row beam_lead[r]'s, its run's first (a sentence's beams
    # are a run of rows; share_beam_prefix); the C++ step's attention reads them there once. None: each row its own.
    beam_lead: torch.Tensor | None = None
    beam_shared: torch.Tensor | None = None
    _write_positions: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def empty(
        cls,
        n_layers: int,
        batch: int,
        n_heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> KVCache:
        shape = (batch, n_heads, max(capacity, 1), head_dim)
        keys, values = kv_buffers(n_layers, shape, dtype, device)
        return cls(keys=keys, values=values, lengths=torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Memory this cache holds: its buffers (self- and cross-attention) and the prefix blocks it reads (once)."""
        tensors = self.keys + self.values + (self.cross.keys + self.cross.values if self.cross is not None else [])
        own = sum(t.numel() * t.element_size() for t in tensors)
        return own + (self.prefix.nbytes if self.prefix is not None else 0)

    def begin_step(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prepare to append ``num_tokens`` per row; return (positions (B, t), attention mask (B|1, 1, t, K)).

        A query at position p sees every cached key at a position <= p. Right padding is therefore
        safe: a real token never sees the pad slots after it, and the next token overwrites them.
        The mask is None when every visible key is allowed (uniform rows, one new token). It covers the
        rows' own buffers; the positions returned (for position embeddings) count a shared prefix too.
        """
        positions, mask = self._begin_own_step(num_tokens)
        if self.prefix is not None:
            positions = positions + self.prefix.lengths[:, None]
        return positions, mask

    def _begin_own_step(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._reserve(self.max_length + num_tokens)
        device = self.lengths.device
        if self.uniform and num_tokens == 1:  # every visible key: no mask
            # Each row's next position is its length: a view of lengths (end_step makes a new tensor), where an arange
            # took 30 us of a SmolLM2 int8 batch-1 step with the caches cold from the weights.
            positions = self._write_positions = self.lengths.unsqueeze(1)
            return positions, None
        if self.uniform:
            start = self.max_length
            positions = torch.arange(start, start + num_tokens, device=device).expand(self.batch_size, num_tokens)
            self._write_positions = positions
            key_positions = torch.arange(start + num_tokens, device=device)
            return positions, (key_positions[None, :] <= positions[0][:, None])[None, None]  # (1, 1, t, K)
        key_positions = torch.arange(self.max_length + num_tokens, device=device)
        positions = self.lengths[:, None] + torch.arange(num_tokens, device=device)  # (B, t)
        self._write_positions = positions
        mask = key_positions[None, None, :] <= positions[:, :, None]  # (B, t, K)
        return positions, mask[:, None]

    @property
    def write_positions(self) -> torch.Tensor | None:
        """Where this step writes each row's new tokens (B, t), set by :meth:`begin_step`; None between steps."""
        return self._write_positions

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's (B, H, t, Dh) keys/values of ``layer``; return views of all visible K/V."""
        positions = self._write_positions
        if positions is None:
            raise RuntimeError("KVCache.write called before begin_step")
        visible = self.max_length + positions.shape[1]
        if self.uniform:  # one slice for every row
            keys, values, start = self.keys[layer], self.values[layer], self.max_length
            keys.narrow(2, start, visible - start).copy_(k)
            values.narrow(2, start, visible - start).copy_(v)
            return keys.narrow(2, 0, visible), values.narrow(2, 0, visible)
        rows = torch.arange(self.batch_size, device=positions.device)[:, None]
        # Advanced indices on dims 0 and 2 put the (B, t) index dims first: (B, t, H, Dh).
        self.keys[layer][rows, :, positions] = k.transpose(1, 2).to(self.keys[layer].dtype)
        self.values[layer][rows, :, positions] = v.transpose(1, 2).to(self.values[layer].dtype)
        return self.keys[layer][:, :, :visible], self.values[layer][:, :, :visible]

    def share_beam_prefix(self, shared: tuple[torch.Tensor, torch.Tensor] | None,
                          generated: int | torch.Tensor) -> None:
        """The beams' shared history, from the search (:meth:`model.search.Search.shared_history`): per row its run's
        first row (its lead) and the generated tokens its history shares with the lead's, or None. The positions
        before the generated tokens (the decoder's start, a prompt) and those of the shared tokens hold the same K/V in
        every row of a run, bit for bit: each token prefix was computed once, in one row, and copied by the reorders
        (:meth:`select`). ``generated``: the tokens generated so far (per row, or one count for all), the last not
        yet in the cache. Rows of different lengths are fine (a run's rows have one length); not with a shared prefix
        cache, nor off the CPU: there every row reads its own positions."""
        if shared is None or self.prefix is not None or self.keys[0].device.type != "cpu":
            self._read_own_rows()
            return
        leads, tokens = shared
        before = self.lengths - (generated - 1)  # each row's positions ahead of its generated tokens
        self.beam_lead, self.beam_shared = leads, torch.minimum(tokens + before, self.lengths)

    def _read_own_rows(self) -> None:
        """Forget the beams' sharing (:meth:`share_beam_prefix`): every row reads its own positions."""
        self.beam_lead = self.beam_shared = None

    def end_step(self, advance: torch.Tensor | int, max_advance: int | None = None) -> None:
        """Advance lengths by ``advance`` per row (an int, or (B,) for a right-padded prefill)."""
        self.lengths = self.lengths + advance
        if isinstance(advance, int):
            self.max_length += advance
        else:
            longest = int(max_advance or advance.max())
            self.uniform = self.uniform and bool((advance == longest).all())
            self.max_length += longest
        self._write_positions = None

    def truncate(self, lengths: torch.Tensor) -> None:
        """Forget each row's positions from ``lengths`` (B,) on (at most the current lengths): speculative tokens
        that were rejected. Their keys and values stay finite, masked, and are overwritten by the next steps."""
        self.lengths = lengths
        self.max_length = int(lengths.max()) if lengths.numel() else 0
        self.uniform = bool((lengths == self.max_length).all())
        self._read_own_rows()

    def snapshot(self) -> tuple[torch.Tensor, int, bool]:
        """What a step changes in the rows' bookkeeping; :meth:`rollback` returns to it."""
        return self.lengths, self.max_length, self.uniform

    def rollback(self, snapshot: tuple[torch.Tensor, int, bool]) -> None:
        """Undo a step that did not finish (the written keys and values beyond the lengths are ignored, and
        overwritten by the next step)."""
        self.lengths, self.max_length, self.uniform = snapshot
        self._write_positions = None
        self._read_own_rows()

    def select(self, index: torch.Tensor, tails: torch.Tensor | None = None) -> None:
        """Keep, reorder or duplicate rows: row i becomes old row ``index[i]`` (beams, finished rows).

        When the row count stays (beams reordered), only the rows that change are copied, in place:
        a shallow copy of this cache sharing its buffers sees the change too. Otherwise new buffers.
        ``tails`` (a search's :attr:`model.search.Search.tails`): per row, how many of its last positions may
        differ from old row ``index[i]``'s; the positions before hold the same tokens and are not copied.
        """
        self._read_own_rows()  # the sharing was the old rows'
        if index.shape[0] == self.batch_size:
            self._reorder_in_place(index, tails)
        else:
            self._select_rows(index)
        self.lengths = self.lengths.index_select(0, index)
        if self.cross is not None:
            self.cross = self.cross.select(index)
        if self.prefix is not None:
            self.prefix = self.prefix.select(index)

    def _reorder_in_place(self, index: torch.Tensor, tails: torch.Tensor | None) -> None:
        """Copy the used positions of old row ``index[i]`` into row i wherever they differ.

        Beam search moves a fraction of its rows per step, and a moved beam shares its new parent's history but
        for its last few tokens (``tails``): copying those rows' differing window alone (gathered before any
        write, so a row that is both a source and a target is read first) saves most of the traffic of a full
        reorder. Tails beyond the used prefix keep finite values, as ``select`` requires. On CPU buffers the
        kernels copy every buffer's windows in one call (model/kernels/elementwise.cpp).
        """
        rows = index.tolist()
        moved = [i for i, source in enumerate(rows) if source != i]
        if not moved:
            return
        sources = [rows[i] for i in moved]
        start = 0
        if tails is not None:  # the earliest position any moved row may differ at
            lengths, differing = self.lengths.tolist(), tails.tolist()
            start = max(min(lengths[i] - differing[i] for i in moved), 0)
        buffers = self.keys + self.values
        kernels = native.kernels()
        if kernels is not None and kernels.rows_copy_windows(buffers, moved, sources, start, self.max_length):
            return
        targets, parents = torch.tensor(moved, device=index.device), torch.tensor(sources, device=index.device)
        for buffer in buffers:
            window = buffer[:, :, start: self.max_length]
            window[targets] = window.index_select(0, parents)

    def _select_rows(self, index: torch.Tensor) -> None:
        """New buffers holding old rows ``index`` in the used positions; the rest zeroed or left unset.

        Uniform rows never read a position before writing it, so their tail may hold garbage; rows of
        different lengths read (masked) positions past their own length, which must hold finite values.
        """
        used, like = self.max_length, self.keys[0]
        shape = (index.shape[0], *like.shape[1:])
        keys, values = kv_buffers(len(self.keys), shape, like.dtype, like.device, zeroed=not self.uniform)
        for out, buffer in zip(keys + values, self.keys + self.values, strict=True):
            out[:, :, :used] = buffer[:, :, :used].index_select(0, index)
        self.keys, self.values = keys, values

    @classmethod
    def concat(cls, caches: list[KVCache]) -> KVCache:
        """Stack the rows of several caches (continuous batching: requests joining a running batch)."""
        keys, values = _joined_rows(caches)
        joined = cls(
            keys=keys,
            values=values,
            lengths=torch.cat([c.lengths for c in caches]),
            max_length=max(c.max_length for c in caches),
            uniform=all(c.uniform for c in caches) and len({c.max_length for c in caches}) == 1,
            prefix=SharedPrefix.concat([c.prefix for c in caches], [c.batch_size for c in caches]),
        )
        if not joined.uniform:  # shorter rows now read (masked) past their own cache's end: make it finite
            start = 0
            for c in caches:
                if c.uniform:
                    for buffer in joined.keys + joined.values:
                        buffer[start : start + c.batch_size, :, c.max_length :] = 0
                start += c.batch_size
        if caches[0].cross is not None:
            source_len = max(c.cross.mask.shape[-1] for c in caches)
            n_layers = len(caches[0].cross.keys)
            joined.cross = CrossAttentionMemory(
                keys=[_cat_padded([c.cross.keys[i] for c in caches], 2, source_len) for i in range(n_layers)],
                values=[_cat_padded([c.cross.values[i] for c in caches], 2, source_len) for i in range(n_layers)],
                mask=_cat_padded([c.cross.mask for c in caches], 3, source_len),
                sources=_offset_sources([c.cross.sources for c in caches]),
            )
        return joined

    def _reserve(self, needed: int) -> None:
        if needed > self.capacity:
            self.resize(max(needed, self.capacity + GROWTH))

    def resize(self, capacity: int) -> None:
        """New buffers of ``capacity`` positions holding today's first ones (zeros past them), on 2 MB pages as
        :meth:`empty` makes them (growth; the engine's compaction after long rows left)."""
        like, kept = self.keys[0], min(capacity, self.capacity)
        shape = (*like.shape[:2], capacity, like.shape[3])
        keys, values = kv_buffers(len(self.keys), shape, like.dtype, like.device)
        for out, buffer in zip(keys + values, self.keys + self.values, strict=True):
            out[:, :, :kept] = buffer[:, :, :kept]
        self.keys, self.values = keys, values


def within_window(mask: torch.Tensor | None, queries: torch.Tensor, keys: int, window: int) -> torch.Tensor:
    """``mask`` (B|1, 1, t, K) (None: every key) narrowed to a sliding window: a query at position q (``queries``
    (B|1, t), positions among the K = ``keys`` keys) sees the keys at positions k with q - k < ``window``."""
    behind = queries[:, None, :, None] - torch.arange(keys, device=queries.device)  # (B|1, 1, t, K)
    near = behind < window
    return near if mask is None else mask & near


def _cat_padded(tensors: list[torch.Tensor], dim: int, size: int) -> torch.Tensor:
    """Concatenate on dim 0 after zero/False-padding ``dim`` of each tensor up to ``size``."""
    padded = []
    for t in tensors:
        missing = size - t.shape[dim]
        if missing:
            pad = [0, 0] * (t.dim() - 1 - dim) + [0, missing]
            t = F.pad(t, pad)
        padded.append(t)
    return torch.cat(padded, dim=0)


def kv_buffers(n_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
               zeroed: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's K and V buffers of ``shape`` (zeroed, or left unset where not ``zeroed``): views of one mapping
    on 2 MB pages where together they span 2 MB or more (model.huge_pages.buffers). A decoding step after a long
    prompt reads them all once, and over 4 KB pages that read walks page tables mid-stream (25 MB at batch 1 span
    ~6,300 pages, twice what the TLB holds): SmolLM2's 30 layers of decode attention at 512 keys from memory took
    1.47-1.67 ms on 4 KB pages and 1.26-1.31 ms on 2 MB pages, its int8 steps after a 512-token prompt 0.96-0.99x
    (session 30, docs/benchmarks.md). A fresh cache costs ~1 ms more to fault in than a reused heap; growth, joins and
    row selections make their new buffers here too, so a cache keeps its pages."""
    buffers = huge_pages.buffers(2 * n_layers, shape, dtype, device, zeroed)
    return buffers[:n_layers], buffers[n_layers:]


def _joined_rows(caches: list[KVCache]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every cache's rows stacked per K and V buffer (sum B_i, H, max capacity_i, Dh), zero past each cache's own
    capacity (as ``_cat_padded`` pads)."""
    like = caches[0].keys[0]
    rows, capacity = sum(c.batch_size for c in caches), max(c.capacity for c in caches)
    keys, values = kv_buffers(len(caches[0].keys), (rows, like.shape[1], capacity, like.shape[3]), like.dtype,
                              like.device)
    start = 0
    for cache in caches:
        for out, part in zip(keys + values, cache.keys + cache.values, strict=True):
            out[start: start + cache.batch_size, :, : cache.capacity] = part
        start += cache.batch_size
    return keys, values


def _offset_sources(sources: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-cache source ids, keeping ids of different caches distinct."""
    shifted, offset = [], 0
    for s in sources:
        shifted.append(s + offset)
        offset += int(s.max()) + 1 if s.numel() else 0
    return torch.cat(shifted)
