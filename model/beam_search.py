"""Beam search over sentences x beams, one tensor for every live sentence (a :class:`model.search.Search`).

It follows Hugging Face's `generate()` rules, so an imported model gives its tokens: a finished sequence scores
logprob / length ** length_penalty; `early_stopping` True, False or "never" as HF defines them
(`BeamSearch._open`); at the length limit the best `num_beams` candidates finish, whatever their token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from model.generation_config import GenerationConfig
from model.logits import NEG_INF, banned_ids, forces_eos, fused_beam_top_k, log_probs, mask_banned, top_k
from model.search import Hypothesis, Search


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

    picks_by_columns = True

    def __init__(self, config: GenerationConfig, num_inputs: int, prefixes: Sequence[Sequence[int]] | None = None):
        super().__init__(config, num_inputs, prefixes=prefixes)
        self._nbest = [_NBest(config.num_beams) for _ in range(num_inputs)]
        self._sentences: torch.Tensor | None = None  # (S,) input index of each live sentence
        self._scores: torch.Tensor | None = None  # (S, width) sum of log-probs per beam; -inf = empty
        self._history: torch.Tensor | None = None  # (S * width, step) tokens of each row
        self._finish_ids: torch.Tensor | None = None  # EOS + stop ids, on the logits' device
        self._layouts: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # see _layout
        self._leads: dict[tuple[int, int], torch.Tensor] = {}  # (sentences, width) -> each row's first beam
        self._alternatives: _BeamAlternatives | None = None  # config.logprobs set: each row's per-token record

    @property
    def num_rows(self) -> int:
        return self.num_inputs if self._scores is None else self._scores.numel()

    @property
    def done(self) -> bool:
        return self._scores is not None and self._scores.numel() == 0

    def advance(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config, column_ids = self.logit_space()  # columns -> token ids under a compact restriction
        self._check_logits(logits, config)
        if self.done:
            return self._empty(logits.device)
        device, vocab, beams = logits.device, logits.size(1), self.config.num_beams
        if self._scores is None:  # one row per input; expanded to `beams` rows below
            self._sentences = torch.arange(self.num_inputs, device=device)
            self._scores = torch.zeros(self.num_inputs, 1, device=device)
            self._history = torch.zeros(self.num_inputs, 0, dtype=torch.long, device=device)
            self._finish_ids = torch.tensor(self.config.finish_token_ids, device=device)
            if self.config.logprobs is not None:
                self._alternatives = _BeamAlternatives(self.num_inputs, min(self.config.logprobs, vocab), device)
        sentences, width = self._scores.shape
        # Enough candidates that `beams` live ones remain even if every beam's EOS/stop tokens rank first.
        count = min(beams * (1 + len(self.config.finish_token_ids)), width * vocab)
        fused = None if self._needs_distribution() else \
            fused_beam_top_k(logits, self._scores, count, banned_ids(self.step, config))
        cand_scores, cand_ids = fused if fused is not None else self._candidates(logits, count, config)  # (S, count)
        cand_tokens = cand_ids % vocab if column_ids is None else column_ids[cand_ids % vocab]
        first_rows, top_ranks = self._layout(sentences, width, count, device)
        cand_rows = cand_ids // vocab + first_rows
        finishing = self._finishing(cand_tokens)
        self.step += 1
        # As in HF: only candidates ranked within the top `beams` finish a hypothesis (at the length limit, all
        # of them do). Scores are finite, -inf (masked, empty beam) or NaN, so `> NEG_INF` is isfinite() in one op.
        ranked = top_ranks & (cand_scores > NEG_INF)
        if self.step >= self.config.max_new_tokens:
            self._finalize(cand_scores, cand_rows, cand_tokens, ranked)
            self._scores = cand_scores.new_zeros(0, beams)
            return self._empty(device)
        self._finalize(cand_scores, cand_rows, cand_tokens, finishing & ranked)
        live_scores, pick = cand_scores.masked_fill(finishing, NEG_INF).topk(min(beams, count), dim=1)
        if pick.size(1) < beams:  # tiny vocabulary: pad with empty (-inf) beams
            pad = beams - pick.size(1)
            live_scores = torch.cat([live_scores, live_scores.new_full((sentences, pad), NEG_INF)], 1)
            pick = torch.cat([pick, pick.new_zeros(sentences, pad)], 1)
        live_rows, live_tokens = cand_rows.gather(1, pick), cand_tokens.gather(1, pick)
        keep = self._open(live_scores)
        if all(keep):  # the common step: every sentence goes on, nothing to index
            tokens, parents, self._scores = live_tokens.flatten(), live_rows.flatten(), live_scores
        else:
            keep = torch.tensor(keep, dtype=torch.bool, device=device)
            tokens, parents = live_tokens[keep].flatten(), live_rows[keep].flatten()
            self._sentences, self._scores = self._sentences[keep], live_scores[keep]
        inherited = self._history.index_select(0, parents)  # each new row's history before its token
        self.tails = _differing_tails(self._history, inherited)
        self._history = torch.cat([inherited, tokens[:, None]], dim=1)
        if self._alternatives is not None:
            self._alternatives.extend(parents, tokens)
        return tokens, parents

    def shared_history(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each sentence's beams (runs of ``width`` rows): per row, its sentence's first beam and the leading tokens of
        its history equal to that beam's."""
        if self._history is None or self._scores is None or self._scores.shape[1] < 2:
            return None
        sentences, width = self._scores.shape
        history = self._history.view(sentences, width, -1)
        key = (sentences, width)
        if key not in self._leads:
            self._leads[key] = torch.arange(sentences * width, device=history.device) // width * width
        return self._leads[key], _common_prefix(history, history[:, :1]).flatten()

    def _layout(self, sentences: int, width: int, count: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(each sentence's first row (S, 1), whether each candidate rank is within the top ``num_beams`` (count,)):
        made once per shape and kept, as the tensor ops of the search's bookkeeping each cost ~10-20 us when a
        decoding step has pushed them out of the caches (0.49 ms of Flan-T5-base's int8 beam-4 step; helper T,
        session 29)."""
        key = (sentences, width, count)
        if key not in self._layouts:
            self._layouts[key] = (torch.arange(sentences, device=device)[:, None] * width,
                                  torch.arange(count, device=device) < self.config.num_beams)
        return self._layouts[key]

    def _finishing(self, tokens: torch.Tensor) -> torch.Tensor:
        """Which of ``tokens`` are EOS or stop tokens (one comparison where EOS is the only one)."""
        finish = self.config.finish_token_ids
        return tokens == finish[0] if len(finish) == 1 else torch.isin(tokens, self._finish_ids)

    def _needs_distribution(self) -> bool:
        """Whether this step needs every row's full log-probs (the rules that read or rewrite them: the history
        rules, renormalize, a forced EOS, logprobs); else the fused top-k (model.logits.fused_beam_top_k) serves."""
        config = self.config
        return (config.reads_history or config.renormalize or config.logprobs is not None
                or forces_eos(self.step, config))

    def _candidates(self, logits: torch.Tensor, count: int, config: GenerationConfig
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``count`` of every sentence's log-probs plus beam scores over the full distribution (S, count):
        (values, ids of row-in-sentence * V + column), best first; ``config``: the logit space's (bans as columns)."""
        (sentences, width), vocab = self._scores.shape, logits.size(1)
        logprobs = log_probs(logits)
        if self._alternatives is not None:
            self._alternatives.observe(logprobs)  # before the bans below change it in place
        if self.config.reads_history:  # before mask_banned: a forced EOS wins over a repeat
            self._history_rules(logprobs, self._sentences.repeat_interleave(width).tolist(), self._history.tolist())
        logprobs = mask_banned(logprobs, self.step, config, inplace=True)
        if self.config.renormalize:
            logprobs = torch.log_softmax(logprobs, dim=-1)
        flat = logprobs.view(sentences, width, vocab).add_(self._scores[:, :, None]).view(sentences, -1)
        return top_k(flat, count)

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

    def _open(self, live_scores: torch.Tensor) -> list[bool]:
        """Per sentence, whether it keeps its beams for another step (HF's stopping rules)."""
        bests = live_scores[:, 0].tolist()  # each sentence's best beam (topk order)
        if not any(nbest.full for nbest in self._nbest):  # nothing to beat yet: a sentence with a beam goes on
            return [best > NEG_INF for best in bests]
        alpha, early = self.config.length_penalty, self.config.early_stopping
        # The length the best live beam is scored at: its current one, or with "never" and a positive penalty
        # (longer scores better) the limit. For a live sum s <= 0 that is its best possible score.
        length = self.config.max_new_tokens if early == "never" and alpha > 0 else self.step
        keep = []
        for input_index, best in zip(self._sentences.tolist(), bests, strict=True):
            nbest = self._nbest[input_index]
            if not math.isfinite(best):
                keep.append(False)
            elif not nbest.full:
                keep.append(True)
            elif early is True:
                keep.append(False)
            else:
                keep.append(best / float(length) ** alpha > nbest.worst)
        return keep

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


def _differing_tails(history: torch.Tensor, inherited: torch.Tensor) -> torch.Tensor | None:
    """Per new row, how many of the generated tokens in ``history`` (rows, n) it does not share from the start with
    the old row at its index, once it takes the history ``inherited[i]`` (of its parent); None when the row count
    changes."""
    if inherited.shape[0] != history.shape[0]:
        return None
    return history.shape[1] - _common_prefix(inherited, history)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many leading tokens (along the last dim) ``a`` and ``b`` share, per row."""
    return (a == b).cumprod(dim=-1).sum(dim=-1)
