"""Batched generation: the models' decode steps driven by a search (model.search, made by model.decoding).

Inputs are token id lists of any lengths (right-padded into one batch); rows may use different
LoRA adapters. A batch gives each input the same result as decoding it alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from model.causal_lm import CausalLM
from model.decoding import make_search
from model.generation_config import ConfigError, GenerationConfig, Strategy
from model.kv_cache import KVCache
from model.lora import AdapterSelection, set_adapters, use_adapters
from model.restricted_vocab import VocabularyRestriction
from model.search import Hypothesis, Search, StopFn, force_first_tokens, run_search
from model.seq2seq import Seq2SeqTransformer
from model.speculative import Drafter, SpeculativeConfig, make_drafter, next_draft, verify
from model.tokenizer import Tokenizer, pad_batch
from model.vocab_map import AnyVocabularyMap, target_languages


class InputTooLongError(ValueError):
    """An input plus the requested new tokens does not fit the model's maximum length."""


def generate_causal(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    adapters: AdapterSelection = None,
    stop_fn: StopFn | None = None,
    use_cache: bool = True,
    speculative: SpeculativeConfig | None = None,
    draft_model: CausalLM | None = None,
) -> list[list[Hypothesis]]:
    """Continue each prompt; returns per prompt the hypotheses of ``config`` (best first). ``speculative``: draft
    and verify several tokens per step (model.speculative; one prompt, greedy or one sample: same outputs), with
    ``draft_model`` for the method "draft_model"."""
    _check_lengths([len(p) for p in prompts], config.max_new_tokens, model.config.max_len, "prompt")
    device = next(model.parameters()).device
    ids, lengths = (t.to(device) for t in pad_batch(prompts, model.config.pad_id))
    search = make_search(config, len(prompts), stop_fn, prefixes=prompts)
    with torch.inference_mode(), _AdapterRows(model, adapters, len(prompts)) as rows:
        if not use_cache:
            state = _Recompute(model, [list(p) for p in prompts])
            return run_search(search, state.logits(), state.step, rows.select_with(state.select))
        cache = model.new_cache(len(prompts), capacity=ids.shape[1] + config.max_new_tokens)
        first = model.prefill(ids, lengths, cache)
        if speculative is not None:
            drafter = make_drafter(speculative, list(prompts[0]), draft_model)
            return _run_speculative(model, search, first, cache, drafter)
        return run_search(search, first, lambda t: model.decode_step(t, cache), rows.select_with(cache.select),
                          cache.share_beam_prefix)


def _run_speculative(model: CausalLM, search: Search, first: torch.Tensor, cache: KVCache,
                     drafter: Drafter) -> list[list[Hypothesis]]:
    """A single-row search driven by draft-and-verify steps (model.speculative)."""
    if search.num_rows != 1 or search.config.strategy == Strategy.BEAM or search.config.num_return_sequences != 1:
        raise ConfigError("speculative", "needs one prompt and one greedy or sampled sequence")
    tokens, _ = search.advance(first)
    while not search.done:
        drafter.append(int(tokens[0]))
        draft = next_draft(drafter, search)
        before = cache.lengths
        fed = torch.tensor([[int(tokens[0]), *draft]], device=before.device)
        verdict = verify(search, model.verify_step(fed, cache)[0], draft)
        cache.truncate(before + 1 + verdict.accepted)
        for token in verdict.tokens[:-1]:
            drafter.append(token)
        tokens = verdict.next_token
    return search.results()


def generate_seq2seq(
    model: Seq2SeqTransformer,
    sources: Sequence[Sequence[int]],
    config: GenerationConfig,
    adapters: AdapterSelection = None,
    targets: Sequence[Sequence[int]] | None = None,
    vocab_map: AnyVocabularyMap | None = None,
    forced_first: Sequence[int | None] | None = None,
) -> list[list[Hypothesis]]:
    """Translate each source; returns per source the hypotheses of ``config`` (best first). ``targets``: per source,
    the start of its translation (target tokens) to continue; the hypotheses hold what follows it. ``vocab_map``:
    each translation uses only its source's candidate tokens (model.vocab_map, CTranslate2's use_vmap; per-language
    maps: its target language's, the language being its forced first token or its prefix's first token).
    ``forced_first``: per source, the token its translation must start with (a target language's, or None), generated
    as generate()'s forced_bos_token_id is (model.search.force_first_tokens); a source with a target prefix is
    continued from it instead, which must then start with that token."""
    targets = [list(t) for t in targets] if targets is not None else [[] for _ in sources]
    forced = _forced_rows(forced_first, targets)
    _check_lengths([len(s) for s in sources], 0, model.config.max_src_len, "source")
    _check_lengths([len(t) for t in targets], config.max_new_tokens + 1, model.config.max_len, "output")
    device = next(model.parameters()).device
    src, _ = pad_batch(sources, model.config.pad_id)
    search = make_search(config, len(sources), prefixes=[[model.config.bos_id, *t] for t in targets])
    with torch.inference_mode(), _AdapterRows(model, adapters, len(sources)) as rows:
        capacity = config.max_new_tokens + 1 + max(map(len, targets))
        if vocab_map is not None:
            search.vocabulary = VocabularyRestriction.of_sources(
                vocab_map, sources, model.config.vocab_size, device,
                languages=target_languages(forced_first, targets, len(sources)))
        first, cache = model.start(src.to(device), capacity=capacity, targets=targets, vocabulary=search.vocabulary)
        if forced is not None:
            first = force_first_tokens(first, forced)
        return run_search(search, first, lambda t: model.decode_step(t, cache, search.vocabulary),
                          rows.select_with(cache.select), cache.share_beam_prefix)


