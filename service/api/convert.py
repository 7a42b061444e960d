"""The HTTP layer's bodies into the engine's types and back: once per request, in the route."""

from __future__ import annotations

import dataclasses
from typing import Any

from model.constraints import Constraint
from model.speculative import SpeculativeConfig
from service.api.schemas import Candidate, ConstraintRequest, GenerateOutput, GenerateRequest, TokenLogprob
from service.engine.requests import DECODING_FIELDS, DecodingOptions, GenerationRequest
from service.engine.types import GeneratedSequence, GenerationOutput


def decoding_options(req: GenerateRequest) -> DecodingOptions:
    """The decoding fields ``req`` set (an explicit null is not set): the rest are the model's defaults."""
    return DecodingOptions(**{name: getattr(req, name) for name in DECODING_FIELDS if name in req.model_fields_set})


def constraint(given: ConstraintRequest | None) -> Constraint | None:
    return None if given is None else Constraint(given.kind, getattr(given, given.kind))


def generation_request(req: GenerateRequest) -> GenerationRequest:
    """The engine's request for a generate body."""
    speculative = None
    if req.speculative is not None:
        speculative = "off" if req.speculative.method == "none" else SpeculativeConfig(req.speculative.method,
                                                                                        req.speculative.num_tokens)
    return GenerationRequest(inputs=list(req.inputs), decoding=decoding_options(req), stop=list(req.stop),
                             adapter=req.adapter, constraint=constraint(req.constraint), speculative=speculative,
                             target_prefix=req.target_prefix, protect_placeholders=req.protect_placeholders,
                             use_vmap=req.use_vmap, target_lang=req.target_lang, source_lang=req.source_lang)


def _set(sequence: GeneratedSequence) -> dict[str, Any]:
    """The fields of ``sequence`` an answer shows: the optional ones only when there (logprobs asked for,
    placeholders protected, several sequences)."""
    values = {f.name: getattr(sequence, f.name) for f in dataclasses.fields(sequence)}
    return {k: v for k, v in values.items() if v is not None or k == "score"}


def token_logprobs(entries: list | None) -> list[TokenLogprob] | None:
    return None if entries is None else [TokenLogprob.model_validate(dataclasses.asdict(e)) for e in entries]


def candidate(sequence: GeneratedSequence) -> Candidate:
    values = _set(sequence)
    if "logprobs" in values:
        values["logprobs"] = token_logprobs(sequence.logprobs)
    return Candidate(**values)


def generate_output(output: GenerationOutput) -> GenerateOutput:
    """The answer's entry of one input (the fields it leaves unset stay out of the JSON)."""
    values = _set(output)
    if "logprobs" in values:
        values["logprobs"] = token_logprobs(output.logprobs)
    if "candidates" in values:
        values["candidates"] = [candidate(c) for c in output.candidates]
    return GenerateOutput(**values)
