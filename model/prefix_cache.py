"""Prefix caching: computed keys/values reused across requests, under a byte budget.

Causal LM: a prompt's self-attention K/V are kept in blocks of ``BLOCK_TOKENS`` positions. A block is
keyed by (namespace, its parent block, its own tokens), so it stands for the whole prefix that ends
with it: prompts with a common start share their leading blocks (stored once), and a later prompt
reuses the longest chain of blocks it finds from its first token on (vLLM's automatic prefix caching,
with exact keys instead of hashes). The namespace is the adapter a row runs with (None for the base
model): K/V computed under one adapter are never reused under another.
Seq2seq: an identical source (same namespace) reuses its cross-attention K/V, all layers in one entry.
Rotary models cache their keys after rotation at their absolute positions: a block stands for its tokens at the
positions of a prompt's start, the same for every prompt that reads it. Under grouped-query attention a block holds
the KV heads only. Sliding-window layers are not served (:func:`prefix_cache_serves`).

Entries live in one LRU under the budget. A chain is touched from its deepest block to its root, so a
block is never older than any block below it, and eviction takes leaves first; a block evicted before
its children (harmless if it happened) only makes them unreachable until they age out. Running rows read
blocks in place (model.shared_prefix): a block a running batch references is never evicted (its reference
count says so), and when only such blocks are left a new block is not kept. Not thread-safe: one model's
worker thread owns its cache.

Storing a prompt nobody repeats must cost next to nothing (vLLM keeps prefix caching on for that reason). So a
block is copied once, straight into a slot of a :class:`BlockPool` (slabs of same-shape blocks, grown up to the
budget): a full cache evicts a block and writes the next one into its slot, allocating nothing, and eviction takes
the least recently used block in O(1) (entries a running batch reads are moved to the recent end as they are
met). The budget bounds the blocks' bytes, and so the slabs' bytes; each block also adds ~2 KiB of RSS that the
budget does not count (:data:`ENTRY_OVERHEAD_BYTES`), so the RSS the cache adds stays within 1.2x of its budget
for blocks of 10 KiB or more (layers x d_model >= 80 in fp32: any real model; docs/benchmarks.md, issue 33).
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
from array import array
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from model.config import TransformerConfig

BLOCK_TOKENS = 16  # positions per cached block: the unit of reuse (a prompt's last partial block is not kept)
# A BlockPool grows by slabs of up to this size (at least one block each): glibc's largest mmap threshold, so a full
# slab is a mapping of its own, out of the heap's way, and pages of it no block was written to stay unresident.
SLAB_BYTES = 32 << 20
# RSS a cached block adds besides its K/V: its key, Entry and tensor view (~1.2 KiB on CPython 3.11 / torch 2.13)
# and allocator slack, as measured by `python -m benchmarks.prefix_cache --distinct`.
ENTRY_OVERHEAD_BYTES = 2048


def _held_by_one_attribute() -> int:
    """What ``sys.getrefcount`` says of an object one attribute holds, asked through that attribute."""
    holder = types.SimpleNamespace(value=object())
    return sys.getrefcount(holder.value)


_UNREFERENCED = _held_by_one_attribute()  # an entry's tensor that only the entry holds


def prefix_cache_serves(config: TransformerConfig) -> bool:
    """Whether a prefix cache may serve a model of ``config``: every block but sliding windows, whose masks count
    positions in the rows' own buffers (model.attention refuses a shared prefix under a window)."""
    return config.sliding_window is None


@dataclass(eq=False, slots=True)
class Entry:
    """One cached tensor; ``kv`` is (layers, 2, heads, tokens, head_dim): keys then values per layer."""

    kv: torch.Tensor
    key: Hashable
    serial: int  # children's keys name their parent by it (never reused, unlike id())
    pooled: bool = False  # ``kv`` is a BlockPool slot (given back on eviction), not a tensor of its own
    nbytes: int = field(init=False)  # what it keeps allocated: its slot, or the whole storage ``kv`` views

    def __post_init__(self) -> None:
        kv = self.kv
        self.nbytes = kv.numel() * kv.element_size() if self.pooled else kv.untyped_storage().nbytes()

    @property
    def tokens(self) -> int:
        return self.kv.shape[3]

    @property
    def in_use(self) -> bool:
        """Whether something besides this entry holds its tensor: a running batch reading the block in place."""
        return sys.getrefcount(self.kv) > _UNREFERENCED


