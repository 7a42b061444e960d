"""Greedy and sampling decoding as model-agnostic searches (model.search), and :func:`make_search`, which picks
the search a GenerationConfig asks for (beam search: model.beam_search).

Rows of these searches never interact: each ends on its own and leaves. With a seed, input i of a sampling search
draws from its own generator seeded `seed + i`, and draws noise for all its samples every step, so an input samples
the same whatever else shares the batch. The engine builds one search per request, so a seeded request is
reproducible.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence

import torch

from model.beam_search import BeamSearch
from model.generation_config import ConfigError as ConfigError  # re-exported: the searches' errors
from model.generation_config import GenerationConfig, Strategy, require
from model.logits import banned_ids, greedy_choice, gumbel_argmax, log_probs, sampling_logits
from model.search import Hypothesis, Search, StopFn

# Finish codes of independent rows (0 = running): EOS, stop token, stop_fn, length.
_EOS, _STOP_TOKEN, _STOP_FN, _LENGTH = 1, 2, 3, 4
_REASON = {_EOS: "eos", _STOP_TOKEN: "stop", _STOP_FN: "stop", _LENGTH: "length"}
# Up to this many rows, a step's finish codes are found on the host (Python over the picked ids) where the tensor
# ops' fixed cost dominates (a SmolLM2 batch-1 step: 6-7 ops, ~25 us with the caches cold from the weights).
_HOST_ROWS = 8
# Steps whose picks a search holds before writing them into its tensors (_IndependentSearch._record).
_MAX_PENDING = 64


def _top(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n likeliest tokens of every row (at most the vocabulary): (log-probs, ids), each (rows, n), best first."""
    return log_probs(logits).topk(min(n, logits.size(1)), dim=-1)


