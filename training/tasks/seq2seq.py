"""Translation: source/target pairs, label-smoothed teacher forcing, BLEU and chrF of decoded output.

Placeholders (model.placeholders: printf, braces, variables, tags, URLs, e-mails, options) are protected: a
pair whose target holds exactly its source's placeholders is trained with sentinels on both sides (the
tokenizer, trained on these texts, keeps the frequent sentinels as single tokens), and a decoded output gets
its source's placeholders back before it is scored. ``placeholders_ok`` is the share of outputs that held
exactly their source's placeholders before any repair.

Sources are encoded as ``source </s>`` (as the service encodes them, by the source side's tokenizer where
the model has its own); targets are fed as ``<s> target`` and predicted as ``target </s>`` (the decoder
starts from BOS, as model.generation does). The special ids are the model's (``TaskOptions.ids``: an OPUS-MT
model starts from its pad id and ends with id 0).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.config import Seq2SeqConfig
from model.decoding import GenerationConfig
from model.generation import generate_seq2seq
from model.placeholders import Protected, protect, sentinels_for
from model.seq2seq import Seq2SeqTransformer
from model.tokenizer import Tokenizer
from training.data import Pair, ReadResult, read_pairs
from training.metrics import bleu_chrf
from training.objectives import IGNORE_INDEX, cross_entropy_sum
from training.tasks.base import Adapters, Task, eval_mode, pad

logger = logging.getLogger(__name__)
DECODE_BATCH = 64  # sources per generation call
MAX_LEN_A, MAX_LEN_B = 2, 10  # output cap: a * source length + b tokens (as fairseq's max_len_a/b)


@dataclass(frozen=True)
class TranslationExample:
    source: list[int]
    target: list[int]
    reference: str
    protected: Protected  # the source as served: its placeholders swapped for sentinels; restores the output
    query: list[int]  # the encoded ``protected.text`` (== source unless the pair kept its placeholders raw)

    @property
    def length(self) -> int:
        return max(len(self.source), len(self.target) + 1)


@dataclass
class TranslationBatch:
    src: torch.Tensor  # (B, S) right-padded source ids
    tgt_in: torch.Tensor  # (B, T) <s> + target
    tgt_out: torch.Tensor  # (B, T) target + </s>, IGNORE_INDEX at padding
    count: int  # target tokens predicted
    num_tokens: int

    def to(self, device: torch.device) -> TranslationBatch:
        return replace(self, src=self.src.to(device), tgt_in=self.tgt_in.to(device), tgt_out=self.tgt_out.to(device))


class Seq2SeqTask(Task):
    family = "seq2seq"
    metric_name = "bleu"
    higher_is_better = True

    @property
    def valid_limit(self) -> int | None:
        return self.options.valid_examples  # decoding is the slow part of validation

    def read(self, path: Path) -> ReadResult:
        return read_pairs(path, self.options.skip_malformed)

    def texts(self, records: Sequence[Pair]) -> Iterator[str]:
        for pair in records:
            yield from protect(pair.source).pair(pair.target)

    def encode(
        self,
        records: Sequence[Pair],
        tokenizer: Tokenizer,
        config: Seq2SeqConfig,
        labels: list[str] | None,
        path: Path,
        source_tokenizer: Tokenizer | None = None,
    ) -> list[TranslationExample]:
        sentinels = sentinels_for(tokenizer, source_tokenizer or tokenizer)
        served = [protect(p.source, sentinels) for p in records]
        pairs = [query.pair(p.target) for query, p in zip(served, records, strict=True)]
        encoder = source_tokenizer or tokenizer
        sources = encoder.encode_batch([source for source, _ in pairs])
        targets = tokenizer.encode_batch([target for _, target in pairs])
        differ = [i for i, (pair, query) in enumerate(zip(pairs, served, strict=True)) if pair[0] != query.text]
        queries = dict(zip(differ, encoder.encode_batch([served[i].text for i in differ]), strict=True))
        truncated = sum(
            len(s) >= config.max_src_len or len(t) >= config.max_len for s, t in zip(sources, targets, strict=True)
        )
        if truncated:
            logger.warning("%s: %d pair(s) truncated to --max-len %d", path, truncated, config.max_len)
        eos, cut = self.options.ids.eos, config.max_src_len - 1
        examples = []
        for i, (s, t, p) in enumerate(zip(sources, targets, records, strict=True)):
            source = [*s[:cut], eos]
            query = [*queries[i][:cut], eos] if i in queries else source
            examples.append(TranslationExample(source, t[: config.max_len - 1], p.target, served[i], query))
        return examples

    def collate(self, examples: Sequence[TranslationExample], generator: torch.Generator) -> TranslationBatch:
        ids = self.options.ids
        src = pad([e.source for e in examples], ids.pad)
        tgt_in = pad([[ids.bos, *e.target] for e in examples], ids.pad)
        tgt_out = pad([[*e.target, ids.eos] for e in examples], IGNORE_INDEX)
        count = int((tgt_out != IGNORE_INDEX).sum())
        return TranslationBatch(src, tgt_in, tgt_out, count, count + int((src != ids.pad).sum()))

    def loss(self, model: nn.Module, batch: TranslationBatch) -> torch.Tensor:
        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
        return cross_entropy_sum(logits, batch.tgt_out, self.options.label_smoothing)

    def metric(
        self,
        model: Seq2SeqTransformer,
        examples: Sequence[TranslationExample],
        tokenizer: Tokenizer,
        adapters: Adapters,
        limit: int | None,
    ) -> dict[str, float]:
        chosen = list(examples[:limit])
        outputs = self.translate(model, [e.query for e in chosen], tokenizer, adapters)
        restored = [e.protected.restore(output) for e, output in zip(chosen, outputs, strict=True)]
        kept = sum(r.ok for r in restored) / max(len(restored), 1)
        return {**bleu_chrf([r.text for r in restored], [e.reference for e in chosen]), "placeholders_ok": kept}

    def translate(
        self, model: Seq2SeqTransformer, sources: Sequence[list[int]], tokenizer: Tokenizer, adapters: Adapters = None,
        forced_first: int | None = None, rules: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """Decode ``sources`` (greedy, or beam search with ``options.beams``), in input order. ``forced_first``:
        every output's first token (a target language's, BART's <s>: model.search.force_first_tokens); ``rules``:
        the GenerationConfig fields the model imposes (a Hugging Face generation_config's, GenerationRules.imposed).

        Outputs are capped at ``MAX_LEN_A * longest source + MAX_LEN_B`` tokens per batch (and by
        --max-new-tokens and the model's max_len), so an untrained model's endless outputs stay cheap.
        """
        cap = min(self.options.max_new_tokens, model.config.max_len - 1)
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))  # similar lengths share a batch
        texts: dict[int, str] = {}
        with eval_mode(model):
            for start in range(0, len(order), DECODE_BATCH):
                rows = order[start : start + DECODE_BATCH]
                longest = max(len(sources[i]) for i in rows)
                config = self._generation_config(min(cap, MAX_LEN_A * longest + MAX_LEN_B), self.options.ids.eos,
                                                 rules or {})
                forced = None if forced_first is None else [forced_first] * len(rows)
                results = generate_seq2seq(model, [sources[i] for i in rows], config, adapters,
                                           vocab_map=self.options.vocab_map, forced_first=forced)
                decoded = tokenizer.decode_batch([hyps[0].tokens for hyps in results])
                texts.update(zip(rows, decoded, strict=True))
        return [texts[i] for i in range(len(sources))]

    def _generation_config(self, max_new_tokens: int, eos_id: int, rules: Mapping[str, Any]) -> GenerationConfig:
        search = dict(strategy="beam", num_beams=self.options.beams) if self.options.beams > 1 else \
            dict(strategy="greedy")
        return GenerationConfig(**rules, **search, max_new_tokens=max_new_tokens, eos_token_id=eos_id)
