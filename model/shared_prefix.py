"""Cached prompt blocks that the rows of a batch read in place: prefix caching without copies.

model.prefix_cache keeps a causal LM prompt's K/V in blocks of ``BLOCK_TOKENS`` positions, each one tensor
(layers, 2, heads, BLOCK_TOKENS, head_dim). A row that starts from a cached chain of blocks does not copy it into
its own KV buffer: the batch lists each distinct block once, every row names its chain by a block table, and
attention reads the blocks ahead of the row's own keys (vLLM's paged attention, for the prefix;
model/kernels/decode_attention.cpp on the CPU, :func:`model.attention.prefix_attention` elsewhere). Thirty-two rows
of one system prompt hold it once. The prefix cache never evicts a block a batch references (its reference
count says so); the block is evictable again once the last row reading it leaves, and its slot is then rewritten
with another block (model.prefix_cache.BlockPool): whatever reads a block after the call that matched it must
hold its tensor, as this class does, not just its Entry. Rows' own buffers hold their positions from the prefix
on, so a row's position is its prefix length plus its own length (``KVCache.begin_step``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChainGroup:
    """Rows of a batch that read the same chain of blocks."""

    chain: tuple[int, ...]  # indices into SharedPrefix.blocks, in order
    rows: tuple[int, ...]  # ascending

    @functools.cached_property
    def index(self) -> slice | torch.Tensor:
        """These rows as an index of dim 0 (``x[group.index]``): a slice (a view) when they are consecutive."""
        first = self.rows[0]
        if self.rows == tuple(range(first, first + len(self.rows))):
            return slice(first, first + len(self.rows))
        return torch.tensor(self.rows)


@dataclass(frozen=True, eq=False)
class SharedPrefix:
    """Distinct prefix blocks and, per row, the indices of the blocks it reads (in order)."""

    blocks: tuple[torch.Tensor, ...]  # each (layers, 2, H, block, Dh), contiguous, on the model's device
    rows: tuple[tuple[int, ...], ...]  # per row: indices into ``blocks``

    @classmethod
    def of_chains(cls, chains: Sequence[Sequence[torch.Tensor]]) -> SharedPrefix | None:
        """The prefix of rows reading ``chains`` (per row, its block tensors; [] for none); None when no row reads
        any. A block given to several rows (the same tensor object) is listed once."""
        blocks: dict[int, int] = {}
        ordered: list[torch.Tensor] = []
        rows = []
        for chain in chains:
            for block in chain:
                if id(block) not in blocks:
                    blocks[id(block)] = len(ordered)
                    ordered.append(block)
            rows.append(tuple(blocks[id(block)] for block in chain))
        return cls(tuple(ordered), tuple(rows)) if ordered else None

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def block_tokens(self) -> int:
        return self.blocks[0].shape[3]

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """(B,) positions each row reads from the prefix."""
        return torch.tensor([len(r) * self.block_tokens for r in self.rows], device=self.blocks[0].device)

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """(B, M) int64 block indices per row, -1 after its last (the kernel's block table, on the CPU)."""
        longest = max(map(len, self.rows))
        table = torch.full((self.batch_size, longest), -1, dtype=torch.long)
        for row, chain in enumerate(self.rows):
            table[row, : len(chain)] = torch.tensor(chain, dtype=torch.long)
        return table

    @functools.cached_property
    def groups(self) -> tuple[ChainGroup, ...]:
        """The rows grouped by the chain they read (rows of one system prompt: one group; a row with no prefix is in
        the group of ``()``), in order of each group's first row."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for row, chain in enumerate(self.rows):
            groups.setdefault(chain, []).append(row)
        return tuple(ChainGroup(chain, tuple(rows)) for chain, rows in groups.items())

    def keys(self, layer: int, chain: Sequence[int]) -> torch.Tensor:
        """(H, len(chain) * block, Dh): the keys of ``layer`` of the blocks ``chain`` (at least one) side by side, in
        order (a transient copy, for attention paths that read one tensor)."""
        return torch.cat([self.blocks[i][layer, 0] for i in chain], dim=1)

    def values(self, layer: int, chain: Sequence[int]) -> torch.Tensor:
        """(H, len(chain) * block, Dh): as :meth:`keys`, for the values."""
        return torch.cat([self.blocks[i][layer, 1] for i in chain], dim=1)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this prefix references (each once)."""
        return sum(block.numel() * block.element_size() for block in self.blocks)

    def select(self, index: torch.Tensor) -> SharedPrefix | None:
        """Rows ``index`` (row i is old row ``index[i]``); blocks no row reads any more are let go."""
        return SharedPrefix.of_chains([[self.blocks[i] for i in self.rows[row]] for row in index.tolist()])

    @staticmethod
    def concat(prefixes: Sequence[SharedPrefix | None], batch_sizes: Sequence[int]) -> SharedPrefix | None:
        """The rows of several batches stacked (None: a batch whose rows read no prefix)."""
        chains: list[list[torch.Tensor]] = []
        for prefix, rows in zip(prefixes, batch_sizes, strict=True):
            if prefix is None:
                chains += [[] for _ in range(rows)]
            else:
                chains += [[prefix.blocks[i] for i in chain] for chain in prefix.rows]
        return SharedPrefix.of_chains(chains)
