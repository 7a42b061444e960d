"""Speculative decoding: drafts by prompt lookup (n-gram) or by a smaller draft model, verified by the model itself.

A draft is a guess of the next k tokens: by **prompt lookup**, the tokens that followed the latest earlier
occurrence of the sequence's last n tokens (n from ``ngram_max`` down to ``ngram_min``), in the prompt or in what
was generated (code and translations copy a lot); by a **draft model** (a smaller causal LM with the same
tokenizer), its own greedy continuation, from a one-row KV cache it keeps across steps. The model then runs the
token it was going to feed plus the draft in one step (k + 1 positions), and the row's own search walks the k + 1
logits: it picks a token from the first; while that token
equals the next draft token, the following logits are valid too (they were computed after exactly that token),
so it picks again; the first pick that differs from the draft (or a pick after the whole draft) is fed next, and
the cache forgets the rejected draft positions.

Every token is therefore chosen by the search from the model's distribution given the true prefix: greedy output
is the plain greedy output, and sampling keeps the target distribution exactly (for a one-token draft "q", the
speculative sampling rule of Leviathan et al. and Chen et al. accepts with probability p(q) and otherwise draws
from p without q, renormalized, which is the same as drawing from p and checking for q). A seeded sampler draws
the same noise per position as without speculation, so seeded outputs are unchanged too. Both drafters are
deterministic given the sequence, so this holds for either. Beam search does not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.causal_lm import CausalLM
from model.generation_config import ConfigError, require
from model.search import Search

MAX_SPECULATIVE_TOKENS = 16  # draft tokens per step; more costs a longer verification step for little gain
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft: ``method`` "ngram" (prompt lookup) or "draft_model" (the model's configured draft model),
    proposing up to ``num_tokens`` tokens per step."""

    method: str = "ngram"
    num_tokens: int = 4
    ngram_max: int = 3  # longest tail looked up
    ngram_min: int = 1  # shortest tail looked up

    def __post_init__(self) -> None:
        require(self.method in METHODS, "method", f"must be one of {list(METHODS)}, got {self.method!r}")
        require(isinstance(self.num_tokens, int) and 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS, "num_tokens",
                f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_tokens!r}")
        require(1 <= self.ngram_min <= self.ngram_max, "ngram_min", f"must be in [1, ngram_max={self.ngram_max}]")