@dataclass(eq=False)
class BlockPool:
    """Same-shape block tensors carved from slabs that are never given back (vLLM's block pool, grown on demand):
    a block the cache evicts is the next one written, so a full cache allocates nothing, and its blocks do not
    pepper the heap between a prefill's temporaries (which kept ~2x the budget resident, issue 33)."""

    shape: tuple[int, ...]  # one block: (layers, 2, heads, BLOCK_TOKENS, head_dim)
    dtype: torch.dtype
    device: torch.device
    slabs: list[torch.Tensor] = field(default_factory=list)  # each (blocks, *shape)
    free: list[torch.Tensor] = field(default_factory=list)  # slots no entry holds

    @functools.cached_property
    def block_bytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of every slab, slots in use or free."""
        return sum(slab.numel() * slab.element_size() for slab in self.slabs)

    def grow(self, most: int) -> None:
        """Add a slab of up to ``most`` (>= 1) blocks."""
        blocks = max(1, min(most, SLAB_BYTES // self.block_bytes))
        with torch.inference_mode(False):  # normal tensors: writable whether or not a later store runs in that mode
            slab = torch.empty((blocks, *self.shape), dtype=self.dtype, device=self.device)
            self.slabs.append(slab)
            self.free.extend(slab.unbind(0))


@dataclass
class PrefixCacheStats:
    """Cumulative counts since the cache was made (the service exports them as metrics)."""

    queried_tokens: int = 0  # prompt (or source) tokens looked up
    hit_tokens: int = 0  # of which were found


@dataclass
class PrefixCache:
    """Prompt blocks (causal LM) and encoded sources (seq2seq) of one model, LRU under ``budget_bytes``."""

    budget_bytes: int
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    nbytes: int = 0  # the entries' bytes (Entry.nbytes), what the budget bounds
    pool: BlockPool | None = None  # the blocks' slots, made with the first block
    _entries: OrderedDict[Hashable, Entry] = field(default_factory=OrderedDict)  # least recently used first
    _serials: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __len__(self) -> int:
        return len(self._entries)

    # ---- causal LM prompts -----------------------------------------------------------------------

    def match(self, namespace: str | None, prompt: Sequence[int], count: bool = True) -> list[Entry]:
        """The longest chain of cached blocks that starts ``prompt`` and leaves at least its last token to compute
        (whose logits are needed). Touches the chain; ``count`` adds the lookup to ``stats``."""
        chain = self._walk(namespace, prompt, (len(prompt) - 1) // BLOCK_TOKENS)
        self._touch(chain)
        if count:
            self.stats.queried_tokens += len(prompt)
            self.stats.hit_tokens += len(chain) * BLOCK_TOKENS
        return chain

    def cached_tokens(self, namespace: str | None, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` :meth:`match` would reuse (no touch, not counted)."""
        return len(self._walk(namespace, prompt, (len(prompt) - 1) // BLOCK_TOKENS)) * BLOCK_TOKENS

    def store_prompt(self, namespace: str | None, prompt: Sequence[int], keys: Sequence[torch.Tensor],
                     values: Sequence[torch.Tensor], offset: int = 0) -> None:
        """Keep the full blocks of ``prompt`` not cached yet; ``keys`` / ``values`` per layer (heads, >= len - offset,
        head_dim) hold the prompt's K/V from position ``offset`` on (one row of a KV cache that read its first
        ``offset`` positions from cached blocks). Nothing is kept when those blocks were evicted meanwhile: the new
        ones would hang from no chain. Each block is copied once, into a pool slot."""
        blocks = len(prompt) // BLOCK_TOKENS
        chain = self._walk(namespace, prompt, blocks)
        self._touch(chain)  # the chain so far is not evicted for its own new blocks
        if len(chain) == blocks or len(chain) * BLOCK_TOKENS < offset:
            return
        start, end = len(chain) * BLOCK_TOKENS - offset, blocks * BLOCK_TOKENS - offset
        # Per layer, keys then values: each new block's (heads, BLOCK_TOKENS, head_dim) views, in order.
        parts = [t[:, start:end].split(BLOCK_TOKENS, dim=1) for k, v in zip(keys, values, strict=True) for t in (k, v)]
        shape = (len(keys), 2, keys[0].shape[0], BLOCK_TOKENS, keys[0].shape[2])
        parent = chain[-1].serial if chain else 0
        with torch.no_grad():
            for i, block in enumerate(zip(*parts, strict=True)):
                slot = self._slot(shape, keys[0])
                if slot is None:
                    break
                torch.stack(block, out=slot.view(-1, *shape[2:]))
                first = offset + start + i * BLOCK_TOKENS
                entry = self._add(_block_key(namespace, parent, prompt[first: first + BLOCK_TOKENS]), slot, True)
                chain.append(entry)
                parent = entry.serial
        self._touch(chain)

    def _walk(self, namespace: str | None, prompt: Sequence[int], blocks: int) -> list[Entry]:
        chain: list[Entry] = []
        parent = 0
        for start in range(0, blocks * BLOCK_TOKENS, BLOCK_TOKENS):
            entry = self._entries.get(_block_key(namespace, parent, prompt[start: start + BLOCK_TOKENS]))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.serial
        return chain

    def _slot(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """A free block slot: the pool's, a new slab's while the budget allows, else one eviction frees; None when
        every block left is in use."""
        if self.pool is None:
            self.pool = BlockPool(shape, like.dtype, like.device)
        elif self.pool.shape != shape or self.pool.dtype != like.dtype or self.pool.device != like.device:
            raise ValueError(f"a block of {tuple(shape)} {like.dtype} on {like.device} in a cache of "
                             f"{self.pool.shape} {self.pool.dtype} on {self.pool.device} blocks: one model per cache")
        pool = self.pool
        while not pool.free:  # each turn grows the pool, frees a slot, or evicts a source: it ends
            room = (self.budget_bytes - self.nbytes) // pool.block_bytes
            if room > 0:
                pool.grow(room)
            elif not self._evict_one():
                return None
        return pool.free.pop()

    # ---- seq2seq sources ---------------------------------------------------------------------------

    def match_source(self, namespace: str | None, source: Sequence[int]) -> Entry | None:
        """The cached cross-attention K/V of ``source``, or None (counted in ``stats``)."""
        entry = self._entries.get(self._source_key(namespace, source))
        self.stats.queried_tokens += len(source)
        if entry is not None:
            self.stats.hit_tokens += len(source)
            self._touch([entry])
        return entry

    def store_source(self, namespace: str | None, source: Sequence[int], kv: torch.Tensor) -> Entry:
        """Keep ``kv`` (layers, 2, heads, len(source), head_dim), the source's cross-attention K/V; returns its entry
        (which outlives the cache's budget only as long as the caller holds it). Counted by its whole storage."""
        entry = Entry(kv, self._source_key(namespace, source), 0)
        if not self._make_room(entry.nbytes):
            return entry
        return self._add(entry.key, kv)

    @staticmethod
    def _source_key(namespace: str | None, source: Sequence[int]) -> Hashable:
        return (namespace, "source", tuple(source))

    # ---- the LRU -------------------------------------------------------------------------------------

    def _add(self, key: Hashable, kv: torch.Tensor, pooled: bool = False) -> Entry:
        entry = Entry(kv, key, next(self._serials), pooled)
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        return entry

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used entries that no running batch reads until ``nbytes`` more fit the budget;
        False when they cannot (the rest is in use)."""
        if nbytes > self.budget_bytes:
            return False
        while self.nbytes + nbytes > self.budget_bytes:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        """Evict the least recently used entry no running batch reads (a pooled one gives its slot back); entries
        met in use move to the recent end (they are being read). O(1) but for those; False when all are in use."""
        for _ in range(len(self._entries)):
            key, entry = next(iter(self._entries.items()))
            if entry.in_use:
                self._entries.move_to_end(key)
                continue
            del self._entries[key]
            self.nbytes -= entry.nbytes
            if entry.pooled:
                self.pool.free.append(entry.kv)
            return True
        return False

    def _touch(self, chain: list[Entry]) -> None:
        """Most recently used, deepest first: the root ends newest, so children are evicted before parents."""
        for entry in reversed(chain):
            if self._entries.get(entry.key) is entry:  # not evicted meanwhile
                self._entries.move_to_end(entry.key)


def _block_key(namespace: str | None, parent: int, tokens: Sequence[int]) -> Hashable:
    """A block's exact key; its tokens as bytes (hashed once, a sixth of a tuple of ints' memory)."""
    return namespace, parent, array("q", tokens).tobytes()


def shared_prefixes(prompts: Sequence[Sequence[int]], namespaces: Sequence[str | None]) -> list[tuple[int, int]]:
    """(row, tokens) for each longest block-aligned prefix that two or more prompts of one batch share (under one
    namespace), leaving each its last token; a prefix of another one listed is left out. Computing these once
    before the batch lets every row that shares one reuse it (a burst of requests with one system prompt).
    Blocks are compared by hash: a collision costs a needless prefix computation, never a wrong reuse."""
    chains: list[list[int]] = []
    for prompt, namespace in zip(prompts, namespaces, strict=True):
        key, keys = hash(namespace), []
        for start in range(0, (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS, BLOCK_TOKENS):
            key = hash((key, tuple(prompt[start: start + BLOCK_TOKENS])))
            keys.append(key)
        chains.append(keys)
    counts = Counter(key for keys in chains for key in keys)
    deepest: dict[int, tuple[int, int]] = {}  # last shared key -> (a row that has it, depth in blocks)
    for row, keys in enumerate(chains):
        depth = next((i for i, key in enumerate(keys) if counts[key] < 2), len(keys))
        if depth:
            deepest.setdefault(keys[depth - 1], (row, depth))
    inner = {key for row, depth in deepest.values() for key in chains[row][: depth - 1]}
    return [(row, depth * BLOCK_TOKENS) for key, (row, depth) in deepest.items() if key not in inner]
