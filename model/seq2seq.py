"""Encoder-decoder Transformer for translation ("Attention Is All You Need")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.config import Seq2SeqConfig
from model.fast_step import run_decoder, run_encoder
from model.kernel_layers import Linear
from model.kv_cache import CrossAttentionMemory, KVCache
from model.layers import Embeddings, LayerStack, causal_mask, init_weights, padding_mask
from model.restricted_vocab import VocabularyRestriction
from model.tokenizer import pad_batch


class Seq2SeqTransformer(nn.Module):
    """Encoder stack, decoder stack with masked self-attention and encoder-decoder attention, output head."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        self.tgt_embed = Embeddings(config, config.vocab_size, pad_positions=config.pad_positions)
        shared = config.src_vocab_size is None
        self.src_embed = (self.tgt_embed if shared and config.shared_positions
                          else Embeddings(config, config.src_vocab_size or config.vocab_size,
                                          pad_positions=config.pad_positions))
        if shared and not config.shared_positions:  # one token embedding, a position table per side
            self.src_embed.tokens = self.tgt_embed.tokens
        self.encoder = LayerStack(config, config.n_encoder_layers)
        self.decoder = LayerStack(config, config.n_decoder_layers, cross_attention=True, causal=True)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=config.head_bias)
        init_weights(self)
        if config.scale_embeddings:
            for embed in {id(self.tgt_embed): self.tgt_embed, id(self.src_embed): self.src_embed}.values():
                nn.init.normal_(embed.tokens.weight, std=config.d_model**-0.5)
        if config.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.tokens.weight

    def encode(
        self, src: torch.Tensor, attention_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
        """src (B, S) right-padded -> (memory (B, S, D), source mask (B, 1, 1, S), attention maps)."""
        mask = padding_mask(src, self.config.pad_id)
        memory, maps = run_encoder(self.encoder, self.src_embed(src), mask, attention_weights)
        return memory, mask, maps

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, T, V) for decoder inputs ``tgt_in`` (B, T) (BOS + target[:-1])."""
        return self.forward_with_attention(src, tgt_in, attention_weights=False)[0]

    def forward_with_attention(
        self, src: torch.Tensor, tgt_in: torch.Tensor, attention_weights: bool = True
    ) -> tuple[torch.Tensor, dict[str, list[dict[str, torch.Tensor]]]]:
        memory, src_mask, enc_maps = self.encode(src, attention_weights)
        x = self.tgt_embed(tgt_in)
        x, dec_maps = self.decoder(
            x,
            causal_mask(tgt_in.shape[1], tgt_in.device),
            memory=memory,
            memory_mask=src_mask,
            attention_weights=attention_weights,
        )
        return self.logits(x), {"encoder": enc_maps, "decoder": dec_maps}

    def cross_kv(self, memory: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every decoder layer's cross-attention keys and values of ``memory`` (B, S, D), each (B, H, S, Dh)."""
        keys, values = zip(*(layer.cross_attn.project_kv(memory) for layer in self.decoder.layers), strict=True)
        return list(keys), list(values)

    def new_cache(self, memory: torch.Tensor, src_mask: torch.Tensor, capacity: int) -> KVCache:
        """A decoding cache with the cross-attention K/V of ``memory`` computed once per layer."""
        keys, values = self.cross_kv(memory)
        return self.cache_for(CrossAttentionMemory(keys=keys, values=values, mask=src_mask), capacity)

    def cache_for(self, cross: CrossAttentionMemory, capacity: int) -> KVCache:
        """An empty decoding cache over the encoded sources ``cross`` (one row per source)."""
        c = self.config
        keys = cross.keys[0]
        cache = KVCache.empty(c.n_decoder_layers, keys.shape[0], c.n_heads, c.head_dim, capacity, keys.device,
                              keys.dtype)
        cache.cross = cross
        return cache

    def start(self, src: torch.Tensor, capacity: int, targets: Sequence[Sequence[int]] | None = None,
              vocabulary: VocabularyRestriction | None = None) -> tuple[torch.Tensor, KVCache]:
        """Encode ``src`` and feed BOS (then each row's target prefix): the next-token logits (B, V) and the cache.
        ``vocabulary``: the target ids each row may produce (model.restricted_vocab)."""
        memory, src_mask, _ = self.encode(src)
        return self.start_from(self.new_cache(memory, src_mask, capacity), targets, vocabulary)

    def start_from(self, cache: KVCache, targets: Sequence[Sequence[int]] | None = None,
                   vocabulary: VocabularyRestriction | None = None) -> tuple[torch.Tensor, KVCache]:
        """Feed BOS to every row of a fresh ``cache``, followed by the row's ``targets`` prefix when given (the start
        of a translation to continue): the logits (B, V) of the token after them, and the cache."""
        device = cache.lengths.device
        if not targets or not any(targets):
            bos = torch.full((cache.batch_size,), self.config.bos_id, dtype=torch.long, device=device)
            return self.decode_step(bos, cache, vocabulary), cache
        starts = [[self.config.bos_id, *t] for t in targets]
        ids, lengths = (t.to(device) for t in pad_batch(starts, self.config.pad_id))
        positions, mask = cache.begin_step(ids.shape[1])
        x, _ = self.decoder(self.tgt_embed(ids, positions), mask, memory_mask=cache.cross.attention_mask, cache=cache)
        cache.end_step(lengths, max_advance=ids.shape[1])
        return self.logits(x[torch.arange(ids.shape[0], device=device), lengths - 1], vocabulary), cache

    def decode_step(self, tokens: torch.Tensor, cache: KVCache, vocabulary: VocabularyRestriction | None = None
                    ) -> torch.Tensor:
        """Feed one target token per row (N,); return next-token logits (N, V) (``vocabulary``: the target ids each
        row may produce, the others -inf)."""
        positions, mask = cache.begin_step(1)
        x = self.tgt_embed(tokens[:, None], positions)
        x = run_decoder(self.decoder, x, mask, cache, cache.cross.attention_mask)
        cache.end_step(1)
        return self.logits(x[:, 0], vocabulary)

    def verify_step(self, ids: torch.Tensor, cache: KVCache, vocabulary: VocabularyRestriction | None = None
                    ) -> torch.Tensor:
        """Feed t target tokens per row (B, t) (a fed token and a speculative draft); return the logits (B, t, V)
        after each. The cache keeps all t positions; :meth:`KVCache.truncate` forgets the rejected ones."""
        positions, mask = cache.begin_step(ids.shape[1])
        x = run_decoder(self.decoder, self.tgt_embed(ids, positions), mask, cache, cache.cross.attention_mask)
        cache.end_step(ids.shape[1])
        return self.logits(x, vocabulary)

    def logits(self, hidden: torch.Tensor, vocabulary: VocabularyRestriction | None = None) -> torch.Tensor:
        """The output head over ``hidden`` (B, [t,] D): every target token's logit, or under a ``vocabulary``
        restriction the candidates' (the others -inf). ``hidden`` is scaled by ``head_scale`` first (T5)."""
        if self.config.head_scale != 1.0:
            hidden = hidden * self.config.head_scale
        if vocabulary is None:
            return self.lm_head(hidden)
        return vocabulary.logits(self.lm_head, hidden)
