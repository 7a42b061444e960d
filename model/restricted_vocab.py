"""Decoding over restricted target vocabularies (model.vocab_map): the output projection for candidates only.

Each row of a batch is restricted to its own candidate ids (a vocabulary map's candidates for its source; a
multilingual model's: its target language's map's) or not (None: no map, or no map for its language). When every
row is restricted the output projection runs over the union of the candidates alone: one (U, D) slice of the
head's weight, gathered once per batch and kept while rows leave (a superset stays right). Otherwise (one rule, no
split batches) it runs over the whole vocabulary. Either way a row's logits outside its own candidates are -inf, so
what a row produces depends on its source (and language) alone, never on the rows it shares a batch with.

The logits' width (one rule): a restriction made :meth:`~VocabularyRestriction.compacted` gives (B, U) logits, column
j for token ``ids[j]``; any other gives the vocabulary's full width (-inf elsewhere). Only a search that reads compact
logits has one compacted (model.search.run_search, once every row is restricted and the union holds every finish
token): it maps bans and EOS to columns and its picks back to ids (model.search.Search.logit_space). The log-softmax
over U is the one over the full row (exp(-inf) = 0), so tokens and scores are those of the full width, to float
rounding. Whatever reads tokens of the full vocabulary (the history rules, reported log-probs, constraints, forced
first tokens, an engine batch's rows) gets the full width.

A float or int8 linear head is sliced; another one (an adapter's) computes every logit, then masks: the same
output, without the speed-up.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from model.kernel_layers import is_plain, linear
from model.layout import input_major
from model.quantize import QUANTIZED_LINEARS
from model.vocab_map import AnyVocabularyMap

Head = Callable[[torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class _HeadSlices:
    """Each head a restriction served, sliced to its union's rows, by the head's identity (shared by the
    restrictions that keep one union as rows leave)."""

    by_head: dict[int, Head] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class VocabularyRestriction:
    """Per row: the sorted target ids it may produce, or None (the whole vocabulary)."""

    rows: tuple[tuple[int, ...] | None, ...]
    vocab_size: int
    ids: torch.Tensor | None  # (U,) sorted ids the projection computes; None: all (some row is unrestricted)
    mask: torch.Tensor  # (B, U), or (B, V) without ids: True where a row may produce the token
    _slices: _HeadSlices = field(default_factory=_HeadSlices)
    compact: bool = False  # logits (B, U) over ``ids`` instead of (B, V)

    @classmethod
    def of_rows(cls, rows: Sequence[Sequence[int] | None], vocab_size: int, device: torch.device | str
                ) -> VocabularyRestriction:
        """The restriction of rows allowed ``rows`` (each a sorted id list, or None)."""
        rows = tuple(tuple(r) if r is not None else None for r in rows)
        ids = None
        if rows and all(r is not None for r in rows):
            ids = torch.tensor(sorted(set().union(*rows)), dtype=torch.long, device=device)
        mask = torch.ones(len(rows), vocab_size if ids is None else ids.shape[0], dtype=torch.bool, device=device)
        for row, allowed in enumerate(rows):
            if allowed is not None:
                positions = torch.tensor(allowed, dtype=torch.long, device=device)
                mask[row] = False
                mask[row, positions if ids is None else torch.searchsorted(ids, positions)] = True
        return cls(rows, vocab_size, ids, mask)

    @classmethod
    def of_sources(cls, vocab_map: AnyVocabularyMap, sources: Sequence[Sequence[int]], vocab_size: int,
                   device: torch.device | str, restricted: Sequence[bool] | None = None,
                   languages: Sequence[int | None] | None = None) -> VocabularyRestriction | None:
        """Each source's candidates under ``vocab_map`` (``restricted``: per row whether it keeps to them, all by
        default; ``languages``: per row its target language's token, model.vocab_map.target_languages, which picks
        a LanguageMaps' map). None when no row ends up restricted (no row opted in, or none has a map)."""
        restricted = restricted if restricted is not None else [True] * len(sources)
        languages = languages if languages is not None else [None] * len(sources)
        rows = [vocab_map.candidates_in(s, language) if r else None
                for s, r, language in zip(sources, restricted, languages, strict=True)]
        return cls.of_rows(rows, vocab_size, device) if any(r is not None for r in rows) else None

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def logits(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``head(hidden)`` for hidden (B, D) or (B, t, D), -inf where a row may not go: (B, [t,] U) columns
        ``ids`` when :attr:`compact`, else (B, [t,] V)."""
        sliced = self._slice(head) if self.ids is not None else None
        mask = self.mask if hidden.dim() == 2 else self.mask[:, None, :]
        if sliced is None:
            full = head(hidden)
            if self.compact:
                return full.index_select(-1, self.ids).masked_fill(~mask, float("-inf"))
            return full.masked_fill(~self._full_mask(mask), float("-inf"))
        small = sliced(hidden).masked_fill(~mask, float("-inf"))
        if self.compact:
            return small
        full = small.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, small)

    def _full_mask(self, mask: torch.Tensor) -> torch.Tensor:
        if self.ids is None:
            return mask
        full = mask.new_zeros((*mask.shape[:-1], self.vocab_size))
        return full.index_copy_(-1, self.ids, mask)

    def _slice(self, head: nn.Module) -> Head | None:
        """``head`` over the union's rows alone (gathered once), or None for a head that cannot be sliced."""
        found = self._slices.by_head.get(id(head))
        if found is None:
            if is_plain(head):
                with torch.inference_mode(False):  # an inference tensor could not keep its packed copy
                    weight = input_major(head.weight.detach().index_select(0, self.ids))
                    bias = head.bias.detach().index_select(0, self.ids) if head.bias is not None else None
                found = functools.partial(linear, weight=weight, bias=bias)
            elif type(head) in QUANTIZED_LINEARS:  # its own rows of its own weights
                found = head.rows(self.ids)
            else:
                return None
            self._slices.by_head[id(head)] = found
        return found

    def select(self, index: torch.Tensor) -> VocabularyRestriction:
        """Rows ``index`` (row i is old row ``index[i]``: beams reorder every step, so this only indexes); the union
        and its sliced heads are kept while they still cover every row."""
        rows = tuple(self.rows[i] for i in index.tolist())
        if self.ids is None and all(r is not None for r in rows):
            return VocabularyRestriction.of_rows(rows, self.vocab_size, self.mask.device)
        return VocabularyRestriction(rows, self.vocab_size, self.ids, self.mask.index_select(0, index), self._slices,
                                     self.compact)

    def compacted(self, needed: Sequence[int]) -> VocabularyRestriction:
        """This restriction giving compact (B, U) logits, where every row is restricted and the union holds every
        token of ``needed`` (a search's finish tokens); else itself."""
        if self.compact or self.ids is None or len(set(self.columns(needed))) < len(set(needed)):
            return self
        return dataclasses.replace(self, compact=True)

    def columns(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The compact columns of those of ``token_ids`` that are in the union (requires :attr:`ids`), in order."""
        found = []
        for token in token_ids:
            column = int(torch.searchsorted(self.ids, token))
            if column < self.ids.numel() and int(self.ids[column]) == token:
                found.append(column)
        return tuple(found)

    @staticmethod
    def concat(restrictions: Sequence[VocabularyRestriction | None], batch_sizes: Sequence[int]
               ) -> VocabularyRestriction | None:
        """The rows of several batches stacked (None: a batch of unrestricted rows); None when no row is restricted."""
        if all(r is None for r in restrictions):
            return None
        known = next(r for r in restrictions if r is not None)
        rows: list[tuple[int, ...] | None] = []
        for restriction, size in zip(restrictions, batch_sizes, strict=True):
            rows += list(restriction.rows) if restriction is not None else [None] * size
        return VocabularyRestriction.of_rows(rows, known.vocab_size, known.mask.device)
