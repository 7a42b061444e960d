"""Language modelling: documents joined into one token stream (each as ``<s> text </s>``, the service
prompts with a leading ``<s>``; with an imported model's tokenizer, ``text </s>`` as its own template encodes
``text``, as the service prompts it there), cut into blocks.

A block holds ``max_len + 1`` tokens and the next block starts at its last token, so every token
but the stream's first is predicted exactly once, from at most ``max_len`` tokens of context.
Perplexity is exp of the mean token negative log-likelihood over those blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from model.checkpoint import encode_prompts
from model.config import CausalLMConfig
from model.tokenizer import Tokenizer
from training.data import Document, ReadResult, read_documents
from training.metrics import perplexity
from training.objectives import IGNORE_INDEX, cross_entropy_sum
from training.tasks.base import Adapters, Task, TaskOptions, pad
from training.trainer import Evaluation


@dataclass(frozen=True)
class Block:
    tokens: list[int]  # inputs are tokens[:-1], targets tokens[1:]

    @property
    def length(self) -> int:
        return len(self.tokens) - 1


@dataclass
class BlockBatch:
    ids: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T), IGNORE_INDEX at padding
    count: int  # tokens predicted
    num_tokens: int

    def to(self, device: torch.device) -> BlockBatch:
        return replace(self, ids=self.ids.to(device), targets=self.targets.to(device))


def blocks(stream: Sequence[int], max_len: int) -> list[Block]:
    """Overlapping-by-one windows of ``max_len + 1`` tokens covering ``stream``."""
    return [Block(list(stream[i : i + max_len + 1])) for i in range(0, max(len(stream) - 1, 0), max_len)]


class CausalLMTask(Task):
    family = "causal_lm"
    metric_name = "perplexity"
    higher_is_better = False

    def read(self, path: Path) -> ReadResult:
        return read_documents(path, self.options.skip_malformed)

    def texts(self, records: Sequence[Document]) -> Iterator[str]:
        for doc in records:
            yield doc.text

    def encode(
        self,
        records: Sequence[Document],
        tokenizer: Tokenizer,
        config: CausalLMConfig,
        labels: list[str] | None,
        path: Path,
        source_tokenizer: Tokenizer | None = None,
    ) -> list[Block]:
        prompts = encode_prompts(tokenizer, config.family, [d.text for d in records])  # as the service encodes them
        stream = [token for ids in prompts for token in (*ids, self.options.ids.eos)]
        return blocks(stream, config.max_len)

    def collate(self, examples: Sequence[Block], generator: torch.Generator) -> BlockBatch:
        ids = pad([b.tokens[:-1] for b in examples], self.options.ids.pad)
        targets = pad([b.tokens[1:] for b in examples], IGNORE_INDEX)
        count = int((targets != IGNORE_INDEX).sum())
        return BlockBatch(ids, targets, count, count)

    def loss(self, model: nn.Module, batch: BlockBatch) -> torch.Tensor:
        return cross_entropy_sum(model(batch.ids), batch.targets, self.options.label_smoothing)

    def metric(
        self, model: nn.Module, examples: Sequence[Block], tokenizer: Tokenizer, adapters: Adapters, limit: int | None
    ) -> dict[str, float]:
        chosen = list(examples[:limit])
        plain = CausalLMTask(TaskOptions(batch_tokens=self.options.batch_tokens, ids=self.options.ids))  # no smoothing
        nll = plain.mean_loss(model, chosen, adapters)
        return {"perplexity": perplexity(nll), "nll": nll, "tokens": float(sum(b.length for b in chosen))}

    def validate(
        self, model: nn.Module, examples: Sequence[Block], tokenizer: Tokenizer, adapters: Adapters = None
    ) -> Evaluation:
        if self.options.label_smoothing:
            return super().validate(model, examples, tokenizer, adapters)
        loss = self.mean_loss(model, examples, adapters)  # already the plain NLL: one pass suffices
        return Evaluation(loss, perplexity(loss), self.metric_name, self.higher_is_better)
