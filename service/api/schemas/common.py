"""What every request and response body shares: text, name, priority and seed types, the strict base of every
request model, the one error shape.

Defaults are the engine's (service.engine.requests.DEFAULTS); limits that come from settings (caps on beams, new
tokens, inputs, what a request may cost) and token lengths are checked by the engine. Every request model forbids
unknown fields and non-finite numbers and validates strictly, so a typo, a NaN or a wrong JSON type (``true`` or
``"5"`` for a number) is a 422 naming the field instead of a silent default or coercion.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from model import lora_config
from service.engine.requests import DEFAULTS

NAME_PATTERN = f"^{lora_config.NAME_PATTERN}$"  # model and adapter names
DEFAULT_NEW_TOKENS = DEFAULTS.max_new_tokens  # generate's max_new_tokens when not given
DEFAULT_MAX_TOKENS = 16  # /v1/completions' max_tokens when not given (OpenAI's default)
# Sampling limits: below them the logits overflow float32 or the nucleus underflows (greedy is the limit).
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6
MAX_SEED = 2**62  # input i samples with seed + i: room left below torch's 2**63



def unicode_text(value: object) -> object:
    """``value`` unless it is a string that is not valid Unicode: JSON's ``\\ud800`` escapes can smuggle a lone
    surrogate into a string, which no tokenizer can encode (the one text check of every text field of every route;
    run before the type's own checks, whose error for it says nothing useful)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"contains a lone surrogate (U+{ord(value[exc.start]):04X}) at character {exc.start}: "
                             "not valid Unicode text") from None
    return value


# The check wraps the constrained type (not the other way round), so that the type keeps its own messages.
AnyText = Annotated[str, BeforeValidator(unicode_text), Field(description="Text (valid Unicode).")]
Text = Annotated[Annotated[str, Field(min_length=1)], BeforeValidator(unicode_text),
                 Field(description="Non-empty text.")]
Name = Annotated[str, Field(pattern=NAME_PATTERN, description=f"{lora_config.NAME_RULE}.")]
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1, description="Among requests waiting for this model, lower "
                                "values are taken first (within a priority, API keys take turns, FIFO per key); "
                                "running requests are not preempted. A user API key may not go below "
                                "min_user_priority (TSERVE_MIN_USER_PRIORITY, default 0; 422 below it); admin keys, "
                                "and a server without keys, may use any.")]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description="0 <= seed <= 2**62.")]


def _str_or_list(value: object) -> str:
    return "list" if isinstance(value, list | tuple) else "str"


def one_or_many(one: object, many: object) -> object:
    """``one | many`` validated by the input's JSON type (a string or an array), so a bad value gets one
    error from the branch it meant, not one per branch; the tags "str"/"list" are left out of field paths."""
    return Annotated[Annotated[one, Tag("str")] | Annotated[many, Tag("list")], Discriminator(_str_or_list)]


LanguageCode = Annotated[str, Field(min_length=1, max_length=32, description="A language code of the model (GET "
                                   "/v1/models: languages), e.g. NLLB-200's fra_Latn, mBART-50's fr_XX, M2M100's fr.")]
LanguageCodes = one_or_many(LanguageCode, Annotated[list[LanguageCode], Field(min_length=1)])


def language_codes(description: str) -> Any:
    """A field of one language code for every input, or a list with one per input (null: none)."""
    return Field(None, description=f"Multilingual seq2seq models only (NLLB-200, M2M100, mBART-50): {description} "
                 "One code for every input, or a list with one per input; an unknown code is a 422 listing the "
                 "model's.")


class RequestModel(BaseModel):
    # strict: JSON types must match (true is not max_new_tokens=1, "5" is not 5); JSON integers still
    # count as floats.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# ---- errors --------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    code: str = Field(description="Machine-readable code, e.g. invalid_request, not_found, queue_full.")
    message: str = Field(description="What went wrong; names the field and the limit where one applies.")
    field: str | None = Field(None, description="The offending request field (dotted path), when there is one.")
    request_id: str | None = Field(None, description="Same as the X-Request-ID response header.")


class ErrorResponse(BaseModel):
    """The one error shape of every endpoint, including 404/405/413 and validation errors."""

    error: ErrorDetail
