"""Bodies of /v1/models/{model}/generate: the request, its constraint and drafting, the outputs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from model.constraints import MAX_CHOICES, MAX_UNROLLED
from model.decoding import Strategy
from model.generation_config import MAX_LENGTH_PENALTY, MAX_LOGPROBS
from model.speculative import MAX_SPECULATIVE_TOKENS
from service.api.schemas.common import (
    DEFAULT_NEW_TOKENS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    AnyText,
    LanguageCodes,
    Name,
    Priority,
    RequestModel,
    Seed,
    Text,
    language_codes,
)
from service.engine.requests import DEFAULTS


class ConstraintRequest(RequestModel):
    """Exactly one of the three."""

    json_schema: dict[str, Any] | bool | None = Field(None, description="The output is JSON valid under this schema.")
    # Its size is checked with the grammar's (MAX_GRAMMAR_CHARS), not here: the body limit may be smaller.
    regex: Text | None = Field(
        None, description="The output matches this regular expression (whole), in Rust's regex syntax (llguidance's "
        "dialect): \\d, \\w and \\s are Unicode-aware (\\d matches every decimal digit, e.g. Arabic-Indic ones: write "
        f"[0-9] for ASCII digits); counted repetitions ({{n}}, {{n,m}}) may unroll to at most {MAX_UNROLLED:,} "
        "characters."
    )
    choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_CHOICES,
                                      description="The output is one of these strings.")

    @model_validator(mode="after")
    def _exactly_one(self) -> ConstraintRequest:
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex, choice (got {given or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None)


class SpeculativeRequest(RequestModel):
    method: Literal["ngram", "draft_model", "none"] = Field(
        "ngram", description="ngram: draft the tokens that followed the latest earlier occurrence of the text's last "
        "1-3 tokens (prompt lookup); draft_model: the greedy continuation of the model's draft model (a smaller "
        "causal LM with its tokenizer, setting draft_model; GET /v1/models names it); either is verified by the "
        "model in one step; none: no drafting (overrides a default)."
    )
    num_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS, description="Draft tokens per step.")


class GenerateRequest(RequestModel):
    """A field left unset takes the model's generation default (GET /v1/models: generation_defaults), else the
    default below."""

    inputs: list[Text] = Field(min_length=1, description="Source sentences (seq2seq) or prompts (causal_lm).")
    strategy: Strategy = Field(DEFAULTS.strategy, strict=False)  # strict=False: a JSON string names the member
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description=f"Default {DEFAULT_NEW_TOKENS} (or the model's cap if lower); at most the model's "
        "max_new_tokens from GET /v1/models.",
    )
    min_new_tokens: int = Field(DEFAULTS.min_new_tokens, ge=0,
                                description="End-of-sequence is suppressed before this many tokens.")
    num_beams: int = Field(DEFAULTS.num_beams, ge=1, description="Beam width (strategy=beam); capped by max_beams.")
    length_penalty: float = Field(DEFAULTS.length_penalty, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY,
                                  description="Beam score = logprob / length**penalty.")
    early_stopping: bool | Literal["never"] = Field(
        DEFAULTS.early_stopping,
        description="Beam search ends (as in transformers' generate()) at num_beams finished (true), when the best "
        "live beam scored at its current length cannot beat them (false), or at no length could ('never').",
    )
    num_return_sequences: int = Field(DEFAULTS.num_return_sequences, ge=1,
                                      description="Candidates per input (beam: <= num_beams).")
    temperature: float = Field(
        DEFAULTS.temperature, ge=MIN_TEMPERATURE, le=100.0,
        description="Sampling temperature (strategy=sample); for 0 use greedy."
    )
    top_k: int = Field(DEFAULTS.top_k, ge=0, description="Sample among the k likeliest tokens (0: all).")
    top_p: float = Field(DEFAULTS.top_p, ge=MIN_TOP_P, le=1.0, description="Nucleus sampling mass.")
    seed: Seed | None = Field(None, description="Makes sampling reproducible.")
    repetition_penalty: float = Field(
        DEFAULTS.repetition_penalty, gt=0.0, le=100.0,
        description="Makes every token already in the prompt (a translation: its target "
        "prefix) or the output less likely, as transformers does: its logit divided by this when positive, "
        "multiplied when negative (beam search: its log-probability multiplied). 1: off. Default: the model's."
    )
    no_repeat_ngram_size: int = Field(
        DEFAULTS.no_repeat_ngram_size, ge=0, le=64,
        description="No n-gram of this many tokens occurs twice in prompt + output (as transformers "
        "counts). 0: off. Default: the model's."
    )
    stop: list[Text] = Field(default_factory=list, max_length=16, description="Stop strings (cut from the text).")
    adapter: Name | None = Field(None, description="LoRA adapter to apply.")
    stream: bool = Field(False, description="Server-sent events of tokens (one input, one sequence).")
    priority: Priority = 0
    constraint: ConstraintRequest | None = Field(
        None, description="Constrained decoding (causal_lm): every output matches a JSON schema, a regular "
        "expression or one of a list of strings (greedy, sampling or beam search; each sequence its own state). "
        "A constraint that is malformed, too large or impossible is a 422 before any decoding."
    )
    speculative: SpeculativeRequest | None = Field(
        None, description="Draft-and-verify decoding (one input, greedy or one sample): the same tokens, fewer model "
        "steps when the text repeats itself. Default: the model's (setting speculative)."
    )
    target_prefix: list[AnyText] | None = Field(
        None, description="seq2seq only, one per input: the start of its translation (typed by a user) to "
        "continue; the outputs hold what follows it (with logprobs, the alternatives at the next position)."
    )
    target_lang: LanguageCodes | None = language_codes(
        "the language to translate into: the output starts with its token (transformers' forced_bos_token_id), "
        "which the text leaves out. Default: the model's generation_config forced_bos_token_id, if any.")
    source_lang: LanguageCodes | None = language_codes(
        "the language of the input: its token around the source as the model's tokenizer lays it out with "
        "src_lang set to it. Default: the tokenizer's own src_lang (GET /v1/models: source_language).")
    protect_placeholders: bool | None = Field(
        None, description="seq2seq only (default: on for seq2seq): keep the inputs' placeholders (printf %s / "
        "%(name)s / %1$s, {0} / {name}, $VAR, HTML/XML tags, URLs, e-mail addresses, --options) intact: they are "
        "swapped for sentinel tokens before encoding and put back in the output, in the source's order where "
        "order matters; an output that lost or repeated one is repaired (missing ones appended) and says "
        "placeholders_ok: false. A model whose tokenizer has no sentinels is checked only."
    )
    use_vmap: bool | None = Field(
        None, description="seq2seq only: keep each output to the candidate target tokens of the model's vocabulary "
        "map for its input (vmap.txt in the model's directory, CTranslate2's format and use_vmap): faster with a "
        "large target vocabulary, and it may translate differently. Default: on when the model has a map; true "
        "for a model without one is a 422."
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return each generated token's log-probability and the N "
        f"likeliest tokens at its position (0 <= N <= {MAX_LOGPROBS}): log-softmax of the model's logits, before "
        "temperature, top-k / top-p and bans (with a constraint: over the tokens it allows). Beam search: the "
        "returned sequences' own paths."
    )


class Alternative(BaseModel):
    token: int
    text: str = Field(description="The token decoded alone (part of a UTF-8 character shows as U+FFFD).")
    logprob: float


class TokenLogprob(Alternative):
    top_logprobs: list[Alternative] | None = Field(
        None, description="The likeliest tokens at this position, best first (logprobs > 0)."
    )


class Candidate(BaseModel):
    text: str
    tokens: list[int] = Field(description="Generated token ids.")
    score: float | None = Field(description="Sequence log-probability (length-penalised for beam).")
    finish_reason: str = Field(description="eos, length or stop.")
    logprobs: list[TokenLogprob] | None = Field(
        None, description="With logprobs: one entry per token of tokens (an ending EOS or stop token's "
        "log-probability counts in score only)."
    )
    placeholders_ok: bool | None = Field(
        None, description="With protect_placeholders (seq2seq): whether the model's output held exactly the "
        "input's placeholders (positional ones in order); false: the text was repaired, review it."
    )
    constraint_satisfied: bool | None = Field(
        None, description="With a constraint: whether the output is complete under it (JSON that parses and "
        "validates, a whole match); false when max_new_tokens cut it short: do not parse it as complete."
    )


class GenerateOutput(Candidate):
    candidates: list[Candidate] | None = Field(
        None, description="All returned sequences, best first (only when num_return_sequences > 1)."
    )


class GenerateResponse(BaseModel):
    outputs: list[GenerateOutput]