def speculative_for(spec: str, name: str) -> SpeculativeConfig | None:
    """The drafting ``spec`` gives model ``name`` (None: none): "none", "ngram:K" or "draft_model:K" (K draft tokens
    per step), or "name=..." entries and an optional bare default, e.g. "none,code=ngram:4"."""
    default, chosen = None, {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        key, _, value = entry.rpartition("=")
        method, _, count = value.partition(":")
        if value == "none":
            config = None
        elif method in METHODS and count.isdigit():
            config = SpeculativeConfig(method, int(count))
        else:
            raise ConfigError("speculative", f"{value!r} in {spec!r}: expected none, ngram:K or draft_model:K")
        if key:
            chosen[key] = config
        else:
            default = config
    return chosen.get(name, default)


class NgramDrafter:
    """Prompt lookup over one growing sequence: for every n in [ngram_min, ngram_max], where each n-gram was last
    followed by a token (an index kept up to date as tokens arrive, so a lookup is a few dict reads)."""

    def __init__(self, config: SpeculativeConfig, tokens: list[int]) -> None:
        self.config = config
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence is
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Add the sequence's next token."""
        end = len(self.tokens)
        for n in range(self.config.ngram_min, min(self.config.ngram_max, end) + 1):
            self._next[tuple(self.tokens[end - n:end])] = end
        self.tokens.append(token)

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens guessed to follow the sequence (empty when its tail never occurred before)."""
        for n in range(min(self.config.ngram_max, len(self.tokens)), self.config.ngram_min - 1, -1):
            start = self._next.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + limit]
        return []


def draft_model_for(spec: str, name: str, family: str = "causal_lm") -> str | None:
    """The draft model ``spec`` names for model ``name`` of ``family`` (None: none): "" (none), "target=draft"
    entries, or a bare draft name for every causal LM but itself, e.g. "code=code-small". Names are directory names
    (no path separators)."""
    default, chosen = None, {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        target, _, draft = entry.rpartition("=")
        if not draft or (target == "" and "=" in entry) or any(c in draft for c in "/\\") or draft.startswith("."):
            raise ConfigError("draft_model", f"{entry!r} in {spec!r}: expected DRAFT or TARGET=DRAFT (a model's "
                              "directory name)")
        if target:
            chosen[target] = draft
        else:
            default = draft
    draft = chosen.get(name, default if family == "causal_lm" else None)
    return draft if draft != name else None


def check_draft_model(target: CausalLM, target_vocab: dict[str, int], draft: CausalLM,
                      draft_vocab: dict[str, int]) -> None:
    """Raise ConfigError unless ``draft`` can draft for ``target``: both causal LMs with the same vocabulary."""
    if not isinstance(target, CausalLM) or not isinstance(draft, CausalLM):
        raise ConfigError("draft_model", f"drafts for a causal LM with a causal LM, got {type(target).__name__} "
                          f"and {type(draft).__name__}")
    if target.config.vocab_size != draft.config.vocab_size or target_vocab != draft_vocab:
        raise ConfigError("draft_model", f"needs the model's tokenizer: vocabularies of {len(draft_vocab)} / "
                          f"{draft.config.vocab_size} and {len(target_vocab)} / {target.config.vocab_size} tokens "
                          "differ")


class ModelDrafter:
    """Greedy drafts by a smaller causal LM over one growing sequence. Its one-row KV cache keeps the positions that
    are still the sequence's (after a partly rejected draft it forgets the rest), so a draft costs the tokens
    accepted since the last one plus one draft-model step per drafted token."""

    def __init__(self, config: SpeculativeConfig, model: CausalLM, tokens: list[int]) -> None:
        self.config = config
        self.model = model
        self.tokens = list(tokens)
        self._cached: list[int] = []  # the tokens whose keys and values are in the cache, in order
        self._cache = model.new_cache(1, capacity=min(len(tokens) + 2 * MAX_SPECULATIVE_TOKENS, model.config.max_len))

    def append(self, token: int) -> None:
        """Add the sequence's next token."""
        self.tokens.append(token)

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the draft model continues the sequence with (fewer near its length limit)."""
        limit = min(limit, self.model.config.max_len - len(self.tokens))
        if limit <= 0 or not self.tokens:
            return []
        keep = 0
        while keep < min(len(self._cached), len(self.tokens) - 1) and self._cached[keep] == self.tokens[keep]:
            keep += 1  # the last token is always fed: its logits start the draft
        fed = self.tokens[keep:]
        self._cache.truncate(torch.tensor([keep], device=self._cache.lengths.device))
        ids = torch.tensor([fed], device=self._cache.lengths.device)
        logits = self.model.verify_step(ids, self._cache)[:, -1]
        self._cached = list(self.tokens)
        draft: list[int] = []
        while True:
            draft.append(int(logits[0].argmax()))
            if len(draft) == limit:
                return draft
            logits = self.model.decode_step(torch.tensor(draft[-1:], device=ids.device), self._cache)
            self._cached.append(draft[-1])


Drafter = NgramDrafter | ModelDrafter


def next_draft(drafter: Drafter, search: Search) -> list[int]:
    """The draft for a single-row ``search``'s next step: up to the drafter's ``num_tokens``, as many as fit before
    max_new_tokens with the step's own pick after them (none when only that pick fits)."""
    room = search.config.max_new_tokens - search.step - 1
    return drafter.draft(min(drafter.config.num_tokens, room)) if room > 0 else []


def make_drafter(config: SpeculativeConfig, tokens: list[int], draft_model: CausalLM | None) -> Drafter:
    """The drafter ``config`` asks for over ``tokens`` (the sequence so far); "draft_model" needs ``draft_model``."""
    if config.method == "ngram":
        return NgramDrafter(config, tokens)
    if draft_model is None:
        raise ConfigError("speculative", "method draft_model needs a draft model, and none is configured")
    return ModelDrafter(config, draft_model, tokens)


@dataclass
class Verdict:
    """What one verification step gave a single-row search."""

    tokens: list[int]  # chosen, in order (the accepted draft tokens, then the search's own pick)
    accepted: int  # how many draft tokens were accepted (their K/V stay in the cache)
    next_token: torch.Tensor | None  # (1,) what to feed next; None once the search is done


def verify(search: Search, logits: torch.Tensor, draft: list[int]) -> Verdict:
    """Walk a single-row search over ``logits`` (1 + len(draft), V), computed after the fed token and each draft
    token; stop at the first pick that is not the next draft token, or when the search ends. A greedy search picks
    at every position at once and records the kept picks in one call (``choices_ahead``, ``extend``)."""
    if search.num_rows != 1:
        raise ConfigError("speculative", f"speculates for a single row, the search has {search.num_rows}")
    ahead = search.choices_ahead(logits)
    if ahead is None:
        return _verify_stepwise(search, logits, draft)
    tokens, chosen = ahead
    picks = tokens.tolist()
    agreed = 0
    while agreed < len(draft) and picks[agreed] == draft[agreed]:
        agreed += 1
    kept = search.extend(tokens[: agreed + 1], chosen[: agreed + 1], logits[: agreed + 1])
    if search.done:  # the finishing pick, kept or not, is in the search's results
        return Verdict(picks[: kept - 1], kept - 1, None)
    return Verdict(picks[: agreed + 1], agreed, tokens[agreed: agreed + 1])


def _verify_stepwise(search: Search, logits: torch.Tensor, draft: list[int]) -> Verdict:
    """``verify`` one position at a time: the search advances on each position's logits in turn."""
    chosen: list[int] = []
    for position in range(len(draft) + 1):
        tokens, _ = search.advance(logits[position:position + 1])
        if search.done:
            return Verdict(chosen, position, None)
        token = int(tokens[0])
        chosen.append(token)
        if position == len(draft) or token != draft[position]:
            return Verdict(chosen, position, tokens)
    raise AssertionError("unreachable: the loop returns at its last position")
