"""GPT-style decoder-only language model."""

from __future__ import annotations

import torch
from torch import nn

from model.config import CausalLMConfig
from model.fast_step import run_decoder, run_prefill
from model.kernel_layers import Linear
from model.kv_cache import KVCache
from model.layers import Embeddings, LayerStack, causal_mask, init_weights


class CausalLM(nn.Module):
    """Token + position embeddings, a stack of masked self-attention layers, a (tied) output projection."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embeddings(config, config.vocab_size)
        self.decoder = LayerStack(config, config.n_layers)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self)
        if config.scale_embeddings:
            nn.init.normal_(self.embed.tokens.weight, std=config.d_model**-0.5)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight

    def forward(self, ids: torch.Tensor, attention_weights: bool = False) -> torch.Tensor:
        """Logits (B, T, V) for every position of ``ids`` (B, T); right padding is harmless."""
        return self.forward_with_attention(ids, attention_weights)[0]

    def forward_with_attention(
        self, ids: torch.Tensor, attention_weights: bool = True
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        x = self.embed(ids)
        x, maps = self.decoder(x, causal_mask(ids.shape[1], ids.device), attention_weights=attention_weights)
        return self.lm_head(x), maps

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for ``batch`` rows, preallocated for ``capacity`` positions."""
        p = self.embed.tokens.weight  # always float (lm_head may be int8)
        c = self.config
        return KVCache.empty(c.n_layers, batch, c.kv_heads, c.head_dim, capacity, p.device, p.dtype)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run right-padded prompts ``ids`` (B, T) into ``cache``; return the logits (B, V) after each prompt."""
        positions, mask = cache.begin_step(ids.shape[1])
        x = run_prefill(self.decoder, self.embed(ids, positions), mask, cache)
        cache.end_step(lengths, max_advance=ids.shape[1])
        last = x[torch.arange(ids.shape[0], device=ids.device), lengths - 1]  # (B, D)
        return self.lm_head(last)

    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed one token per row (N,); return next-token logits (N, V)."""
        positions, mask = cache.begin_step(1)
        x = run_decoder(self.decoder, self.embed.for_step(tokens.unsqueeze(1), positions), mask, cache, None)
        cache.end_step(1)
        return self.lm_head(x[:, 0])

    def verify_step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed t tokens per row (B, t) (a fed token and a speculative draft); return the logits (B, t, V) after each.
        The cache keeps all t positions; :meth:`KVCache.truncate` forgets the rejected ones."""
        positions, mask = cache.begin_step(ids.shape[1])
        x = run_decoder(self.decoder, self.embed.for_step(ids, positions), mask, cache, None)
        cache.end_step(ids.shape[1])
        return self.lm_head(x)
