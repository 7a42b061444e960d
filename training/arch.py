"""Model sizes from the command line and the architecture presets, turned into a family's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.config import CONFIGS, CausalLMConfig, ModelConfigError, TransformerConfig
from training.errors import UserError

# --arch: the config fields that make each published architecture ("default" = the config defaults).
ARCH_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "paper": dict(norm="post", positions="sinusoidal", activation="relu", scale_embeddings=True, tie_embeddings=True),
    "gpt2": dict(positions="learned", norm="pre", activation="gelu_tanh", scale_embeddings=False),
    "bert": dict(
        positions="learned",
        norm="post",
        activation="gelu",
        embedding_norm=True,
        layer_norm_eps=1e-12,
        scale_embeddings=False,
    ),
    # Llama / SmolLM2 / Qwen-style decoder (causal_lm only): RMSNorm, rotary positions, SwiGLU, no biases, tied
    # embeddings as small Llama-style models (SmolLM2) tie them
    "llama": dict(norm="pre", norm_type="rms", positions="rope", ffn="gated", activation="silu", bias=False,
                  scale_embeddings=False, tie_embeddings=True, final_norm=True),
}


def causal_lm_only(arch: str) -> bool:
    """Whether preset ``arch`` uses blocks only the causal LM has (model.config: the Llama-style fields)."""
    return CausalLMConfig(**ARCH_PRESETS[arch]).extended


@dataclass(frozen=True)
class ModelSizes:
    """The size flags of `train`."""

    layers: int = 3
    d_model: int = 256
    heads: int = 4
    ffn: int = 1024
    max_len: int = 256
    dropout: float = 0.1
    arch: str = "default"
    encoder_layers: int | None = None  # seq2seq only; default --layers
    decoder_layers: int | None = None
    kv_heads: int | None = None  # causal_lm only: grouped-query attention's K/V heads; default --heads


def build_config(family: str, sizes: ModelSizes, vocab_size: int, **family_fields: Any) -> TransformerConfig:
    """The ``family`` config for ``sizes`` with the preset applied; invalid combinations are UserErrors."""
    if family != "causal_lm" and causal_lm_only(sizes.arch):
        others = ", ".join(a for a in ARCH_PRESETS if not causal_lm_only(a))
        raise UserError(f"--arch {sizes.arch} is for causal_lm only: {family} models use the original blocks "
                        f"(--arch {others})")
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        d_model=sizes.d_model,
        n_heads=sizes.heads,
        d_ff=sizes.ffn,
        dropout=sizes.dropout,
        max_len=sizes.max_len,
        **ARCH_PRESETS[sizes.arch],
    )
    if family == "seq2seq":
        fields.update(
            n_encoder_layers=sizes.encoder_layers or sizes.layers,
            n_decoder_layers=sizes.decoder_layers or sizes.layers,
            max_src_len=sizes.max_len,
        )
    else:
        fields["n_layers"] = sizes.layers
    if sizes.kv_heads is not None:
        fields["n_kv_heads"] = sizes.kv_heads
    try:
        return CONFIGS[family](**fields, **family_fields)
    except ModelConfigError as e:
        raise UserError(f"invalid model size: {e}") from e


def describe(config: TransformerConfig) -> dict[str, Any]:
    """The size fields worth reporting in metrics.json."""
    keys = ("d_model", "n_heads", "d_ff", "max_len", "vocab_size", "n_layers", "n_encoder_layers", "n_decoder_layers")
    data = config.to_dict()
    return {k: data[k] for k in keys if k in data}
