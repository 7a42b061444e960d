"""Text classification: "[CLS] a [SEP] (b [SEP])" with labels; accuracy and macro-F1."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from model.classifier import TransformerClassifier
from model.config import ClassifierConfig
from model.lora import use_adapters
from model.tokenizer import Tokenizer
from training.arch import ModelSizes, build_config
from training.batching import sorted_batches
from training.data import DataError, LabeledText, ReadResult, read_labeled
from training.metrics import accuracy_macro_f1
from training.objectives import cross_entropy_sum
from training.tasks.base import Adapters, Task, eval_mode, pad

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClassificationExample:
    ids: list[int]
    segments: list[int]
    label: int

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass
class ClassificationBatch:
    ids: torch.Tensor  # (B, T)
    segments: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B,)
    count: int  # rows
    num_tokens: int

    def to(self, device: torch.device) -> ClassificationBatch:
        return replace(self, ids=self.ids.to(device), segments=self.segments.to(device), labels=self.labels.to(device))


class ClassifierTask(Task):
    family = "classifier"
    metric_name = "accuracy"
    higher_is_better = True

    def read(self, path: Path) -> ReadResult:
        return read_labeled(path, self.options.skip_malformed)

    def texts(self, records: Sequence[LabeledText]) -> Iterator[str]:
        for r in records:
            yield r.text
            if r.text_b is not None:
                yield r.text_b

    def labels(self, records: Sequence[LabeledText]) -> list[str]:
        return sorted({r.label for r in records})

    def config(self, sizes: ModelSizes, tokenizer: Tokenizer, labels: list[str] | None) -> ClassifierConfig:
        assert labels is not None
        return build_config(self.family, sizes, tokenizer.vocab_size, num_labels=len(labels), cls_id=tokenizer.cls_id)

    def encode(
        self,
        records: Sequence[LabeledText],
        tokenizer: Tokenizer,
        config: ClassifierConfig,
        labels: list[str] | None,
        path: Path,
        source_tokenizer: Tokenizer | None = None,
    ) -> list[ClassificationExample]:
        assert labels is not None
        index = {name: i for i, name in enumerate(labels)}
        examples, truncated = [], 0
        for r in records:
            if r.label not in index:
                raise DataError(f"{path}:{r.line}: label {r.label!r} is not one of the model's labels {labels}")
            ids, segments = tokenizer.encode_pair(r.text, r.text_b)
            truncated += len(ids) > config.max_len
            examples.append(ClassificationExample(ids[: config.max_len], segments[: config.max_len], index[r.label]))
        if truncated:
            logger.warning("%s: %d text(s) truncated to --max-len %d", path, truncated, config.max_len)
        return examples

    def collate(self, examples: Sequence[ClassificationExample], generator: torch.Generator) -> ClassificationBatch:
        pad_id = self.options.ids.pad
        ids = pad([e.ids for e in examples], pad_id)
        segments = pad([e.segments for e in examples], 0)
        labels = torch.tensor([e.label for e in examples], dtype=torch.long)
        return ClassificationBatch(ids, segments, labels, len(examples), int((ids != pad_id).sum()))

    def loss(self, model: nn.Module, batch: ClassificationBatch) -> torch.Tensor:
        return cross_entropy_sum(model(batch.ids, batch.segments), batch.labels, self.options.label_smoothing)

    def logits(
        self, model: TransformerClassifier, examples: Sequence[ClassificationExample], adapters: Adapters = None
    ) -> torch.Tensor:
        """The model's logits (examples, labels) for every example, in order, in float32 on the CPU."""
        device = next(model.parameters()).device
        out = torch.empty(len(examples), model.config.num_labels)
        with eval_mode(model), torch.no_grad(), use_adapters(model, adapters):
            for indices in sorted_batches([e.length for e in examples], self.options.batch_tokens):
                batch = self.collate([examples[i] for i in indices], torch.Generator()).to(device)
                out[indices] = model(batch.ids, batch.segments).float().cpu()
        return out

    def predict(
        self, model: TransformerClassifier, examples: Sequence[ClassificationExample], adapters: Adapters = None
    ) -> list[int]:
        """Predicted label index per example, in order."""
        return self.logits(model, examples, adapters).argmax(-1).tolist() if examples else []

    def metric(
        self,
        model: TransformerClassifier,
        examples: Sequence[ClassificationExample],
        tokenizer: Tokenizer,
        adapters: Adapters,
        limit: int | None,
    ) -> dict[str, float]:
        chosen = list(examples[:limit])
        return accuracy_macro_f1([e.label for e in chosen], self.predict(model, chosen, adapters))
