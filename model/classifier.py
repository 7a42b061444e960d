"""BERT-style bidirectional encoder: classification, pooled embeddings, and pre-training heads.

The heads read the [CLS] state (or, ``head_pooling="mean"``, the mean of the non-pad states) through the optional
pooler: dense -> activation (-> LayerNorm with ``head_norm``: ModernBERT's head), which a token head applies to every
state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ClassifierConfig
from model.fast_step import ENCODER_CHUNK_TOKENS, run_encoder
from model.kernel_layers import LayerNorm, Linear, activate
from model.layers import Embeddings, LayerStack, init_weights, padding_mask
from model.lora_layers import HeadCopies, LoRALinear

POOLINGS = ("cls", "mean", "max")


def label_scores(logits: torch.Tensor, activation: str, temperature: float = 1.0) -> torch.Tensor:
    """What a classifier serves for its logits (B, num_labels) (ClassifierConfig.output_activation): softmax or
    sigmoid of logits / ``temperature`` (the calibration), or the raw values ("none": regression)."""
    if activation == "none":
        return logits
    if activation == "sigmoid":
        return torch.sigmoid(logits / temperature)
    return torch.softmax(logits / temperature, dim=-1)


class MaskedLMHead(nn.Module):
    """BERT's MLM head: dense + GELU + LayerNorm, then a projection tied to the token embedding."""

    def __init__(self, config: ClassifierConfig, embedding: nn.Embedding) -> None:
        super().__init__()
        self.dense = Linear(config.d_model, config.d_model)
        self.norm = LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.decoder = Linear(config.d_model, config.vocab_size)
        self.decoder.weight = embedding.weight
        nn.init.zeros_(self.decoder.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(hidden))))


