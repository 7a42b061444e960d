"""Greedy, beam and sampling decoding as model-agnostic search objects.

A search owns some rows of a model batch. `advance(logits)` consumes the last-position logits of
those rows and returns the token every surviving row feeds next and the current row it continues
from, so one implementation serves offline generation (`run_search`) and an engine that
concatenates the rows of many searches into one model step. Finished rows leave at once.

Conventions:
- `Hypothesis.tokens` holds generated tokens only. The EOS or stop token that ended a sequence is
  left out, but its log-prob is part of `logprob`/`score` and it counts in the length. Tokens
  that made `stop_fn` fire are kept (the caller trims the stop string from the text).
- Beam search follows Hugging Face's `generate()` rules, so an imported model gives its tokens: a
  finished sequence scores logprob / length ** length_penalty; `early_stopping` True, False or
  "never" as HF defines them (`BeamSearch._open`); at the length limit the best `num_beams`
  candidates finish, whatever their token.
- With ``config.logprobs = N``, every hypothesis also lists each of its tokens' log-prob (log_softmax of the
  raw logits, as ``logprob`` sums them; the terminator's is in ``logprob`` only) and the N likeliest tokens
  at that position with theirs, best first (the distribution the token was picked from, before bans).
- With a seed, input i of a sampling search draws from its own generator seeded `seed + i`, and
  draws noise for all its samples every step, so an input samples the same whatever else shares
  the batch. The engine builds one search per request, so a seeded request is reproducible.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from model.generation_config import ConfigError as ConfigError  # re-exported: the searches' errors
from model.generation_config import GenerationConfig, Strategy, require
from model.logits import (
    NEG_INF,
    banned_ids,
    greedy_choice,
    gumbel_argmax,
    log_probs,
    mask_banned,
    mask_repeats,
    penalize_repeats,
    sampling_logits,
    top_k,
)

logger = logging.getLogger(__name__)

StopFn = Callable[[int, list[int]], bool]
# Finish codes of independent rows (0 = running): EOS, stop token, stop_fn, length.
_EOS, _STOP_TOKEN, _STOP_FN, _LENGTH = 1, 2, 3, 4
_REASON = {_EOS: "eos", _STOP_TOKEN: "stop", _STOP_FN: "stop", _LENGTH: "length"}


@dataclass
class Hypothesis:
    """One finished sequence."""

    tokens: list[int]  # generated tokens only: no prompt, no EOS/stop token
    score: float  # greedy/sample: == logprob; beam: logprob / length ** length_penalty
    logprob: float  # sum of log_softmax(raw logits) of the chosen tokens, terminator included
    finish_reason: str  # "eos" | "stop" | "length"
    token_logprobs: list[float] | None = None  # config.logprobs set: one per token of ``tokens``
    top_logprobs: list[list[tuple[int, float]]] | None = None  # config.logprobs = N: per token, N (id, log-prob)


# ---- searches ---------------------------------------------------------------------------------

class Search(ABC):
    """Decoding state for a group of input sequences; vectorised over its own rows."""

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

        parent_rows index the current rows; R' is the new row count (finished rows are left out).
        The first call sees one row per input and may expand it (beams, samples); once done it
        returns empty tensors.
        """

    @abstractmethod
    def results(self) -> list[list[Hypothesis]]:
        """Finished hypotheses per input, once done."""

    def choices_ahead(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The one row's picks (t,) and their log-probs (t,) at its next t steps, each from the logits (t, V) after
        the picks before it, where they can be made at once (greedy, the same bans at every step); else None."""
        return None

    def _check_logits(self, logits: torch.Tensor) -> None:
        if logits.dim() != 2 or logits.size(0) != self.num_rows:  # (messages built only on failure: every step)
            raise ValueError(f"logits must be (num_rows={self.num_rows}, V), got {tuple(logits.shape)}")
        if max(self.config.finish_token_ids) >= logits.size(1):
            raise ValueError(f"eos/stop token ids {self.config.finish_token_ids} out of vocabulary {logits.size(1)}")

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


def _empty(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    empty = torch.empty(0, dtype=torch.long, device=device)
    return empty, empty.clone()


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
        self._check_logits(logits)
        if self.done:
            return _empty(logits.device)
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
            logits = self._history_rules(logits.clone(), (slots // self.samples).tolist(),
                                         self._tokens[slots, : self.step].tolist())
        tokens, chosen = self._choose(logits)
        if self.config.logprobs is not None:
            self._token_lp[slots, self.step] = chosen
            if self.config.logprobs:
                values, ids = _top(raw, self.config.logprobs)
                self._top_lp[slots, self.step], self._top_ids[slots, self.step] = values, ids
        if whole:  # slices instead of indexed writes
            self._tokens[:, self.step] = tokens
            self._logprob += chosen
        else:
            self._tokens[slots, self.step] = tokens
            self._logprob[slots] += chosen
        self.step += 1
        reason = self._finish_codes(tokens, slots)
        live = reason == 0
        if bool(live.all()):  # the common step: no row finished, nothing to record or index
            return tokens, parents
        self._reason[slots] = reason  # a live row's reason and length are written again when it ends
        self._length[slots] = self.step - ((reason == _EOS) | (reason == _STOP_TOKEN)).long()
        self._slots = slots[live]
        return tokens[live], parents[live]

    def _finish_codes(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Finish code per row (0 = continues), by priority EOS > stop token > stop_fn > length."""
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

    def _finish_code(self, slot: int, sequence: list[int]) -> int:
        """``_finish_codes`` for one slot whose generated tokens are ``sequence`` (its last one just picked)."""
        token, config = sequence[-1], self.config
        if token == config.eos_token_id:
            return _EOS
        if token in config.stop_token_ids:
            return _STOP_TOKEN
        if (self.stop_fn is not None and len(sequence) >= config.min_new_tokens
                and self.stop_fn(slot // self.samples, sequence)):
            return _STOP_FN
        return _LENGTH if len(sequence) >= config.max_new_tokens else 0

    def extend(self, tokens: torch.Tensor, chosen: torch.Tensor, raw: torch.Tensor) -> int:
        """Record consecutive picks (m,) of the search's one live row, with their log-probs (m,) and the raw logits
        they were picked from (m, V) (a verified draft: model.speculative), up to and including the first pick that
        finishes the row; return how many were recorded."""
        if self.num_rows != 1 or self._slots is None:
            raise ValueError(f"extend() records one started row's picks, the search has {self.num_rows} rows")
        slot, start = int(self._slots[0]), self.step
        sequence = self._tokens[slot, :start].tolist() if self.stop_fn is not None else [0] * start
        code = 0
        for token in tokens.tolist():  # a few tokens: Python beats a handful of tensor ops here
            sequence.append(token)
            code = self._finish_code(slot, sequence)
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

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return greedy_choice(logits, self.step, self.config)

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
        super().__init__(config, num_inputs, stop_fn, prefixes, samples=config.num_return_sequences)
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


class _NBest:
    """The best `size` finished hypotheses of one sentence."""

    def __init__(self, size: int):
        self.size = size
        self.hyps: list[Hypothesis] = []

    def add(self, hyp: Hypothesis) -> None:
        self.hyps.append(hyp)
        if len(self.hyps) > self.size:
            self.hyps.remove(min(self.hyps, key=lambda h: h.score))

    @property
    def full(self) -> bool:
        return len(self.hyps) >= self.size

    @property
    def worst(self) -> float:
        return min(h.score for h in self.hyps)


class BeamSearch(Search):
    """Beam search over sentences x beams in one tensor; a finished sentence's rows leave."""

    def __init__(self, config: GenerationConfig, num_inputs: int, prefixes: Sequence[Sequence[int]] | None = None):
        super().__init__(config, num_inputs, prefixes=prefixes)
        self._nbest = [_NBest(config.num_beams) for _ in range(num_inputs)]
        self._sentences: torch.Tensor | None = None  # (S,) input index of each live sentence
        self._scores: torch.Tensor | None = None  # (S, width) sum of log-probs per beam; -inf = empty
        self._history: torch.Tensor | None = None  # (S * width, step) tokens of each row
        self._finish_ids: torch.Tensor | None = None  # EOS + stop ids, on the logits' device
        self._alternatives: _BeamAlternatives | None = None  # config.logprobs set: each row's per-token record

    @property
    def num_rows(self) -> int:
        return self.num_inputs if self._scores is None else self._scores.numel()

    @property
    def done(self) -> bool:
        return self._scores is not None and self._scores.numel() == 0

    def advance(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_logits(logits)
        if self.done:
            return _empty(logits.device)
        device, vocab, beams = logits.device, logits.size(1), self.config.num_beams
        if self._scores is None:  # one row per input; expanded to `beams` rows below
            self._sentences = torch.arange(self.num_inputs, device=device)
            self._scores = torch.zeros(self.num_inputs, 1, device=device)
            self._history = torch.zeros(self.num_inputs, 0, dtype=torch.long, device=device)
            self._finish_ids = torch.tensor(self.config.finish_token_ids, device=device)
            if self.config.logprobs is not None:
                self._alternatives = _BeamAlternatives(self.num_inputs, min(self.config.logprobs, vocab), device)
        sentences, width = self._scores.shape
        logprobs = log_probs(logits)
        if self._alternatives is not None:
            self._alternatives.observe(logprobs)  # before the bans below change it in place
        if self.config.reads_history:  # before mask_banned: a forced EOS wins over a repeat
            self._history_rules(logprobs, self._sentences.repeat_interleave(width).tolist(), self._history.tolist())
        logprobs = mask_banned(logprobs, self.step, self.config, inplace=True)
        if self.config.renormalize:
            logprobs = torch.log_softmax(logprobs, dim=-1)
        flat = logprobs.view(sentences, width, vocab).add_(self._scores[:, :, None]).view(sentences, -1)
        # Enough candidates that `beams` live ones remain even if every beam's EOS/stop tokens rank first.
        count = min(beams * (1 + len(self.config.finish_token_ids)), width * vocab)
        cand_scores, cand_ids = top_k(flat, count)  # (S, count), best first
        cand_tokens = cand_ids % vocab
        cand_rows = cand_ids // vocab + torch.arange(sentences, device=device)[:, None] * width
        finishing = torch.isin(cand_tokens, self._finish_ids)
        self.step += 1
        # As in HF: only candidates ranked within the top `beams` finish a hypothesis (at the length limit, all
        # of them do). Scores are finite, -inf (masked, empty beam) or NaN, so `> NEG_INF` is isfinite() in one op.
        ranked = (torch.arange(count, device=device) < beams) & (cand_scores > NEG_INF)
        if self.step >= self.config.max_new_tokens:
            self._finalize(cand_scores, cand_rows, cand_tokens, ranked)
            self._scores = cand_scores.new_zeros(0, beams)
            return _empty(device)
        self._finalize(cand_scores, cand_rows, cand_tokens, finishing & ranked)
        live_scores, pick = cand_scores.masked_fill(finishing, NEG_INF).topk(min(beams, count), dim=1)
        if pick.size(1) < beams:  # tiny vocabulary: pad with empty (-inf) beams
            pad = beams - pick.size(1)
            live_scores = torch.cat([live_scores, live_scores.new_full((sentences, pad), NEG_INF)], 1)
            pick = torch.cat([pick, pick.new_zeros(sentences, pad)], 1)
        live_rows, live_tokens = cand_rows.gather(1, pick), cand_tokens.gather(1, pick)
        keep = self._open(live_scores)
        if bool(keep.all()):  # the common step: every sentence goes on, nothing to index
            tokens, parents, self._scores = live_tokens.flatten(), live_rows.flatten(), live_scores
        else:
            tokens, parents = live_tokens[keep].flatten(), live_rows[keep].flatten()
            self._sentences, self._scores = self._sentences[keep], live_scores[keep]
        self.tails = _differing_tails(self._history, parents)
        self._history = torch.cat([self._history[parents], tokens[:, None]], dim=1)
        if self._alternatives is not None:
            self._alternatives.extend(parents, tokens)
        return tokens, parents

    def _finalize(self, scores: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, select: torch.Tensor) -> None:
        """Add the selected candidates (S, n) as finished hypotheses of their sentences: ended by their EOS or
        stop token, else by the length limit."""
        where_s, where_c = select.nonzero(as_tuple=True)
        if where_s.numel() == 0:
            return
        penalty = float(self.step) ** self.config.length_penalty  # the terminator counts
        rows, tokens = rows[where_s, where_c], tokens[where_s, where_c].tolist()
        columns = (self._sentences[where_s].tolist(), self._history[rows].tolist(), tokens,
                   scores[where_s, where_c].tolist())
        for i, (input_index, history, token, logprob) in enumerate(zip(*columns, strict=True)):
            if token == self.config.eos_token_id:
                hyp = Hypothesis(history, logprob / penalty, logprob, "eos")
            elif token in self.config.stop_token_ids:
                hyp = Hypothesis(history, logprob / penalty, logprob, "stop")
            else:
                hyp = Hypothesis(history + [token], logprob / penalty, logprob, "length")
            if self._alternatives is not None:
                ended = hyp.finish_reason != "length"  # the terminator is not a token of the hypothesis
                hyp.token_logprobs, hyp.top_logprobs = self._alternatives.row(int(rows[i]), token, ended)
            self._nbest[input_index].add(hyp)

    def _open(self, live_scores: torch.Tensor) -> torch.Tensor:
        """(S,) bool: sentences that keep their beams for another step (HF's stopping rules)."""
        if not any(nbest.full for nbest in self._nbest):  # nothing to beat yet: a sentence with a beam goes on
            return live_scores[:, 0] > NEG_INF  # its best beam (topk order)
        alpha, early = self.config.length_penalty, self.config.early_stopping
        # The length the best live beam is scored at: its current one, or with "never" and a positive penalty
        # (longer scores better) the limit. For a live sum s <= 0 that is its best possible score.
        length = self.config.max_new_tokens if early == "never" and alpha > 0 else self.step
        keep = []
        for input_index, best in zip(self._sentences.tolist(), live_scores[:, 0].tolist(), strict=True):
            nbest = self._nbest[input_index]
            if not math.isfinite(best):
                keep.append(False)
            elif not nbest.full:
                keep.append(True)
            elif early is True:
                keep.append(False)
            else:
                keep.append(best / float(length) ** alpha > nbest.worst)
        return torch.tensor(keep, dtype=torch.bool, device=live_scores.device)

    def results(self) -> list[list[Hypothesis]]:
        """The num_return_sequences best per input, best first (fewer only if the vocabulary is tiny)."""
        self._check_done()
        n = self.config.num_return_sequences
        return [sorted(nbest.hyps, key=lambda h: h.score, reverse=True)[:n] for nbest in self._nbest]


class _BeamAlternatives:
    """What config.logprobs asks of beam search: per live row, each token's log-prob and the top N at its position,
    reordered with the rows (parents) every step like the token history."""

    def __init__(self, rows: int, top: int, device: torch.device) -> None:
        self.top = top  # N, at most the vocabulary
        self.token_lp = torch.zeros(rows, 0, device=device)  # (rows, step)
        self.top_lp = torch.zeros(rows, 0, top, device=device)  # (rows, step, N)
        self.top_ids = torch.zeros(rows, 0, top, dtype=torch.long, device=device)
        self._step: torch.Tensor | None = None  # this step's log-probs (rows, V)
        self._step_top: tuple[torch.Tensor, torch.Tensor] | None = None

    def observe(self, logprobs: torch.Tensor) -> None:
        """This step's log-probs of every row (copied: the search masks its own in place)."""
        self._step = logprobs.clone()
        if self.top:
            self._step_top = self._step.topk(self.top, dim=-1)

    def extend(self, parents: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows continue rows ``parents`` with ``tokens``."""
        chosen = self._step[parents, tokens]
        self.token_lp = torch.cat([self.token_lp[parents], chosen[:, None]], dim=1)
        if self.top:
            values, ids = self._step_top
            self.top_lp = torch.cat([self.top_lp[parents], values[parents][:, None]], dim=1)
            self.top_ids = torch.cat([self.top_ids[parents], ids[parents][:, None]], dim=1)

    def row(self, parent: int, token: int, ended: bool) -> tuple[list[float], list | None]:
        """A hypothesis finishing from row ``parent`` with ``token`` (left out when it is the terminator)."""
        token_lp = self.token_lp[parent].tolist() + ([] if ended else [float(self._step[parent, token])])
        if not self.top:
            return token_lp, None
        ids, values = self.top_ids[parent].tolist(), self.top_lp[parent].tolist()
        if not ended:
            ids.append(self._step_top[1][parent].tolist())
            values.append(self._step_top[0][parent].tolist())
        return token_lp, [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]


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


def _differing_tails(history: torch.Tensor, parents: torch.Tensor) -> torch.Tensor | None:
    """Per new row, how many of the generated tokens in ``history`` (rows, n) it does not share from the start with
    the old row at its index, once it takes the history of old row ``parents[i]``; None when the row count changes."""
    if parents.numel() != history.shape[0]:
        return None
    shared = (history.index_select(0, parents) == history).cumprod(dim=1).sum(dim=1)
    return history.shape[1] - shared


def run_search(search: Search, first_logits: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor],
               select_rows: Callable[[torch.Tensor, torch.Tensor | None], None]) -> list[list[Hypothesis]]:
    """Drive `search` offline: step(tokens) -> next logits; select_rows(parents, tails) reorders per-row state
    (``tails``: :attr:`Search.tails`)."""
    logits = first_logits
    steps = 0
    while True:
        rows = search.num_rows
        tokens, parents = search.advance(logits)
        steps += 1
        if search.done:
            logger.debug("search over %d inputs done after %d steps", search.num_inputs, steps)
            return search.results()
        if parents.numel() != rows or not torch.equal(parents, torch.arange(rows, device=parents.device)):
            select_rows(parents, search.tails)
        logits = step(tokens)
