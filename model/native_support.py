"""Which config fields the decode plan and the C++ step (model.fast_step) implement: one predicate, read by the layer
stack when it is built and by the benchmarks that report which path a model takes."""

from __future__ import annotations

from dataclasses import fields

from model.config import TransformerConfig

# The blocks' config fields (TransformerConfig's) the plan and the C++ step implement whatever their values; any
# other field (whatever is added later) must keep its default. Vocabulary, embedding and head fields do not reach the
# stack.
IMPLEMENTED_FIELDS = frozenset({
    "vocab_size", "d_model", "n_heads", "d_ff", "dropout", "max_len", "positions", "norm", "activation", "bias",
    "scale_embeddings", "tie_embeddings", "embedding_norm", "final_norm", "layer_norm_eps", "pad_id", "norm_type",
    "rope_theta", "rope_scaling", "rotary_dim", "n_kv_heads", "head_size", "ffn", "ffn_bias", "out_bias",
    "qk_norm", "sliding_window", "window_layers", "rope_local_theta", "norm_offset", "sandwich_norm",
    "attention_scale",  # of self- and cross-attention
    "relative_buckets", "relative_max_distance",  # T5's relative position bias: a float self-attention mask
})


def unsupported(config: TransformerConfig) -> list[str]:
    """The config fields whose values the decode plan and the C++ step do not implement (empty: they run this
    model; otherwise LayerStack.forward does)."""
    return [f.name for f in fields(TransformerConfig)
            if f.name not in IMPLEMENTED_FIELDS and getattr(config, f.name) != f.default]
