"""Building blocks: embeddings, positional encoding, feed-forward, and the Transformer layer."""

from __future__ import annotations

import math

import torch
from torch import nn

from model.attention import MultiHeadAttention
from model.config import TransformerConfig
from model.int8_linear import Int8Linear
from model.kernel_layers import LayerNorm, Linear, activate, kernels_for
from model.kv_cache import KVCache
from model.native_support import unsupported
from model.relative_position import RelativePositionBias
from model.rope import Rotary

# The most positions a sinusoidal table covers: 16x OPUS-MT-big's 1,024 (the table is computed, not stored,
# so nothing else bounds it; at d_model 1024 it is 64 MiB per embedding).
MAX_POSITIONS = 1 << 14


def sinusoidal_table(max_len: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); shape (max_len, d).
    ValueError above MAX_POSITIONS positions."""
    if max_len > MAX_POSITIONS:
        raise ValueError(f"a sinusoidal table of {max_len} positions is over the limit of {MAX_POSITIONS}")
    cpu = torch.device("cpu")  # computed even where a model is built on the meta device (model.build.build_empty)
    position = torch.arange(max_len, dtype=torch.float64, device=cpu)[:, None]
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=cpu)
    angle = position / torch.pow(10000.0, two_i / d_model)
    table = torch.zeros(max_len, d_model, dtype=torch.float64, device=cpu)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.float()


class Embeddings(nn.Module):
    """Token embedding (optionally * sqrt(d_model)) + positions (+ segments), then optional LayerNorm, dropout."""

    def __init__(self, config: TransformerConfig, vocab_size: int, type_vocab_size: int = 0,
                 position_offset: int = 0, pad_positions: bool = True) -> None:
        """``position_offset`` > 0: positions count the non-pad tokens from it (:func:`counted_positions`).
        ``pad_positions`` False: a pad token gets no position (fairseq's sinusoidal table, whose padding_idx row is
        zero: M2M100 reads it for every pad, a generated one too)."""
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, config.d_model, padding_idx=config.pad_id)
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.rotary = config.positions == "rope"  # positions enter in attention, not here
        # Gemma (rope) multiplies by sqrt(d) rounded to the model's dtype; the paper and Marian by the exact number
        self.scale_in_dtype = self.rotary
        if config.positions == "learned":
            self.positions = nn.Embedding(config.max_len + position_offset, config.d_model)
        elif config.positions in ("rope", "relative"):  # rotary angles or T5's bias, in attention
            self.positions = None
        else:
            self.positions = None
            self.register_buffer("sinusoids", sinusoidal_table(config.max_len, config.d_model), persistent=False)
        self.segments = nn.Embedding(type_vocab_size, config.d_model) if type_vocab_size else None
        self.norm = LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.embedding_norm else None
        self.dropout = nn.Dropout(config.dropout)
        self.max_len = config.max_len
        self.position_offset = position_offset
        self.pad_positions = pad_positions
        self.pad_id = config.pad_id

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor | None = None, segments: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids (B, T) and optional positions (B, T) -> (B, T, D)."""
        if positions is None and self.position_offset:
            positions = counted_positions(ids, self.pad_id, self.position_offset)
        elif positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)[None, :]
        x = self.tokens(ids)
        if self.scale != 1.0:
            x = x * (torch.tensor(self.scale, dtype=x.dtype) if self.scale_in_dtype else self.scale)
        if self.positions is not None and not self.pad_positions:
            x = x + self.positions(positions) * (ids != self.pad_id)[..., None]
        elif self.positions is not None:
            x = x + self.positions(positions)
        elif hasattr(self, "sinusoids"):
            x = x + self.sinusoids[positions].to(x.dtype)
        if self.segments is not None:
            x = x + self.segments(torch.zeros_like(ids) if segments is None else segments)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x) if self.training else x

    def for_step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``self(ids, positions)`` of a decoding step: one ``torch.embedding`` where the token table is all
        :meth:`forward` computes (rotary positions, no scale, segments or norm, eval, no hooks: the Llama-style
        models), which skips two modules' dispatch: 60-70 us where the modules took 90-100 us of a SmolLM2 int8
        batch-1 step, most of it cache misses after the step's weights went by."""
        table = self.tokens
        table_only = self.rotary and self.scale == 1.0 and self.segments is None and self.norm is None
        if (table_only and not self.training and type(table) is nn.Embedding and table.max_norm is None
                and not _hooked(self) and not _hooked(table)):
            return torch.embedding(table.weight, ids)  # padding_idx only shapes the gradient
        return self(ids, positions)


