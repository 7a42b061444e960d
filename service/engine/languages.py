"""A generate request's ``target_lang`` / ``source_lang`` checked against a multilingual translator's language codes
(NLLB-200, M2M100, mBART-50: ``Checkpoint.languages``, model.hf.languages), before anything runs.

``source_lang`` lays out a source as the model's tokenizer does with ``src_lang`` set to it (``Languages.source_ids``
instead of the tokenizer's own template); ``target_lang`` is the row's forced first token (generate()'s
``forced_bos_token_id``); a row without one gets the model's generation_config.json ``forced_bos_token_id`` (BART's
``<s>``), if any. The forced tokens are applied where a prefill's first logits come out
(service/engine/continuous_batching.py, model.search.force_first_tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model.checkpoint import Checkpoint
from model.hf.languages import LanguageError
from service.engine.errors import InvalidRequest

MULTILINGUAL = "NLLB-200, M2M100 and mBART-50 models"  # the models that take language codes (model.hf.languages)


@dataclass(frozen=True)
class LanguagePlan:
    """Per input: its source language (None: the tokenizer's own template) and its forced first token (None: none)."""

    sources: list[str | None]
    forced: list[int | None]

    def encode(self, checkpoint: Checkpoint, texts: Sequence[str]) -> list[list[int]]:
        """The inputs' ids: a row with a source language laid out for it, the others by the model's own template
        (blocking: run it on the tokenizer pool)."""
        if not any(self.sources):
            return checkpoint.encode_prompts(texts)
        tokenizer, languages = checkpoint.prompt_tokenizer, checkpoint.languages
        return [languages.source_ids(tokenizer.encode(text), source) if source else checkpoint.encode_prompts([text])[0]
                for text, source in zip(texts, self.sources, strict=True)]

    @property
    def any_forced(self) -> bool:
        return any(token is not None for token in self.forced)


def per_input(field: str, value: str | Sequence[str] | None, count: int) -> list[str | None]:
    """``value`` (one code for every input, or a list with one per input) as one entry per input."""
    if value is None:
        return [None] * count
    if isinstance(value, str):
        return [value] * count
    if len(value) != count:
        raise InvalidRequest(field, f"needs one entry per input ({count}), got {len(value)}")
    return list(value)


def language_plan(name: str, checkpoint: Checkpoint, target_lang: str | Sequence[str] | None,
                  source_lang: str | Sequence[str] | None, count: int) -> LanguagePlan:
    """The plan of ``count`` inputs (422s naming the field: a model without language codes, a list of another
    length, a code the model does not know, listing those it does)."""
    for field, value in (("target_lang", target_lang), ("source_lang", source_lang)):
        if value is not None and checkpoint.languages is None:
            kind = "a seq2seq model without language codes" if checkpoint.family == "seq2seq" else \
                f"a {checkpoint.family} model"
            raise InvalidRequest(field, f"model {name!r} is {kind}; language codes are for {MULTILINGUAL}")
    targets, sources = per_input("target_lang", target_lang, count), per_input("source_lang", source_lang, count)
    rules = checkpoint.generation
    default = rules.forced_bos if rules is not None else None

    def token(field: str, given: str | Sequence[str], i: int, code: str) -> int:
        try:
            return checkpoint.languages.token_id(code, field)
        except LanguageError as exc:
            raise InvalidRequest(field if isinstance(given, str) else f"{field}[{i}]", str(exc)) from None

    forced: list[int | None] = []
    for i, (target, source) in enumerate(zip(targets, sources, strict=True)):
        if source is not None:
            token("source_lang", source_lang, i, source)
        forced.append(token("target_lang", target_lang, i, target) if target is not None else default)
    return LanguagePlan(sources, forced)
