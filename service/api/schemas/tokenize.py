"""Bodies of vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from service.api.schemas.common import AnyText, Name, RequestModel


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize body (its completion form: chat ``messages`` are not supported)."""

    model: Name = Field(description="A model from GET /v1/models.")
    prompt: AnyText = Field(description="The text (a translator's is its source text, read by the source tokenizer).")
    add_special_tokens: bool = Field(
        True, description="true: the ids the model reads for this text as an input (<s> text for a causal LM, "
        "text </s> for a translator, [CLS] text [SEP] for a classifier); false: the text's own tokens alone."
    )
    return_token_strs: bool = Field(False, description="Also return each token's text (token_strs).")


class TokenizeResponse(BaseModel):
    count: int = Field(description="len(tokens).")
    max_model_len: int = Field(description="The most tokens an input of this model may have here (GET /v1/models' "
                               "max_input_tokens).")
    tokens: list[int]
    token_strs: list[str] | None = Field(
        None, description="With return_token_strs: each token's text (part of a UTF-8 character shows as U+FFFD)."
    )


class DetokenizeRequest(RequestModel):
    """vLLM's /detokenize body: the inverse of /tokenize (a translator's ids are of its source vocabulary)."""

    model: Name = Field(description="A model from GET /v1/models.")
    tokens: list[Annotated[int, Field(ge=0)]] = Field(
        description="Token ids, each below the vocabulary size (an id outside it is a 422); special tokens are "
        "kept in the text."
    )


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="The text of tokens.")