def _hooked(module: nn.Module) -> bool:
    """Whether ``module`` has forward hooks of its own (they must see the call)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def counted_positions(ids: torch.Tensor, pad_id: int, offset: int) -> torch.Tensor:
    """RoBERTa's (fairseq's) positions (B, T): the n-th non-pad token of a row (n from 0) at ``offset + n``, pads at
    ``offset - 1``, so a left-padded row starts where a right-padded one does."""
    real = (ids != pad_id).long()
    return real.cumsum(1) * real + (offset - 1)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (Llama), in float32 at least.

    ``offset``: scaled by (1 + weight) instead, and in float32 before rounding to x's dtype (Gemma).
    """

    def __init__(self, d: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d) if offset else torch.ones(d))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        if kernels is not None:  # one pass a row: 46 us against the five tensor ops' 111 us at 512 x 576 (a prefill's)
            return kernels.rows_rms_norm(x, self.weight, self.eps, self.offset)
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)


def make_norm(config: TransformerConfig, d: int) -> nn.Module:
    """The configured normalization of width ``d``: LayerNorm or RMSNorm (``norm_type``, ``norm_offset``)."""
    if config.norm_type == "rms":
        return RMSNorm(d, config.layer_norm_eps, config.norm_offset)
    return LayerNorm(d, eps=config.layer_norm_eps)


