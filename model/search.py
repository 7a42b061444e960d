"""The decoding search's contract: what a search is (:class:`Search`), what it finds (:class:`Hypothesis`), and the
offline loop that drives one (:func:`run_search`). model.decoding holds greedy and sampling, model.beam_search the
beam search; model.decoding.make_search picks one.

A search owns some rows of a model batch. `advance(logits)` consumes the last-position logits of
those rows and returns the token every surviving row feeds next and the current row it continues
from, so one implementation serves offline generation (`run_search`) and an engine that
concatenates the rows of many searches into one model step. Finished rows leave at once.

Conventions:
- `Hypothesis.tokens` holds generated tokens only. The EOS or stop token that ended a sequence is
  left out, but its log-prob is part of `logprob`/`score` and it counts in the length. Tokens
  that made `stop_fn` fire are kept (the caller trims the stop string from the text).
- With ``config.logprobs = N``, every hypothesis also lists each of its tokens' log-prob (log_softmax of the
  raw logits, as ``logprob`` sums them; the terminator's is in ``logprob`` only) and the N likeliest tokens
  at that position with theirs, best first (the distribution the token was picked from, before bans).
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from model.generation_config import GenerationConfig, require
from model.logits import NEG_INF, mask_repeats, penalize_repeats
from model.restricted_vocab import VocabularyRestriction

logger = logging.getLogger(__name__)

StopFn = Callable[[int, list[int]], bool]


@dataclass
class Hypothesis:
    """One finished sequence."""

    tokens: list[int]  # generated tokens only: no prompt, no EOS/stop token
    score: float  # greedy/sample: == logprob; beam: logprob / length ** length_penalty
    logprob: float  # sum of log_softmax(raw logits) of the chosen tokens, terminator included
    finish_reason: str  # "eos" | "stop" | "length"
    token_logprobs: list[float] | None = None  # config.logprobs set: one per token of ``tokens``
    top_logprobs: list[list[tuple[int, float]]] | None = None  # config.logprobs = N: per token, N (id, log-prob)


class Search(ABC):
    """Decoding state for a group of input sequences; vectorised over its own rows."""

    # Whether the search picks through `logit_space` alone (its columns mapped back to token ids): see
    # reads_compact_logits.
    picks_by_columns = False

    def __init__(self, config: GenerationConfig, num_inputs: int, stop_fn: StopFn | None = None,
                 prefixes: Sequence[Sequence[int]] | None = None):
        require(num_inputs >= 1, "num_inputs", f"must be >= 1, got {num_inputs}")
        require(not config.reads_history or (prefixes is not None and len(prefixes) == num_inputs),
                 "no_repeat_ngram_size" if config.no_repeat_ngram_size else "repetition_penalty",
                 "needs the prefix (prompt, or decoder start) of every input")
        self.config = config
        self.num_inputs = num_inputs
        self.stop_fn = stop_fn
        self.prefixes = [list(p) for p in prefixes] if config.reads_history else None
        self.step = 0  # tokens generated so far by every live row
        # After an advance that kept the row count: per row, how many of its last cached positions may differ from
        # those of the old row at its index (the rest hold the same tokens, so the same keys and values): what a
        # KV cache must copy when it reorders rows. None: any of them.
        self.tails: torch.Tensor | None = None
        # The target ids each row may produce (model.restricted_vocab; a translation under a vocabulary map), or
        # None: set by whoever starts the search, reordered with the rows by run_search, read by the model's steps.
        self.vocabulary: VocabularyRestriction | None = None
        self._compact_space: tuple[torch.Tensor, GenerationConfig] | None = None  # (ids, config over their columns)

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Rows this search occupies in the model batch right now."""

    @property
    @abstractmethod
    def done(self) -> bool:
        """True once every input is finished (no rows left)."""

    @abstractmethod
    def advance(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Consume the rows' last-position logits (num_rows, V); return (next_tokens, parent_rows), both (R',).

        parent_rows index the current rows; R' is the new row count (finished rows are left out). A tensor
        returned as parent_rows is never changed afterwards (run_search knows one it has seen keep the rows).
        The first call sees one row per input and may expand it (beams, samples); once done it
        returns empty tensors.
        """

    @abstractmethod
    def results(self) -> list[list[Hypothesis]]:
        """Finished hypotheses per input, once done."""

    def shared_history(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per row, its run's first row (a sentence's beams are a run of rows) and how many leading tokens of its
        history equal that row's; None where no rows share: a cache may read those positions once
        (model.kv_cache.KVCache.share_beam_prefix)."""
        return None

    def choices_ahead(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The one row's picks (t,) and their log-probs (t,) at its next t steps, each from the logits (t, V) after
        the picks before it, where they can be made at once (greedy, the same bans at every step); else None."""
        return None

    @property
    def reads_compact_logits(self) -> bool:
        """Whether `advance` may be given a compacted restriction's logits (model.restricted_vocab): where the search
        picks by columns, unless a step reads full-width tokens (the history rules, reported log-probs)."""
        return self.picks_by_columns and not self.config.reads_history and self.config.logprobs is None

    def logit_space(self) -> tuple[GenerationConfig, torch.Tensor | None]:
        """What the logits given to `advance` index: (the config with its token ids as their columns, the id of
        each column (U,)) under a compacted restriction, else (the config, None): columns are token ids."""
        vocabulary = self.vocabulary
        if vocabulary is None or not vocabulary.compact:
            return self.config, None
        if self._compact_space is None or self._compact_space[0] is not vocabulary.ids:
            config = self.config
            space = dataclasses.replace(config, eos_token_id=vocabulary.columns([config.eos_token_id])[0],
                                        stop_token_ids=vocabulary.columns(config.stop_token_ids),
                                        banned_token_ids=vocabulary.columns(config.banned_token_ids))
            self._compact_space = (vocabulary.ids, space)
        return self._compact_space[1], vocabulary.ids

    def _check_logits(self, logits: torch.Tensor, config: GenerationConfig | None = None) -> None:
        """``logits`` hold one row per row and every finish token of ``config`` (the logit space's)."""
        finish = (config or self.config).finish_token_ids
        if logits.dim() != 2 or logits.size(0) != self.num_rows:  # (messages built only on failure: every step)
            raise ValueError(f"logits must be (num_rows={self.num_rows}, V), got {tuple(logits.shape)}")
        if max(finish) >= logits.size(1):
            raise ValueError(f"eos/stop token ids {finish} out of vocabulary {logits.size(1)}")

    def _history_rules(self, scores: torch.Tensor, inputs: list[int], histories: list[list[int]]) -> torch.Tensor:
        """``scores`` of rows (input, generated tokens), in place, under the rules that read each row's prefix +
        output, in Hugging Face's order: the repetition penalty, then the n-gram bans."""
        sequences = [self.prefixes[i] + h for i, h in zip(inputs, histories, strict=True)]
        if self.config.repetition_penalty != 1.0:
            penalize_repeats(scores, sequences, self.config.repetition_penalty)
        if self.config.no_repeat_ngram_size:
            mask_repeats(scores, sequences, self.config.no_repeat_ngram_size)
        return scores

    def _check_done(self) -> None:
        if not self.done:
            raise RuntimeError("results() called before the search is done")

    @staticmethod
    def _empty(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``advance`` returns once no row is left."""
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty.clone()


def force_first_tokens(logits: torch.Tensor, forced: Sequence[int | None]) -> torch.Tensor:
    """The first step's logits (one row per input, (B, V)) with row i's ``forced[i]`` the only token it may produce,
    at log-prob 0 (None: the row is left as it is): Hugging Face's ForcedBOSTokenLogitsProcessor (a target language's
    token, BART's ``<s>``). The forced token is then generated like any other: it is in the hypothesis's tokens and
    counts in its length (the length penalty), max_new_tokens and min_new_tokens, as in generate(); its log-prob is
    0 (generate()'s beam score)."""
    if len(forced) != logits.shape[0]:
        raise ValueError(f"got {len(forced)} forced tokens for {logits.shape[0]} rows")
    rows = [i for i, token in enumerate(forced) if token is not None]
    if not rows:
        return logits
    tokens = [forced[i] for i in rows]
    if not all(isinstance(t, int) and 0 <= t < logits.shape[1] for t in tokens):
        raise ValueError(f"forced tokens {tokens} must be token ids below the vocabulary size {logits.shape[1]}")
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = NEG_INF
    out[index, torch.tensor(tokens, device=logits.device)] = 0.0
    return out


def run_search(search: Search, first_logits: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor],
               select_rows: Callable[[torch.Tensor, torch.Tensor | None], None],
               share_rows: Callable[[tuple[torch.Tensor, torch.Tensor] | None, int], None] | None = None,
               ) -> list[list[Hypothesis]]:
    """Drive `search` offline: step(tokens) -> next logits; select_rows(parents, tails) reorders per-row state
    (``tails``: :attr:`Search.tails`); share_rows(shared, generated) hears after it what the rows' histories share
    (:meth:`Search.shared_history`, the tokens generated so far); the search's own vocabulary restriction follows
    the rows here, and after the first step (whose logits may have had tokens forced) gives compact logits to a
    search that reads them."""
    logits = first_logits
    steps = 0
    in_place = None  # the last parents tensor found to keep every row where it was (the searches return it again)
    while True:
        rows = search.num_rows
        tokens, parents = search.advance(logits)
        steps += 1
        if search.done:
            logger.debug("search over %d inputs done after %d steps", search.num_inputs, steps)
            return search.results()
        kept = parents.numel() == rows and (
            parents is in_place or torch.equal(parents, torch.arange(rows, device=parents.device)))
        if kept:
            in_place = parents
        else:
            select_rows(parents, search.tails)
            if search.vocabulary is not None:
                search.vocabulary = search.vocabulary.select(parents)
        if search.vocabulary is not None and search.reads_compact_logits:
            search.vocabulary = search.vocabulary.compacted(search.config.finish_token_ids)
        if share_rows is not None:
            share_rows(search.shared_history(), search.step)
        logits = step(tokens)
