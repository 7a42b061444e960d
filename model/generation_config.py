"""How to decode: the GenerationConfig of model.decoding's searches, validated on construction.

A leaf module, so that model.logits (which reads a config) and model.decoding (which imports model.logits)
share it without importing each other; model.decoding re-exports its names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

MAX_LOGPROBS = 20  # most alternatives per generated token a search records (OpenAI's top_logprobs cap)
# |length_penalty| at most this: length ** penalty stays a float for any length (1e308 overflows at length 2)
MAX_LENGTH_PENALTY = 10.0


class ConfigError(ValueError):
    """A GenerationConfig field (``field``) out of its domain; ``str(exc)`` is "field message"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.message = message


def require(ok: bool, field: str, message: str) -> None:
    """Raise ConfigError(field, message) unless ``ok``."""
    if not ok:
        raise ConfigError(field, message)


class Strategy(StrEnum):
    """How a search picks tokens (the one list of strategies; equal to their names as strings)."""

    GREEDY = "greedy"
    BEAM = "beam"
    SAMPLE = "sample"


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode; validated on construction."""

    strategy: Strategy = Strategy.GREEDY  # a name ("beam") is taken too
    max_new_tokens: int = 64
    min_new_tokens: int = 0  # EOS/stop tokens (and stop_fn) are disabled until this many are generated
    num_beams: int = 4  # beam only
    length_penalty: float = 1.0  # beam: score = sum_logprob / len ** length_penalty (len counts the EOS)
    # beam, as HF: True stops at num_beams finished; False when the best live beam, scored at its current
    # length, cannot beat them (HF's default heuristic); "never" when no live beam can beat them at any length
    early_stopping: bool | Literal["never"] = True
    num_return_sequences: int = 1  # beam: n-best (<= num_beams); sample: samples per input
    temperature: float = 1.0  # sample only
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus, 1.0 = off
    seed: int | None = None  # sample: per-input generators seeded seed + input index
    eos_token_id: int = 2
    stop_token_ids: tuple[int, ...] = ()  # end a sequence with finish_reason "stop"; not kept in tokens
    banned_token_ids: tuple[int, ...] = ()  # never generated (HF's single-token bad_words_ids: Marian's pad)
    forced_eos: bool = False  # the last allowed token is EOS, with log-prob 0 (HF's forced_eos_token_id)
    renormalize: bool = False  # beam: log-probs renormalized over the allowed tokens (HF's renormalize_logits)
    no_repeat_ngram_size: int = 0  # > 0: no n-gram of this size occurs twice in prefix + output (as HF)
    repetition_penalty: float = 1.0  # > 1: tokens of prefix + output less likely (HF's rule: score / p if > 0 else * p)
    logprobs: int | None = None  # N: record each token's log-prob and the N likeliest tokens at its position

    @property
    def rows_per_input(self) -> int:
        """Most rows a search of this config holds per input: its beams, its samples, or one (greedy)."""
        return {Strategy.BEAM: self.num_beams, Strategy.SAMPLE: self.num_return_sequences}.get(self.strategy, 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "banned_token_ids", tuple(self.banned_token_ids))
        require(self.strategy in set(Strategy), "strategy",
                 f"must be one of {[s.value for s in Strategy]}, got {self.strategy!r}")
        object.__setattr__(self, "strategy", Strategy(self.strategy))
        for name in ("max_new_tokens", "min_new_tokens", "num_beams", "num_return_sequences", "top_k",
                     "no_repeat_ngram_size"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool), name, f"must be an int, got {value!r}")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        require(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                 f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        require(self.num_beams >= 1, "num_beams", f"must be >= 1, got {self.num_beams}")
        require(self.num_return_sequences >= 1, "num_return_sequences",
                 f"must be >= 1, got {self.num_return_sequences}")
        if self.strategy == Strategy.BEAM:
            require(self.num_return_sequences <= self.num_beams, "num_return_sequences",
                     f"must be <= num_beams={self.num_beams} for beam search, got {self.num_return_sequences}")
        if self.strategy == Strategy.GREEDY:
            require(self.num_return_sequences == 1, "num_return_sequences",
                     f"must be 1 for greedy, got {self.num_return_sequences}")
        require(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
                 f"must be true, false or 'never', got {self.early_stopping!r}")
        require(isinstance(self.length_penalty, int | float) and abs(self.length_penalty) <= MAX_LENGTH_PENALTY,
                "length_penalty", f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {self.length_penalty!r}")
        require(math.isfinite(self.temperature) and self.temperature > 0, "temperature",
                 f"must be finite and > 0, got {self.temperature}")
        require(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}")
        require(self.no_repeat_ngram_size >= 0, "no_repeat_ngram_size",
                 f"must be >= 0, got {self.no_repeat_ngram_size}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(isinstance(self.repetition_penalty, int | float) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0, "repetition_penalty",
                f"must be finite and > 0, got {self.repetition_penalty!r}")
        require(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed",
                 f"must be None or an int in [0, 2**63), got {self.seed!r}")
        require(isinstance(self.eos_token_id, int) and self.eos_token_id >= 0, "eos_token_id",
                 f"must be an int >= 0, got {self.eos_token_id!r}")
        for name in ("stop_token_ids", "banned_token_ids"):
            ids = getattr(self, name)
            require(all(isinstance(t, int) and t >= 0 for t in ids), name, f"must be ints >= 0, got {ids!r}")
        require(self.eos_token_id not in self.banned_token_ids, "eos_token_id", "cannot be banned")
        require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
                "logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def reads_history(self) -> bool:
        """Whether a step's scores depend on the sequence so far (n-gram bans, the repetition penalty)."""
        return bool(self.no_repeat_ngram_size) or self.repetition_penalty != 1.0

    @property
    def finish_token_ids(self) -> tuple[int, ...]:
        """EOS followed by the stop tokens."""
        return (self.eos_token_id, *self.stop_token_ids)
