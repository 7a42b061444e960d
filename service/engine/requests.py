"""The engine's own request types (vLLM's ``SamplingParams`` beside its prompts): what the HTTP layer converts its
pydantic bodies into (service.api.convert). No pydantic, no FastAPI."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from model.constraints import Constraint
from model.decoding import GenerationConfig, Strategy
from model.speculative import SpeculativeConfig

DEFAULTS = GenerationConfig()  # what decoding uses where neither a request nor the model says


@dataclass(frozen=True)
class DecodingOptions:
    """The GenerationConfig fields a request may set. None: not set, so the model's default (its
    generation_config.json) applies, else GenerationConfig's (:data:`DEFAULTS`): :meth:`given` is the one place
    that says which fields a request set."""

    strategy: Strategy | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    num_return_sequences: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    logprobs: int | None = None

    def given(self) -> dict[str, Any]:
        """The fields the request set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


DECODING_FIELDS = tuple(f.name for f in fields(DecodingOptions))


@dataclass(frozen=True)
class GenerationRequest:
    """A generate request: its inputs (source sentences or prompts) and how to decode them."""

    inputs: list[str]
    decoding: DecodingOptions = DecodingOptions()
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text)
    adapter: str | None = None
    constraint: Constraint | None = None  # causal_lm: a JSON schema, a regex or choices every output matches
    # None: the model's default drafting where the request can draft; "off": none
    speculative: SpeculativeConfig | Literal["off"] | None = None
    target_prefix: list[str] | None = None  # seq2seq, one per input: the start of its translation to continue
    protect_placeholders: bool | None = None  # seq2seq default: on
    use_vmap: bool | None = None  # seq2seq: keep to the vocabulary map's candidates (default: when it has one)
    # multilingual seq2seq (service/engine/languages.py): one language code for every input, or one per input
    target_lang: str | list[str] | None = None
    source_lang: str | list[str] | None = None
    # the inputs' ids, where the caller encoded them already (chat prompts the model's PromptEncoder rendered and
    # encoded: the template's control tokens as their ids, a user's as text, none added; InputChecks.input_ids)
    prompt_ids: list[list[int]] | None = None
    stop_token_ids: tuple[int, ...] = ()  # more ids that end a sequence (finish "stop"), never in its text
