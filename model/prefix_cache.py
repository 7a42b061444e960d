"""Prefix caching: computed keys/values reused across requests, under a byte budget.

Causal LM: a prompt's self-attention K/V are kept in blocks of ``BLOCK_TOKENS`` positions. A block is
keyed by (namespace, its parent block, its own tokens), so it stands for the whole prefix that ends
with it: prompts with a common start share their leading blocks (stored once), and a later prompt
reuses the longest chain of blocks it finds from its first token on (vLLM's automatic prefix caching,
with exact keys instead of hashes). The namespace is the adapter a row runs with (None for the base
model): K/V computed under one adapter are never reused under another.
Seq2seq: an identical source (same namespace) reuses its cross-attention K/V, all layers in one entry.

Entries live in one LRU under the budget. A chain is touched from its deepest block to its root, so a
block is never older than any block below it, and eviction takes leaves first; a block evicted before
its children (harmless if it happened) only makes them unreachable until they age out. Running rows read
blocks in place (model.shared_prefix): a block a running batch references is never evicted (its reference
count says so), and when only such blocks are left a new block is not kept. Not thread-safe: one model's
worker thread owns its cache.
"""

from __future__ import annotations

import itertools
import sys
import types
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

BLOCK_TOKENS = 16  # positions per cached block: the unit of reuse (a prompt's last partial block is not kept)


def _held_by_one_attribute() -> int:
    """What ``sys.getrefcount`` says of an object one attribute holds, asked through that attribute."""
    holder = types.SimpleNamespace(value=object())
    return sys.getrefcount(holder.value)


_UNREFERENCED = _held_by_one_attribute()  # an entry's tensor that only the entry holds


@dataclass(eq=False)
class Entry:
    """One cached tensor; ``kv`` is (layers, 2, heads, tokens, head_dim): keys then values per layer."""

    kv: torch.Tensor
    key: Hashable
    serial: int  # children's keys name their parent by it (never reused, unlike id())

    @property
    def tokens(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def in_use(self) -> bool:
        """Whether something besides this entry holds its tensor: a running batch reading the block in place."""
        return sys.getrefcount(self.kv) > _UNREFERENCED


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
    nbytes: int = 0
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
        ones would hang from no chain."""
        blocks = len(prompt) // BLOCK_TOKENS
        chain = self._walk(namespace, prompt, blocks)
        if len(chain) == blocks or len(chain) * BLOCK_TOKENS < offset:
            self._touch(chain)
            return
        start, end = len(chain) * BLOCK_TOKENS - offset, blocks * BLOCK_TOKENS - offset
        kv = torch.stack([torch.stack((k[:, start:end], v[:, start:end])) for k, v in zip(keys, values, strict=True)])
        parent = chain[-1].serial if chain else 0
        for i, block in enumerate(kv.split(BLOCK_TOKENS, dim=3)):
            first = offset + start + i * BLOCK_TOKENS
            entry = self._put((namespace, parent, tuple(prompt[first: first + BLOCK_TOKENS])), block.clone())
            if entry is None:
                break
            chain.append(entry)
            parent = entry.serial
        self._touch(chain)

    def _walk(self, namespace: str | None, prompt: Sequence[int], blocks: int) -> list[Entry]:
        chain: list[Entry] = []
        parent = 0
        for start in range(0, blocks * BLOCK_TOKENS, BLOCK_TOKENS):
            entry = self._entries.get((namespace, parent, tuple(prompt[start: start + BLOCK_TOKENS])))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.serial
        return chain

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
        (which outlives the cache's budget only as long as the caller holds it)."""
        entry = self._put(self._source_key(namespace, source), kv)
        return entry if entry is not None else Entry(kv, key=None, serial=0)

    @staticmethod
    def _source_key(namespace: str | None, source: Sequence[int]) -> Hashable:
        return (namespace, "source", tuple(source))

    # ---- the LRU -------------------------------------------------------------------------------------

    def _put(self, key: Hashable, kv: torch.Tensor) -> Entry | None:
        entry = Entry(kv, key, next(self._serials))
        if entry.nbytes > self.budget_bytes or not self._make_room(entry.nbytes):
            return None
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        return entry

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used entries that no running batch reads until ``nbytes`` more fit the budget;
        False when they cannot (the rest is in use)."""
        if self.nbytes + nbytes <= self.budget_bytes:
            return True
        for key, entry in list(self._entries.items()):  # least recently used first
            if entry.in_use:
                continue
            del self._entries[key]
            self.nbytes -= entry.nbytes
            if self.nbytes + nbytes <= self.budget_bytes:
                return True
        return False

    def _touch(self, chain: list[Entry]) -> None:
        """Most recently used, deepest first: the root ends newest, so children are evicted before parents."""
        for entry in reversed(chain):
            if self._entries.get(entry.key) is entry:  # not evicted meanwhile
                self._entries.move_to_end(entry.key)


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
