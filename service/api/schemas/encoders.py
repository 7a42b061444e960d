"""Bodies of classify, entities, embed and attention."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from model.token_entities import STRATEGIES
from service.api.schemas.common import Name, Priority, RequestModel, Text, one_or_many
from service.engine.attention import MAX_ATTENTION_VALUES

# A list, not a tuple: strict validation of the parsed JSON body (Python objects) takes no list as a tuple.
Pair = Annotated[list[Text], Field(min_length=2, max_length=2, description="A sentence pair [first, second].")]
TextOrPair = one_or_many(Text, Pair)


class ClassifyRequest(RequestModel):
    inputs: list[TextOrPair] = Field(min_length=1, description="Texts or [text, text] pairs.")
    adapter: Name | None = None
    top_k: int | None = Field(None, ge=1, description="Return only the k highest-scoring labels' scores.")
    min_confidence: float | None = Field(
        None, ge=0.0, le=1.0, description="Answer \"unknown\" (abstained) for a text whose top score (a "
        "probability) is below this; a regression model never abstains. Default: the model's calibrated threshold "
        "(calibration.json), else 0 (never)."
    )
    priority: Priority = 0


# what a classifier's scores are, by its output (ClassifierConfig.output_activation: the model's problem_type)
SCORES = ("single-label models (softmax): the label's probability, calibrated when the model has a calibration; "
          "multi-label models and one-label relevance scores (sigmoid): the label's own probability, independent "
          "of the others'; regression models: the raw predicted value")


class Classification(BaseModel):
    label: str = Field(description="The highest-scoring label, or \"unknown\" when the classifier abstained.")
    score: float = Field(description=f"The label's score: {SCORES}.")
    probabilities: dict[str, float] = Field(description="Label -> score, highest first (top_k of them when asked): "
                                            f"{SCORES}. Sums to 1 for single-label models only.")
    abstained: bool = Field(False, description="The top score was below min_confidence (never for regression).")


class ClassifyResponse(BaseModel):
    outputs: list[Classification]


class EntitiesRequest(RequestModel):
    """transformers' token-classification pipeline's parameters."""

    inputs: one_or_many(Text, Annotated[list[Text], Field(min_length=1)]) = Field(  # type: ignore[valid-type]
        description="A text or a list of texts (the answer has one list of entities per text either way).")
    aggregation_strategy: Literal[STRATEGIES] = Field(  # type: ignore[valid-type]
        "none", description="none: one entry per token; simple: runs of tokens of one entity (B-/I- tags) grouped; "
        "first / average / max: each word takes its first token's label, the best label of its tokens' mean scores, "
        "or its most confident token's label, then words are grouped (as the pipeline does).")
    ignore_labels: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        None, max_length=64, description='Labels left out of the answer (at most 64). Default: ["O"].')
    stride: int | None = Field(
        None, ge=0, description="Split a text longer than the model's max_input_tokens into windows of that many "
        "tokens, each repeating the last `stride` tokens of the one before; overlapping entities are merged. Not "
        "with aggregation_strategy none. Without it, a longer text is a 422.")
    adapter: Name | None = None
    priority: Priority = 0


class TokenEntity(BaseModel):
    """An entity (entity_group) or, for aggregation_strategy none, a token (entity, index)."""

    entity_group: str | None = Field(None, description="The entity's label (its tag, B-/I- dropped).")
    entity: str | None = Field(None, description="aggregation_strategy none: the token's label.")
    score: float = Field(description="The label's probability (a group's: the mean of its tokens' or words').")
    index: int | None = Field(None, description="aggregation_strategy none: the token's position in its input.")
    word: str = Field(description="The entity's text as the tokenizer decodes its tokens.")
    start: int | None = Field(description="Its first character's offset in the text.")
    end: int | None = Field(description="The offset after its last character.")


class EntitiesResponse(BaseModel):
    outputs: list[list[TokenEntity]] = Field(description="Per input, its entities in text order.")


class EmbedRequest(RequestModel):
    inputs: list[Text] = Field(min_length=1)
    pooling: Literal["cls", "mean", "max"] | None = Field(
        None, description="cls: the [CLS] state; mean / max: over the input's tokens (padding excluded). Default: "
        "the model's (a sentence-transformers model's Pooling module), else mean."
    )
    normalize: bool | None = Field(
        None, description="Unit-length vectors. Default: the model's (a sentence-transformers Normalize module), "
        "else false."
    )
    priority: Priority = 0


class EmbedResponse(BaseModel):
    embeddings: list[list[float]]
    dimensions: int


Indices = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=64)]


class AttentionRequest(RequestModel):
    input: Text = Field(description="The text (seq2seq: the source sentence).")
    target: Text | None = Field(None, description="seq2seq only: the target sentence the decoder reads.")
    layers: Indices | None = Field(None, description="Layers to return (0-based, in this order); default all.")
    heads: Indices | None = Field(None, description="Heads to return (0-based, in this order); default all.")


AttentionKind = Literal["encoder_self", "decoder_self", "cross", "self"]


class AttentionResponse(BaseModel):
    source_tokens: list[str]
    target_tokens: list[str] | None = None
    maps: dict[AttentionKind, list[list[list[list[float]]]]] = Field(
        description="kind -> [layer][head][query][key] weights of the selected layers and heads; kinds: "
        "encoder_self, decoder_self, cross (seq2seq) or self (classifier, causal_lm). At most "
        f"{MAX_ATTENTION_VALUES:,} weights in all: a larger selection is a 422."
    )
