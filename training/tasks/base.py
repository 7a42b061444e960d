"""What a model family plugs into the commands: reading, tokenising, batching, loss and metrics."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from model.config import TransformerConfig
from model.lora import use_adapters
from model.tokenizer import Tokenizer
from model.vocab_map import VocabularyMap
from training.arch import ModelSizes, build_config
from training.batching import Batch, sorted_batches
from training.data import ReadResult
from training.trainer import Evaluation

Adapters = str | None


@dataclass(frozen=True)
class TokenIds:
    """The special ids a model's batches are built with: ours (model.tokenizer.SPECIAL_TOKENS) by default, an
    imported Hugging Face model's (GPT-2 pads with its EOS; Marian's EOS is 0) from its config."""

    pad: int = 0  # also what the model masks out of attention (config.pad_id)
    bos: int = 1  # a seq2seq decoder's start
    eos: int = 2

    @classmethod
    def of(cls, config: TransformerConfig) -> TokenIds:
        """The ids of ``config`` (a classifier has no bos / eos: ours stay)."""
        return cls(config.pad_id, getattr(config, "bos_id", cls.bos), getattr(config, "eos_id", cls.eos))


@dataclass(frozen=True)
class TaskOptions:
    """Settings shared by the family tasks."""

    skip_malformed: bool = False
    label_smoothing: float = 0.0
    batch_tokens: int = 4096  # padded tokens per batch, also for evaluation
    valid_examples: int = 200  # cap on the examples a generation metric decodes during training
    beams: int = 1  # beam size of generation metrics (1 = greedy)
    max_new_tokens: int = 128  # cap on generated tokens (further capped by the model's max_len)
    ids: TokenIds = TokenIds()  # the model's special ids
    vocab_map: VocabularyMap | None = None  # seq2seq decoding keeps to each source's candidates (model.vocab_map)


class Task(ABC):
    """One model family's glue; instances are cheap and hold only options."""

    family: ClassVar[str]
    metric_name: ClassVar[str]  # the validation metric that picks the best checkpoint
    higher_is_better: ClassVar[bool]

    def __init__(self, options: TaskOptions) -> None:
        self.options = options

    @abstractmethod
    def read(self, path: Path) -> ReadResult:
        """Records of a data file and the malformed lines skipped (raises UserErrors naming file:line)."""

    @abstractmethod
    def texts(self, records: Sequence[Any]) -> Iterator[str]:
        """The texts a tokenizer is trained on."""

    def labels(self, records: Sequence[Any]) -> list[str] | None:
        """Label names found in training records (classifier only)."""
        return None

    def config(self, sizes: ModelSizes, tokenizer: Tokenizer, labels: list[str] | None) -> TransformerConfig:
        return build_config(self.family, sizes, tokenizer.vocab_size)

    @abstractmethod
    def encode(
        self,
        records: Sequence[Any],
        tokenizer: Tokenizer,
        config: TransformerConfig,
        labels: list[str] | None,
        path: Path,
        source_tokenizer: Tokenizer | None = None,
    ) -> list[Any]:
        """Examples with a ``length`` attribute (the bucketing key), truncated to the model's limits.
        ``source_tokenizer``: a seq2seq's input side where it has its own (an OPUS-MT model's source.spm)."""

    @abstractmethod
    def collate(self, examples: Sequence[Any], generator: torch.Generator) -> Batch:
        """One padded batch."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Summed loss over ``batch.count`` units."""

    @abstractmethod
    def metric(
        self, model: nn.Module, examples: Sequence[Any], tokenizer: Tokenizer, adapters: Adapters, limit: int | None
    ) -> dict[str, float]:
        """Family metrics on (up to ``limit``) examples; includes ``metric_name``."""

    @property
    def valid_limit(self) -> int | None:
        """How many validation examples the metric sees during training (None = all)."""
        return None

    def mean_loss(self, model: nn.Module, examples: Sequence[Any], adapters: Adapters = None) -> float:
        """The training objective averaged over all of ``examples`` (eval mode, no gradient)."""
        total, count = 0.0, 0
        device = next(model.parameters()).device
        batches = sorted_batches([e.length for e in examples], self.options.batch_tokens)
        generator = torch.Generator().manual_seed(0)  # MLM masks of validation are fixed
        with eval_mode(model), torch.no_grad(), use_adapters(model, adapters):
            for indices in batches:
                batch = self.collate([examples[i] for i in indices], generator).to(device)
                total += self.loss(model, batch).item()
                count += batch.count
        return total / max(count, 1)

    def validate(
        self, model: nn.Module, examples: Sequence[Any], tokenizer: Tokenizer, adapters: Adapters = None
    ) -> Evaluation:
        """Validation loss and metrics (see ``valid_limit``)."""
        loss = self.mean_loss(model, examples, adapters)
        values = self.metric(model, examples, tokenizer, adapters, self.valid_limit)
        metric = values.pop(self.metric_name)
        return Evaluation(loss, metric, self.metric_name, self.higher_is_better, values)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block, then back to the previous mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def pad(seqs: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """Right-pad int sequences into a (B, T) long tensor."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out
