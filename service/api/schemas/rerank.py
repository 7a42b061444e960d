"""Bodies of /v1/rerank (Cohere's, Jina's and vLLM's shape) and /v1/score (vLLM's)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from service.api.schemas.common import AnyText, Priority, RequestModel, Text, one_or_many
from service.api.schemas.openai import Usage

ScoredBy = Literal["cross-encoder", "embedding-cosine"]  # service.engine.rerank's names
SCORED_BY = Field(description="An extension: what scored the documents. cross-encoder: the model's one-label head "
                  "read each (query, document) pair, its logit through the model's activation (sentence-transformers' "
                  "CrossEncoder config, else sigmoid); embedding-cosine: the cosine of the query's and the document's "
                  "embeddings (the model's default pooling), for a model without a one-label head.")
MODEL = Field(min_length=1, max_length=129, description="A classifier (encoder) model from GET /v1/models, or "
              "'model:adapter' for one of its LoRA adapters.")
TRUNCATE = Field(False, description="As TEI's truncate: a document over the model's max_input_tokens is cut to fit "
                 "(a pair loses the document's last tokens; the query is kept whole, and a query that leaves no room "
                 "is still a 422). false: such a document is a 422 naming it.")


class RerankDocument(RequestModel):
    text: AnyText


def _text_or_object(value: object) -> str:
    return "str" if isinstance(value, str) else "object"


Document = Annotated[Annotated[AnyText, Tag("str")] | Annotated[RerankDocument, Tag("object")],
                     Discriminator(_text_or_object)]


class RerankRequest(RequestModel):
    """Cohere's / Jina's / vLLM's rerank body."""

    model: str = MODEL
    query: Text
    documents: list[Document] = Field(
        min_length=1, description="Texts, or {\"text\": ...} objects (Cohere's form); at most the setting "
        "max_rerank_documents (422 above)."
    )
    top_n: int | None = Field(None, ge=0, description="Return only the n most relevant (null or 0: all, as vLLM).")
    return_documents: bool = Field(True, description="Echo each result's document text (as vLLM and Jina do).")
    truncate: bool = TRUNCATE
    priority: Priority = 0


class RerankResult(BaseModel):
    index: int = Field(description="The document's position in the request.")
    relevance_score: float
    document: RerankDocument | None = Field(None, description="With return_documents: the document's text.")


class RerankUsage(BaseModel):
    total_tokens: int = Field(description="Tokens the model read, special tokens included.")


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="Most relevant first (ties in the request's order).")
    scored_by: ScoredBy = SCORED_BY


class ScoreRequest(RequestModel):
    """vLLM's /score body: ``text_1`` a text (or a list of one) scored against each of ``text_2``, or two lists of
    the same length scored pair by pair."""

    model: str = MODEL
    text_1: one_or_many(Text, Annotated[list[Text], Field(min_length=1)]) = Field(
        description="The query, or one query per text_2 entry."
    )
    text_2: one_or_many(AnyText, Annotated[list[AnyText], Field(min_length=1)]) = Field(
        description="The texts to score (at most the setting max_rerank_documents)."
    )
    truncate: bool = TRUNCATE
    priority: Priority = 0


class ScoreData(BaseModel):
    index: int = Field(description="The position of the text_2 entry.")
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(description="Unix time.")
    model: str
    data: list[ScoreData] = Field(description="In text_2's order.")
    usage: Usage
    scored_by: ScoredBy = SCORED_BY
