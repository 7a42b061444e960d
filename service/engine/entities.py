"""Entities of texts by a token classification head: the pieces ``ModelWorker.entities`` composes around one batched
"tokens" job (the pipeline's windows before it, its aggregation after: model.token_entities)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from model.token_entities import STRATEGIES, Window, WordRules, aggregate, check_options, probabilities
from model.tokenizer import Tokenizer, TokenSpans
from service.engine.errors import InvalidRequest
from service.engine.inputs import InputChecks


def check_request(strategy: str, stride: int | None) -> None:
    """The strategy and stride as the pipeline allows them, else a 422 naming the field."""
    try:
        check_options(strategy, stride)
    except ValueError as exc:
        raise InvalidRequest("stride" if strategy in STRATEGIES else "aggregation_strategy", str(exc)) from None


def windows_of(tok: Tokenizer, inputs: InputChecks, texts: Sequence[str], limit: int, stride: int | None
               ) -> list[list[TokenSpans]]:
    """Each text's windows (blocking: run it on the tokenizer pool): the whole text within ``limit`` tokens, or
    with ``stride`` windows of ``limit`` tokens, each repeating the last ``stride`` of the one before."""
    windows = []
    for i, text in enumerate(texts):
        try:
            spans = tok.encode_windows(text, None if stride is None else limit, stride or 0)
        except ValueError as exc:
            raise InvalidRequest("stride", str(exc)) from None
        for window in spans:
            inputs.length(i, window.ids)
        windows.append(spans)
    return windows


def found(tok: Tokenizer, texts: Sequence[str], windows: list[list[TokenSpans]], logits: Iterator[torch.Tensor],
          id2label: dict[int, str], strategy: str, ignore: Sequence[str]) -> list[list[dict]]:
    """Each text's entities from its windows' logits (``logits``: per window (T, labels), in the windows' order)."""
    rules, out = WordRules.of(tok), []
    for text, spans in zip(texts, windows, strict=True):
        scored = [Window.of(s, probabilities(next(logits).numpy()), tok.unk_id) for s in spans]
        out.append([e.as_dict() for e in aggregate(text, scored, id2label, rules, strategy, ignore)])
    return out
