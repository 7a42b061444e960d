"""BERT-style bidirectional encoder: classification, pooled embeddings, and pre-training heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ClassifierConfig
from model.fast_step import run_encoder
from model.kernel_layers import LayerNorm, Linear
from model.layers import Embeddings, LayerStack, init_weights, padding_mask

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
    """Encoder over "[CLS] a [SEP] b [SEP]" with segment embeddings; [CLS] pooling feeds the heads."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embeddings(config, config.vocab_size, config.type_vocab_size, config.position_offset)
        self.encoder = LayerStack(config, config.n_layers)
        self.pooler = Linear(config.d_model, config.d_model) if config.pooler else None
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
        keep = slice(0, 1) if cls_only else None
        return run_encoder(self.encoder, self.embed(ids, segments=segments), mask, attention_weights, keep)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """The pooled [CLS] representation (B, D) the heads read: act(dense([CLS])) with the pooler (BERT's pooler,
        RoBERTa's head dense, DistilBERT's pre_classifier), else [CLS] itself."""
        cls = hidden[:, 0]
        if self.pooler is None:
            return cls
        pooled = self.pooler(cls)
        return torch.tanh(pooled) if self.config.pooler_activation == "tanh" else F.relu(pooled)

    def forward(self, ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Class logits (B, num_labels); ValueError for a model without a sequence classification head."""
        if self.classifier is None:
            raise ValueError("this model has no classification head (num_labels=0): it computes embeddings only")
        if self.config.head != "sequence":
            raise ValueError("this model has a token classification head: it computes token_logits, not one "
                             "row of logits per text")
        hidden, _ = self.encode(ids, segments, cls_only=True)
        return self.classifier(self.dropout(self.pool(hidden)))

    def token_logits(self, ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's class logits (B, T, num_labels) of a token classification head (pad rows included: the
        caller trims them); ValueError for any other model."""
        if self.classifier is None or self.config.head != "token":
            raise ValueError(f"this model has no token classification head (head={self.config.head!r}, "
                             f"num_labels={self.config.num_labels})")
        hidden, _ = self.encode(ids, segments)
        return self.classifier(self.dropout(hidden))

    def pretraining_logits(
        self, ids: torch.Tensor, segments: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM logits (B, T, V) and sentence-order logits (B, 2)."""
        hidden, _ = self.encode(ids, segments)
        return self.mlm_head(hidden), self.order_head(self.dropout(self.pool(hidden)))

    def embed_texts(
        self, ids: torch.Tensor, segments: torch.Tensor | None = None, pooling: str = "mean"
    ) -> torch.Tensor:
        """Sentence embeddings (B, D): the [CLS] hidden state, or the mean or max over non-pad tokens."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        hidden, _ = self.encode(ids, segments)
        if pooling == "cls":
            return hidden[:, 0]
        keep = (ids != self.config.pad_id).unsqueeze(-1)
        if pooling == "max":
            return hidden.masked_fill(~keep, float("-inf")).amax(1)
        keep = keep.to(hidden.dtype)
        return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)