class TransformerClassifier(nn.Module):
    """Encoder over "[CLS] a [SEP] b [SEP]" with segment embeddings; [CLS] (or mean) pooling feeds the heads."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embeddings(config, config.vocab_size, config.type_vocab_size, config.position_offset)
        self.encoder = LayerStack(config, config.n_layers)
        self.pooler = Linear(config.d_model, config.d_model) if config.pooler else None
        self.head_norm = LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.head_norm else None
        self.dropout = nn.Dropout(config.dropout)
        # num_labels 0: an embedding model without a classification head
        self.classifier = Linear(config.d_model, config.num_labels) if config.num_labels else None
        self.mlm_head = MaskedLMHead(config, self.embed.tokens)
        self.order_head = Linear(config.d_model, 2)  # sentence order / next sentence: 0 = in order
        init_weights(self)
        if config.scale_embeddings:
            nn.init.normal_(self.embed.tokens.weight, std=config.d_model**-0.5)

    def encode(
        self,
        ids: torch.Tensor,
        segments: torch.Tensor | None = None,
        attention_weights: bool = False,
        cls_only: bool = False,
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """ids (B, T) right-padded -> hidden states (B, T, D) and attention maps when asked.

        ``cls_only``: the last layer computes the [CLS] position alone (all the heads read): (B, 1, D).
        """
        mask = padding_mask(ids, self.config.pad_id)
        keep = slice(0, 1) if cls_only and self._cls_alone else None
        return run_encoder(self.encoder, self.embed(ids, segments=segments), mask, attention_weights, keep)

    @property
    def _cls_alone(self) -> bool:
        """Whether the last layer may compute [CLS] alone: its attention then reads no rotary positions and no window
        (TransformerLayer's ``keep``), and the head reads [CLS] only."""
        c = self.config
        return c.positions != "rope" and c.sliding_window is None and c.head_pooling == "cls"

    def pool(self, hidden: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The pooled representation (B, D) the heads read: the [CLS] state, or with ``head_pooling="mean"`` the mean
        of the states of ``ids``' non-pad tokens (ValueError without them), through :meth:`transform`."""
        if self.config.head_pooling == "mean":
            if ids is None:
                raise ValueError("head_pooling 'mean' needs the ids (which positions are padding)")
            return self.transform(_mean(hidden, ids, self.config.pad_id))
        return self.transform(hidden[:, 0])

    def transform(self, states: torch.Tensor) -> torch.Tensor:
        """act(dense(states)) with the pooler (BERT's pooler, RoBERTa's head dense, DistilBERT's pre_classifier),
        then the head's LayerNorm where there is one (ModernBERT's head); the states themselves without a pooler."""
        if self.pooler is None:
            return states
        pooled = self.pooler(states)
        act = self.config.pooler_activation
        pooled = torch.tanh(pooled) if act == "tanh" else activate(pooled, act)
        return pooled if self.head_norm is None else self.head_norm(pooled)

    def forward(self, ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Class logits (B, num_labels); ValueError for a model without a sequence classification head."""
        if self.classifier is None:
            raise ValueError("this model has no classification head (num_labels=0): it computes embeddings only")
        if self.config.head != "sequence":
            raise ValueError("this model has a token classification head: it computes token_logits, not one "
                             "row of logits per text")
        return self._by_length(ids, segments, self._logits)

    def _logits(self, ids: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        hidden, _ = self.encode(ids, segments, cls_only=True)
        return self.classifier(self.dropout(self.pool(hidden, ids)))

    def _by_length(self, ids: torch.Tensor, segments: torch.Tensor | None,
                   rows_out: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        """``rows_out(ids, segments)`` (one output row per input row) of an inference batch, computed over
        :func:`length_groups`' groups (no per-row adapters: their routing follows the batch's rows) and put back
        in order: each group's forward skips the padding its rows share (every row's output is its own)."""
        if (self.training or torch.is_grad_enabled() or ids.shape[0] < 2 or not ids.shape[1]
                or any(isinstance(m, (LoRALinear, HeadCopies)) and m.routing.groups is not None
                       for m in self.modules())):
            return rows_out(ids, segments)
        groups = length_groups(ids, self.config.pad_id, ENCODER_CHUNK_TOKENS)
        if len(groups) == 1 and groups[0][1] == ids.shape[1]:
            return rows_out(ids, segments)
        parts = [rows_out(ids[rows, :width], segments[rows, :width] if segments is not None else None)
                 for rows, width in groups]
        out = parts[0].new_empty(ids.shape[0], *parts[0].shape[1:])
        for (rows, _), part in zip(groups, parts, strict=True):
            out[rows] = part
        return out

    def token_logits(self, ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's class logits (B, T, num_labels) of a token classification head (pad rows included: the
        caller trims them); ValueError for any other model."""
        if self.classifier is None or self.config.head != "token":
            raise ValueError(f"this model has no token classification head (head={self.config.head!r}, "
                             f"num_labels={self.config.num_labels})")
        hidden, _ = self.encode(ids, segments)
        return self.classifier(self.dropout(self.transform(hidden)))

    def pretraining_logits(
        self, ids: torch.Tensor, segments: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM logits (B, T, V) and sentence-order logits (B, 2)."""
        hidden, _ = self.encode(ids, segments)
        return self.mlm_head(hidden), self.order_head(self.dropout(self.pool(hidden, ids)))

    def embed_texts(
        self, ids: torch.Tensor, segments: torch.Tensor | None = None, pooling: str = "mean"
    ) -> torch.Tensor:
        """Sentence embeddings (B, D): the [CLS] hidden state, or the mean or max over non-pad tokens."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        return self._by_length(ids, segments, lambda i, s: self._pooled(i, s, pooling))

    def _pooled(self, ids: torch.Tensor, segments: torch.Tensor | None, pooling: str) -> torch.Tensor:
        hidden, _ = self.encode(ids, segments)
        if pooling == "cls":
            return hidden[:, 0]
        if pooling == "max":
            keep = (ids != self.config.pad_id).unsqueeze(-1)
            return hidden.masked_fill(~keep, float("-inf")).amax(1)
        return _mean(hidden, ids, self.config.pad_id)


def length_groups(ids: torch.Tensor, pad_id: int, tokens: int) -> list[tuple[torch.Tensor, int]]:
    """The rows of ``ids`` (B, T) by length, in groups of about ``tokens`` positions (one row at least): (row indices,
    width) per group, the width its longest row's (up to its last non-pad token), so the columns a group drops are
    padding in each of its rows. A batch padded to its longest row (32 reranked pairs of 112-128 tokens) then
    computes ~1% padding instead of ~6%."""
    real = ids != pad_id
    widths = (real * torch.arange(1, ids.shape[1] + 1, device=ids.device)).amax(1).clamp(min=1).tolist()
    order = sorted(range(len(widths)), key=widths.__getitem__)
    groups, start = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order) or (end + 1 - start) * widths[order[end]] > tokens:
            groups.append((torch.tensor(order[start:end], device=ids.device), widths[order[end - 1]]))
            start = end
    return groups


def _mean(hidden: torch.Tensor, ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The mean (B, D) of each row's non-pad states of ``hidden`` (B, T, D)."""
    keep = (ids != pad_id).unsqueeze(-1).to(hidden.dtype)
    return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)