class _IndependentSearch(Search):
    """Rows that never interact: `samples` rows per input, each ends on its own and then leaves."""

    def __init__(self, config: GenerationConfig, num_inputs: int, stop_fn: StopFn | None,
                 prefixes: Sequence[Sequence[int]] | None, samples: int):
        super().__init__(config, num_inputs, stop_fn, prefixes)
        self.samples = samples
        self._slots: torch.Tensor | None = None  # (R,) input * samples + sample index of each live row
        # (step, tokens (R,), log-probs (R,)) of the steps before any row left, not yet in _tokens / _logprob: a
        # step's three tensor ops there cost 30-40 us with the caches cold from the weights, a few us in a row
        # (:meth:`_record`, before anything reads them).
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    @property
    def num_rows(self) -> int:
        return self.num_inputs if self._slots is None else self._slots.numel()

    @property
    def done(self) -> bool:
        return self._slots is not None and self._slots.numel() == 0

    @abstractmethod
    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token (R,) of every live row and its log-prob (R,)."""

    def _start(self, device: torch.device, vocab: int) -> None:
        n = self.num_inputs * self.samples
        self._slots = torch.arange(n, device=device)
        self._tokens = torch.zeros(n, self.config.max_new_tokens, dtype=torch.long, device=device)
        self._logprob = torch.zeros(n, device=device)
        self._reason = torch.zeros(n, dtype=torch.long, device=device)  # finish code per slot
        self._length = torch.zeros(n, dtype=torch.long, device=device)  # tokens kept per slot
        self._stop_ids = torch.tensor(self.config.stop_token_ids, dtype=torch.long, device=device)
        self._all_slots = self._slots  # `_slots` stays this tensor until a row leaves
        if self.config.logprobs is not None:  # per slot and position: the token's log-prob, the top N
            top = min(self.config.logprobs, vocab)
            self._token_lp = torch.zeros(n, self.config.max_new_tokens, device=device)
            self._top_lp = torch.zeros(n, self.config.max_new_tokens, top, device=device)
            self._top_ids = torch.zeros(n, self.config.max_new_tokens, top, dtype=torch.long, device=device)

    def advance(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_logits(logits, self.logit_space()[0])
        if self.done:
            return self._empty(logits.device)
        if self._slots is None:  # one row per input -> `samples` rows per input
            self._start(logits.device, logits.size(1))
            parents = torch.arange(self.num_inputs, device=logits.device).repeat_interleave(self.samples)
            logits = logits.index_select(0, parents) if self.samples > 1 else logits
        else:
            parents = None
        slots = self._slots
        whole = slots is self._all_slots  # no row has left yet: slot i is row i
        if parents is None:
            parents = slots if whole else torch.arange(self.num_rows, device=logits.device)
        raw = logits
        if self.config.reads_history:
            self._record()
            logits = self._history_rules(logits.clone(), (slots // self.samples).tolist(),
                                         self._tokens[slots, : self.step].tolist())
        tokens, chosen = self._choose(logits)
        if self.config.logprobs is not None:
            self._token_lp[slots, self.step] = chosen
            if self.config.logprobs:
                values, ids = _top(raw, self.config.logprobs)
                self._top_lp[slots, self.step], self._top_ids[slots, self.step] = values, ids
        if whole:  # slices instead of indexed writes, made later (_record)
            self._pending.append((self.step, tokens, chosen))
            if len(self._pending) == _MAX_PENDING:  # a long generation holds a bounded list
                self._record()
        else:
            self._tokens[slots, self.step] = tokens
            self._logprob[slots] += chosen
        self.step += 1
        if whole and tokens.numel() <= _HOST_ROWS:  # a few rows: their codes on the host, no tensor op
            codes = [self._finish_code(row, token, self.step, self._history(row))
                     for row, token in enumerate(tokens.tolist())]
            if not any(codes):  # the common step: no row finished, nothing to record or index
                return tokens, parents
            reason = torch.tensor(codes, device=tokens.device)
            live = reason == 0
        else:
            reason = self._finish_codes(tokens, slots)
            live = reason == 0
            if bool(live.all()):
                return tokens, parents
        self._record()
        self._reason[slots] = reason  # a live row's reason and length are written again when it ends
        self._length[slots] = self.step - ((reason == _EOS) | (reason == _STOP_TOKEN)).long()
        self._slots = slots[live]
        return tokens[live], parents[live]

    def _record(self) -> None:
        """Write the pending steps' tokens and log-probs (``_pending``) into ``_tokens`` and ``_logprob``, in order."""
        for step, tokens, chosen in self._pending:
            self._tokens.select(1, step).copy_(tokens)
            self._logprob.add_(chosen)
        self._pending.clear()

    def _finish_codes(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Finish code per row (0 = continues), by priority EOS > stop token > stop_fn > length."""
        self._record()
        reason = torch.zeros_like(tokens)
        if self.config.stop_token_ids:
            reason.masked_fill_(torch.isin(tokens, self._stop_ids), _STOP_TOKEN)
        reason.masked_fill_(tokens == self.config.eos_token_id, _EOS)
        if self.stop_fn is not None and self.step >= self.config.min_new_tokens:
            rows = (reason == 0).nonzero().flatten()
            histories = self._tokens[slots[rows], : self.step].tolist()
            inputs = (slots[rows] // self.samples).tolist()
            for row, input_index, history in zip(rows.tolist(), inputs, histories, strict=True):
                if self.stop_fn(input_index, history):
                    reason[row] = _STOP_FN
        if self.step >= self.config.max_new_tokens:
            reason.masked_fill_(reason == 0, _LENGTH)
        return reason

    def _finish_code(self, slot: int, token: int, length: int, history: Callable[[], list[int]]) -> int:
        """``_finish_codes`` for one slot that has just picked ``token``, its ``length``-th; ``history``: its
        generated tokens, the last one included (asked for by the stop_fn only)."""
        config = self.config
        if token == config.eos_token_id:
            return _EOS
        if token in config.stop_token_ids:
            return _STOP_TOKEN
        stop_fn = self.stop_fn
        if stop_fn is not None and length >= config.min_new_tokens and stop_fn(slot // self.samples, history()):
            return _STOP_FN
        return _LENGTH if length >= config.max_new_tokens else 0

    def _history(self, slot: int) -> Callable[[], list[int]]:
        """The generated tokens of ``slot`` so far, read when called."""
        def history() -> list[int]:
            self._record()
            return self._tokens[slot, : self.step].tolist()

        return history

    def extend(self, tokens: torch.Tensor, chosen: torch.Tensor, raw: torch.Tensor) -> int:
        """Record consecutive picks (m,) of the search's one live row, with their log-probs (m,) and the raw logits
        they were picked from (m, V) (a verified draft: model.speculative), up to and including the first pick that
        finishes the row; return how many were recorded."""
        if self.num_rows != 1 or self._slots is None:
            raise ValueError(f"extend() records one started row's picks, the search has {self.num_rows} rows")
        self._record()
        slot, start = int(self._slots[0]), self.step
        sequence = self._tokens[slot, :start].tolist() if self.stop_fn is not None else [0] * start
        code = 0
        for token in tokens.tolist():  # a few tokens: Python beats a handful of tensor ops here
            sequence.append(token)
            code = self._finish_code(slot, token, len(sequence), lambda: sequence)
            if code:
                break
        kept = len(sequence) - start
        self._tokens[slot, start: start + kept] = tokens[:kept]
        self._logprob[slot] += chosen[:kept].sum()
        if self.config.logprobs is not None:
            self._token_lp[slot, start: start + kept] = chosen[:kept]
            if self.config.logprobs:
                values, ids = _top(raw[:kept], self.config.logprobs)
                self._top_lp[slot, start: start + kept], self._top_ids[slot, start: start + kept] = values, ids
        self.step += kept
        if code:
            self._reason[slot] = code
            self._length[slot] = self.step - (code in (_EOS, _STOP_TOKEN))
            self._slots = self._slots[:0]
        return kept

    def results(self) -> list[list[Hypothesis]]:
        self._check_done()
        self._record()  # a finishing step records already; kept here so that results never read a pending step
        columns = (self._tokens.tolist(), self._length.tolist(), self._logprob.tolist(), self._reason.tolist())
        hyps = [Hypothesis(tokens[:length], logprob, logprob, _REASON[code], *self.alternatives(slot, 0, length))
                for slot, (tokens, length, logprob, code) in enumerate(zip(*columns, strict=True))]
        return [hyps[i * self.samples: (i + 1) * self.samples] for i in range(self.num_inputs)]

    def alternatives(self, slot: int, start: int, end: int) -> tuple[list[float] | None, list | None]:
        """(token log-probs, top-N lists) of slot ``slot`` (input * samples + sample) at positions [start, end);
        (None, None) without config.logprobs, top-N None when N is 0. Valid for positions already generated."""
        if self.config.logprobs is None:
            return None, None
        token_lp = self._token_lp[slot, start:end].tolist()
        if not self.config.logprobs:
            return token_lp, None
        ids, values = self._top_ids[slot, start:end].tolist(), self._top_lp[slot, start:end].tolist()
        return token_lp, [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]


class GreedySearch(_IndependentSearch):
    """Argmax decoding, one row per input."""

    def __init__(self, config: GenerationConfig, num_inputs: int, stop_fn: StopFn | None = None,
                 prefixes: Sequence[Sequence[int]] | None = None):
        super().__init__(config, num_inputs, stop_fn, prefixes, samples=1)

    picks_by_columns = True

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config, column_ids = self.logit_space()  # columns -> token ids under a compact restriction
        tokens, chosen = greedy_choice(logits, self.step, config)
        return (tokens if column_ids is None else column_ids[tokens]), chosen

    def choices_ahead(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        config, last = self.config, self.step + logits.size(0) - 1
        if (self.num_rows != 1 or self._slots is None or config.reads_history
                or (config.forced_eos and self.step <= config.max_new_tokens - 1 <= last)
                or banned_ids(self.step, config) != banned_ids(last, config)):
            return None
        return greedy_choice(logits, self.step, config)


class SampleSearch(_IndependentSearch):
    """Ancestral sampling with temperature, top-k and top-p; num_return_sequences rows per input."""

    def __init__(self, config: GenerationConfig, num_inputs: int, stop_fn: StopFn | None = None,
                 prefixes: Sequence[Sequence[int]] | None = None):
        super().__init__(config, num_inputs, stop_fn, prefixes, samples=config.rows_per_input)
        self._generators: list[torch.Generator] | None = None

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = sampling_logits(logits, self.step, self.config)
        tokens = gumbel_argmax(scores, self._uniforms(scores.shape, scores.device))
        return tokens, log_probs(logits).gather(1, tokens[:, None]).squeeze(1)

    def _uniforms(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """Uniform noise (R, V); with a seed, drawn per input for all its samples, then gathered."""
        if self.config.seed is None:
            return torch.rand(shape, device=device)
        if self._generators is None:
            self._generators = [torch.Generator(device=device).manual_seed(self.config.seed + i)
                                for i in range(self.num_inputs)]
        inputs = self._slots // self.samples
        active = torch.unique(inputs)  # sorted
        noise = torch.cat([torch.rand((self.samples, shape[1]), generator=self._generators[i], device=device)
                           for i in active.tolist()])  # (len(active) * samples, V)
        rows = torch.searchsorted(active, inputs) * self.samples + self._slots % self.samples
        return noise.index_select(0, rows)


def make_search(config: GenerationConfig, num_inputs: int, stop_fn: StopFn | None = None,
                prefixes: Sequence[Sequence[int]] | None = None) -> Search:
    """The search for `config.strategy` over `num_inputs` inputs; stop_fn is greedy/sample only. ``prefixes``
    (each input's prompt, or a translation's decoder start) are needed by the rules that read them only
    (``no_repeat_ngram_size``, ``repetition_penalty``)."""
    if config.strategy == Strategy.BEAM:
        require(stop_fn is None, "stop_fn", "is not supported by beam search (strategy='beam')")
        return BeamSearch(config, num_inputs, prefixes)
    if config.strategy == Strategy.SAMPLE:
        return SampleSearch(config, num_inputs, stop_fn, prefixes)
    return GreedySearch(config, num_inputs, stop_fn, prefixes)
