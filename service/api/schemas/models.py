"""Bodies of /health, /ready, the model list, model loads and the adapter routes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from service.api.schemas.common import RequestModel, Text


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    models: list[str]


class AdapterInfoSchema(BaseModel):
    name: str
    rank: int
    alpha: float
    target_modules: list[str]
    path: str
    loaded_at: float | None = Field(
        None, description="Unix time the resident version was loaded (null: on disk only, loaded on first use)."
    )
    last_used: float | None = Field(None, description="Unix time of its last request.")
    in_flight: int = Field(0, description="Requests using it right now.")
    resident: bool = Field(True, description="In memory now (false: known on disk, loaded on first use).")


class AdapterList(BaseModel):
    adapters: list[AdapterInfoSchema]


class StaticStepSchema(BaseModel):
    mode: Literal["lazy", "startup"] = Field(description="When each size's step is built: on first use, or at load.")
    sizes: list[int] = Field(description="The batch sizes a running batch is padded up to (more rows: eager steps).")
    built: list[int] = Field(description="The sizes built so far (captured as CUDA graphs when graphs is true).")
    graphs: bool = Field(description="Whether steps are CUDA graphs (a GPU) or run eagerly (the CPU: for testing).")
    rows: int = Field(description="Rows the static buffers hold.")
    positions: int = Field(description="Positions each row holds (its input and new tokens); longer rows: eager.")
    bytes: int = Field(description="Memory of the static buffers, logits and (CUDA) the graphs' pool.")


class ModelInfoSchema(BaseModel):
    id: str = Field(description="Same as name (OpenAI's model list field).")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time the server started.")
    owned_by: str = "tserve"
    name: str
    family: Literal["seq2seq", "classifier", "causal_lm"]
    device: str
    dtype: str
    quantize: str = Field("none", description="Its linear layers' precision on the CPU (the server's quantize "
                          "setting): none (its dtype), int8 (int8 weights), bf16 (bfloat16 weights, float32 sums).")
    parameters: int = Field(description="The model's own parameters (tied weights counted once).")
    adapter_parameters: int = Field(description="Parameters its resident LoRA adapters add.")
    vocab_size: int = Field(description="Tokens the model can output (a translator's target vocabulary).")
    max_input_tokens: int
    max_new_tokens: int = Field(description="Cap on new tokens (0 for classifiers).")
    labels: list[str] | None = Field(None, description="Class labels (classifier).")
    adapters: list[str] = Field(description="LoRA adapters this model can use.")
    format: Literal["tserve", "hf"] = Field(
        description="tserve: a checkpoint of ours; hf: a Hugging Face model directory (config.json, model.safetensors)."
    )
    generation_defaults: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="What generate uses for the fields a request leaves unset, from the model's own generation "
        "config (an HF model's generation_config.json: num_beams, max_length, length_penalty, early_stopping, "
        "do_sample), within this server's limits. Fields not named here take the request schema's defaults.",
    )
    draft_model: str | None = Field(None, description="The model that drafts for speculative method draft_model.")
    calibration: dict[str, float] | None = Field(
        None, description="A classifier's calibration (calibration.json): the temperature its probabilities are "
        "scaled by and min_confidence, below which it answers \"unknown\" unless a request sets its own."
    )
    chat_template: bool = Field(False, description="Whether /v1/chat/completions can lay out its conversations "
                                "(a causal LM with a chat template).")
    tool_call_format: Literal["hermes"] | None = Field(
        None, description="How its chat template writes tool calls, where /v1/chat/completions reads them into "
        "tool_calls (hermes: <tool_call> JSON </tool_call>); null: calls, if any, come back as content."
    )
    tasks: list[Literal["generate", "classify", "embed", "rerank", "entities"]] = Field(
        default_factory=list, description="What it serves: generate (/generate, completions, chat), classify (a "
        "sequence classification head), embed (/embed, /v1/embeddings), rerank (/v1/rerank, /score: a one-label head "
        "scores pairs as a cross-encoder; other classifiers by the cosine of embeddings), entities (/entities: a token "
        "classification head)."
    )
    languages: list[str] | None = Field(
        None, description="A multilingual translator's language codes (NLLB-200, M2M100, mBART-50): the values of "
        "generate's and completions' target_lang and source_lang; null for other models."
    )
    source_language: str | None = Field(
        None, description="The source language its tokenizer lays inputs out for when a request names none."
    )
    embedding_defaults: dict[str, str | bool] | None = Field(
        None, description="A classifier's embed defaults, for requests that leave them unset: pooling and "
        "normalize (unit-length vectors). A sentence-transformers model's come from its modules (often normalized); "
        "otherwise mean pooling, not normalized."
    )
    static_step: StaticStepSchema | None = Field(
        None, description="The static decoding step (TSERVE_CUDA_GRAPHS lazy or startup; null: off): its batch sizes, "
        "those built so far, and the memory it holds."
    )


class ModelLoadRequest(RequestModel):
    path: Annotated[Text, Field(max_length=1024, description="The model directory, relative to the models "
                                "directory (--models): no absolute path, no hidden or '..' part.")]


class ModelLoadFailure(BaseModel):
    name: str = Field(description="The model directory's name.")
    error: str = Field(description="Why it did not load (paths relative to the models directory).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfoSchema]
    failed: list[ModelLoadFailure] = Field(
        description="Configured models that failed to load at start-up, and why (not served)."
    )