class FeedForward(nn.Module):
    """Position-wise FFN(x) = fc2(act(fc1(x))); gated (SwiGLU): fc2(act(fc1(x)) * up(x))."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        bias = config.bias if config.ffn_bias is None else config.ffn_bias
        self.fc1 = Linear(config.d_model, config.d_ff, bias=bias)  # the gate when gated
        self.up = Linear(config.d_model, config.d_ff, bias=bias) if config.ffn == "gated" else None
        self.fc2 = Linear(config.d_ff, config.d_model, bias=bias)
        self.activation = config.activation
        self.dropout = nn.Dropout(config.dropout)

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The configured nonlinearity (ReLU, GELU, GELU's tanh approximation, or SiLU) of fc1's output ``h``,
        in place where our kernels compute it."""
        return activate(h, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and type(self.fc1) is Int8Linear and type(self.fc2) is Int8Linear:
            # fc2's input quantised in fc1's GEMM (gated: gate and up in one GEMM); a LoRA-wrapped layer is not here
            if self.up is None:
                return self.fc1.activated_into(x, self.activation, self.fc2)
            if type(self.up) is Int8Linear:
                return self.fc1.gated_into(x, self.up, self.activation, self.fc2)
        # an int8 fc1 applies the activation inside its GEMM (Int8Linear.activated): no pass over (rows, d_ff)
        h = self.fc1.activated(x, self.activation) if type(self.fc1) is Int8Linear else self.activate(self.fc1(x))
        if self.up is not None:
            h = h * self.up(x)
        return self.fc2(self.dropout(h) if self.training else h)


class TransformerLayer(nn.Module):
    """Self-attention, optional cross-attention, feed-forward; each wrapped in residual + LayerNorm.

    Pre-LN: x + Dropout(f(LN(x))). Post-LN (the paper): LN(x + Dropout(f(x))).
    """

    def __init__(self, config: TransformerConfig, cross_attention: bool = False, index: int = 0) -> None:
        super().__init__()
        d = config.d_model
        window = config.layer_window(index)
        qk_norm = (make_norm(config, config.head_dim), make_norm(config, config.head_dim)) if config.qk_norm else None
        self.self_attn = MultiHeadAttention(d, config.n_heads, config.dropout, config.bias,
                                            n_kv_heads=config.kv_heads, head_dim=config.head_dim,
                                            rotary=_rotary(config, window), out_bias=config.out_bias, qk_norm=qk_norm,
                                            scale=config.attention_scale, window=window,
                                            bidirectional_window=config.bidirectional_window,
                                            rotary_float32=config.rotary_float32)
        # ModernBERT's layer 0 reads the (normalized) embeddings as they are
        self.self_attn_norm = make_norm(config, d) if index or config.first_attn_norm else nn.Identity()
        self.cross_attn = (
            MultiHeadAttention(d, config.n_heads, config.dropout, config.bias, head_dim=config.head_dim,
                               scale=config.attention_scale) if cross_attention else None
        )
        self.cross_attn_norm = make_norm(config, d) if cross_attention else None
        self.ffn = FeedForward(config)
        self.ffn_norm = make_norm(config, d)
        # sandwich norms: each sub-layer's output normalized before the residual add (Gemma 3)
        self.self_attn_post_norm = make_norm(config, d) if config.sandwich_norm else None
        self.ffn_post_norm = make_norm(config, d) if config.sandwich_norm else None
        self.dropout = nn.Dropout(config.dropout)
        self.pre_norm = config.norm == "pre"

    def _input(self, x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        """What a sub-layer reads: LN(x) (pre-LN) or x (post-LN)."""
        return norm(x) if self.pre_norm else x

    def _residual(self, x: torch.Tensor, out: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        """x + Dropout(out) (pre-LN) or LN(x + Dropout(out)) (post-LN); ``out`` is the sub-layer's fresh output."""
        kernels = kernels_for(out)
        if kernels is not None and not self.training:
            x = kernels.rows_add_(out, x)  # into ``out``, which nothing else holds
        else:
            x = x + (self.dropout(out) if self.training else out)
        return x if self.pre_norm else norm(x)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        attention_weights: bool = False,
        keep: slice | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x (B, T, D) -> (B, T, D) and, when asked, the attention weights by kind ("self", "cross").

        With ``keep`` only those positions are computed, attending to every position: (B, T', D).
        """
        weights: dict[str, torch.Tensor] = {}
        h = self._input(x, self.self_attn_norm)
        if keep is not None:  # queries of the kept positions; keys and values of all
            x = x[:, keep]
            out, w = self.self_attn(h[:, keep], mask, source=h, attention_weights=attention_weights)
        else:
            out, w = self.self_attn(h, mask, cache=cache, layer=layer, attention_weights=attention_weights)
        if self.self_attn_post_norm is not None:
            out = self.self_attn_post_norm(out)
        x = self._residual(x, out, self.self_attn_norm)
        if w is not None:
            weights["self"] = w
        if self.cross_attn is not None:
            cross_kv = None
            if cache is not None and cache.cross is not None:
                cross_kv = (cache.cross.keys[layer], cache.cross.values[layer])
            h = self._input(x, self.cross_attn_norm)
            out, w = self.cross_attn(h, memory_mask, source=memory, kv=cross_kv, attention_weights=attention_weights)
            x = self._residual(x, out, self.cross_attn_norm)
            if w is not None:
                weights["cross"] = w
        out = self.ffn(self._input(x, self.ffn_norm))
        if self.ffn_post_norm is not None:
            out = self.ffn_post_norm(out)
        x = self._residual(x, out, self.ffn_norm)
        return x, weights


class LayerStack(nn.Module):
    """A stack of Transformer layers with the optional final LayerNorm of pre-LN models."""

    def __init__(self, config: TransformerConfig, n_layers: int, cross_attention: bool = False,
                 causal: bool = False) -> None:
        """``causal``: the stack's self-attention sees no later position (a decoder: its relative position bias
        buckets the distances one way)."""
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config, cross_attention, i) for i in range(n_layers))
        self.final_norm = make_norm(config, config.d_model) if config.final_norm else None
        # T5: one bias table for every layer's self-attention (transformers keeps it in layer 0)
        self.relative_bias = (RelativePositionBias(config.relative_buckets, config.relative_max_distance,
                                                   config.n_heads, bidirectional=not causal)
                              if config.positions == "relative" else None)

        self.native = not unsupported(config)  # the decode plan and C++ step (model.fast_step) implement these blocks

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        attention_weights: bool = False,
        keep_last: slice | None = None,
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """``keep_last``: the last layer computes only these positions (a head that reads [CLS] only).
        With a relative position bias ``mask`` (boolean) becomes the float mask of the bias, for every layer."""
        if self.relative_bias is not None:
            if keep_last is not None:
                raise ValueError("keep_last does not take a relative position bias")
            mask = self.relative_bias.attention_mask(mask, x.shape[1], cache)
        maps = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, weights = layer(
                x,
                mask,
                memory=memory,
                memory_mask=memory_mask,
                cache=cache,
                layer=i,
                attention_weights=attention_weights,
                keep=keep_last if i == last else None,
            )
            maps.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, maps


def _rotary(config: TransformerConfig, window: int | None) -> Rotary | None:
    """The rotary positions of a layer: window layers take their own unscaled base where one is set (Gemma 3)."""
    if config.positions != "rope":
        return None
    if window is not None and config.rope_local_theta is not None:
        return Rotary(config.head_dim, config.rope_local_theta, rotary_dim=config.rotary_dim)
    return Rotary.from_config(config)


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """(1, 1, T, T) boolean mask, True on and below the diagonal."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def padding_mask(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, 1, 1, T) boolean key mask, False at padding."""
    return (ids != pad_id)[:, None, None, :]


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT/BERT-style init: N(0, std) for Linear and Embedding weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            (nn.init.zeros_ if m.offset else nn.init.ones_)(m.weight)