def prompt_logprobs(model: CausalLM, prompt: Sequence[int], top: int = 0
                    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Each prompt token's log-prob given the tokens before it (None for the first) and, with ``top`` > 0, the
    ``top`` likeliest tokens at its position: what OpenAI's ``echo`` reports. One forward, no cache."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([list(prompt)], device=device))[0, :-1].float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(list(prompt[1:]), device=device)[:, None])[:, 0].tolist()
        tops: list[list[tuple[int, float]] | None] = [None] * (len(prompt) - 1)
        if top:
            values, ids = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return [None, *chosen], [None, *tops]


def stop_strings(tokenizer: Tokenizer, stops: Sequence[str]) -> StopFn | None:
    """A stop_fn ending a sequence once its decoded text contains any of ``stops``."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    # Tokens to decode: every token holds at least one byte of text, so a stop string ending at the last token
    # lies within its UTF-8 length in tokens (plus a few for tokens that decode to nothing).
    window = max(len(s.encode("utf-8", "surrogatepass")) for s in stops) + 8

    def stop_fn(_input: int, tokens: list[int]) -> bool:
        tail = tokenizer.decode(tokens[-window:])
        return any(s in tail for s in stops)

    return stop_fn


def trim_stop(text: str, stops: Sequence[str]) -> str:
    """Cut ``text`` at the first occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def _forced_rows(forced: Sequence[int | None] | None, targets: list[list[int]]) -> list[int | None] | None:
    """Each row's forced first token: none where the row continues a target prefix (which starts with it)."""
    if forced is None:
        return None
    if len(forced) != len(targets):
        raise ValueError(f"got {len(forced)} forced first tokens for {len(targets)} sources")
    for i, (token, target) in enumerate(zip(forced, targets, strict=True)):
        if token is not None and target and target[0] != token:
            raise ValueError(f"source {i}: its target prefix must start with its forced first token {token}")
    return [None if target else token for token, target in zip(forced, targets, strict=True)]


def _check_lengths(lengths: list[int], extra: int, limit: int, what: str) -> None:
    if not lengths:
        raise ValueError("no inputs")
    longest = max(lengths)
    if min(lengths) == 0 and what != "output":
        raise ValueError(f"empty {what}: at least one token is needed")
    if longest + extra > limit:
        raise InputTooLongError(
            f"{what} of {longest} tokens + {extra} new tokens exceeds the model's maximum length {limit}"
        )


class _AdapterRows:
    """Keeps the per-row adapter selection in step with the rows the search keeps or reorders."""

    def __init__(self, model: torch.nn.Module, adapters: AdapterSelection, num_inputs: int) -> None:
        self.model = model
        self.per_row = isinstance(adapters, (list, tuple))
        if self.per_row and len(adapters) != num_inputs:
            raise ValueError(f"got {len(adapters)} adapters for {num_inputs} inputs")
        self.rows = list(adapters) if self.per_row else adapters
        self._context = use_adapters(model, self.rows)

    def __enter__(self) -> _AdapterRows:
        self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)

    def select_with(self, select: Callable[[torch.Tensor, torch.Tensor | None], None]
                    ) -> Callable[[torch.Tensor, torch.Tensor | None], None]:
        if not self.per_row:
            return select

        def reorder(index: torch.Tensor, tails: torch.Tensor | None = None) -> None:
            select(index, tails)
            self.rows = [self.rows[i] for i in index.tolist()]
            set_adapters(self.model, self.rows)

        return reorder


class _Recompute:
    """Generation without a KV cache: every step re-runs the whole sequence (for benchmarks)."""

    def __init__(self, model: CausalLM, sequences: list[list[int]]) -> None:
        self.model = model
        self.sequences = sequences

    def logits(self) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids, lengths = (t.to(device) for t in pad_batch(self.sequences, self.model.config.pad_id))
        out = self.model(ids)
        return out[torch.arange(len(self.sequences), device=device), lengths - 1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        for seq, token in zip(self.sequences, tokens.tolist(), strict=True):
            seq.append(token)
        return self.logits()

    def select(self, index: torch.Tensor, tails: torch.Tensor | None = None) -> None:
        self.sequences = [list(self.sequences[i]) for i in index.tolist()]


__all__ = ["InputTooLongError", "generate_causal", "generate_seq2seq", "prompt_logprobs", "stop_strings", "trim_stop"]
