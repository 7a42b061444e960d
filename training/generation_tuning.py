"""Choose a causal LM's anti-loop generation defaults on its valid split (`python -m training tune-generation`).

Prompts are windows of the valid text (``prompt_tokens`` tokens each, starting at line breaks), each followed
by its true continuation. For every setting of the grid (``repetition_penalty`` x ``no_repeat_ngram_size``) the
model completes every prompt greedily with ``new_tokens`` tokens (min_new_tokens = new_tokens, so a completion is
never cut short by an early EOS); each completion is scored for **looping** (its last ``LOOP_WINDOW`` tokens
repeat with a period of at most ``LOOP_MAX_PERIOD`` tokens: `'w, 'w, 'w` or the same line over and over) and for
**chrF** against the true continuation. The chosen setting has the best chrF among those that at least halve the
unpenalized loop rate (none does: the plain setting stays); with ``write`` it goes into the checkpoint's
generation_config.json, which the service reads as the model's defaults (model.hf.generation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import sacrebleu
import torch

from model.checkpoint import Checkpoint
from model.generation import generate_causal
from model.generation_config import GenerationConfig
from model.hf.generation import GENERATION_FILE

LOOP_WINDOW = 24  # tokens at a completion's end that must repeat to call it a loop
LOOP_MAX_PERIOD = 8  # longest repeating unit, in tokens
PENALTIES = (1.0, 1.1, 1.2, 1.3, 1.5)
NGRAM_SIZES = (0, 4)


@dataclass(frozen=True)
class Setting:
    repetition_penalty: float
    no_repeat_ngram_size: int


@dataclass(frozen=True)
class Score:
    setting: Setting
    loop_rate: float  # share of completions that end in a loop
    chrf: float  # against the true continuations


def is_loop(tokens: list[int], window: int = LOOP_WINDOW, max_period: int = LOOP_MAX_PERIOD) -> bool:
    """Whether the last ``window`` tokens repeat with some period of at most ``max_period`` tokens."""
    if len(tokens) < window:
        return False
    tail = tokens[-window:]
    return any(all(tail[i] == tail[i - period] for i in range(period, window)) for period in range(1, max_period + 1))


def windows(text: str, checkpoint: Checkpoint, count: int, prompt_tokens: int, new_tokens: int
            ) -> list[tuple[list[int], str]]:
    """Up to ``count`` (prompt ids, true continuation text) pairs, spread evenly over ``text``."""
    tokenizer = checkpoint.tokenizer
    starts = [i + 1 for i, c in enumerate(text) if c == "\n"]
    step = max(1, len(starts) // max(count, 1))
    pairs = []
    for start in starts[::step]:
        ids = tokenizer.encode(text[start: start + 8 * (prompt_tokens + new_tokens)])
        if len(ids) >= prompt_tokens + new_tokens:
            pairs.append(([checkpoint.config.bos_id, *ids[:prompt_tokens]],
                          tokenizer.decode(ids[prompt_tokens: prompt_tokens + new_tokens])))
        if len(pairs) == count:
            break
    return pairs


def score(checkpoint: Checkpoint, pairs: list[tuple[list[int], str]], setting: Setting, new_tokens: int,
          batch: int = 32) -> Score:
    """Greedy completions of every prompt under ``setting``: their loop rate and chrF."""
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              eos_token_id=checkpoint.config.eos_id,
                              repetition_penalty=setting.repetition_penalty,
                              no_repeat_ngram_size=setting.no_repeat_ngram_size)
    completions: list[list[int]] = []
    for i in range(0, len(pairs), batch):
        prompts = [prompt for prompt, _ in pairs[i: i + batch]]
        completions += [hyps[0].tokens for hyps in generate_causal(checkpoint.model, prompts, config)]
    texts = [checkpoint.tokenizer.decode(tokens) for tokens in completions]
    chrf = sacrebleu.corpus_chrf(texts, [[reference for _, reference in pairs]]).score
    return Score(setting, sum(map(is_loop, completions)) / len(completions), chrf)


def choose(scores: list[Score]) -> Setting:
    """The best chrF among the settings that at least halve the plain setting's loop rate (else the plain one)."""
    plain = next(s for s in scores if s.setting == Setting(1.0, 0))
    better = [s for s in scores if s.loop_rate <= plain.loop_rate / 2 and plain.loop_rate > 0]
    return max(better, key=lambda s: s.chrf).setting if better else plain.setting


def tune(checkpoint: Checkpoint, valid_text: str, prompts: int, prompt_tokens: int, new_tokens: int,
         penalties: tuple[float, ...] = PENALTIES, ngram_sizes: tuple[int, ...] = NGRAM_SIZES
         ) -> tuple[list[Score], Setting]:
    """Every setting's score on the valid windows, and the chosen setting. A model too short for the windows asked
    gets a third of its positions as prompt and the rest as completion."""
    if checkpoint.config.family != "causal_lm":
        raise ValueError(f"tunes a causal LM's generation, got a {checkpoint.config.family} model")
    room = checkpoint.config.max_len - 1  # after the BOS
    if prompt_tokens + new_tokens > room:
        prompt_tokens = room // 3
        new_tokens = room - prompt_tokens
    pairs = windows(valid_text, checkpoint, prompts, prompt_tokens, new_tokens)
    if not pairs:
        raise ValueError(f"the valid text holds no window of {prompt_tokens} + {new_tokens} tokens")
    with torch.inference_mode():
        scores = [score(checkpoint, pairs, Setting(p, n), new_tokens) for p in penalties for n in ngram_sizes]
    return scores, choose(scores)


def write_defaults(directory: Path, setting: Setting) -> Path:
    """Merge ``setting`` into ``directory``'s generation_config.json (other keys kept); return its path."""
    path = directory / GENERATION_FILE
    current = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    current |= {"repetition_penalty": setting.repetition_penalty, "no_repeat_ngram_size": setting.no_repeat_ngram_size}
    path.write_text(json.dumps(current, indent=2) + "\n", encoding="utf-8")
    return path


def table(scores: list[Score], chosen: Setting, prompts: int) -> str:
    """The scores as a markdown table, the chosen row marked."""
    rows = ["| repetition_penalty | no_repeat_ngram_size | loop rate | chrF | |", "|---|---|---|---|---|"]
    rows += [f"| {s.setting.repetition_penalty:g} | {s.setting.no_repeat_ngram_size} | {s.loop_rate:.1%} | "
             f"{s.chrf:.1f} | {'chosen' if s.setting == chosen else ''} |" for s in scores]
    return "\n".join([f"{prompts} valid windows, greedy", "", *rows])
