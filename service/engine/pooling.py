"""Dynamic batching of classification, token classification and embedding (LitServe's deadline-based collate).

The worker collects up to ``max_batch_size`` inputs or waits ``max_wait_ms`` from the oldest
arrival, runs one padded forward (per-row LoRA adapters for classify), and splits the rows back
per job. More rows than one forward takes go in chunks, longest first (:func:`batch_order`), so each chunk pads to
lengths near its own. A forward that raises is retried job by job; non-finite outputs fail only their job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.classifier import label_scores
from model.tokenizer import pad_batch
from service.engine.adapters import AdapterRegistry
from service.engine.batch import internal_name
from service.engine.jobs import CallJob, PoolingJob
from service.engine.metrics import Metrics, adapter_label
from service.engine.scheduler import Scheduler
from service.engine.types import UNKNOWN_LABEL, ClassifyOutput, EngineSettings

logger = logging.getLogger(__name__)


def batch_order(lengths: list[int], size: int) -> list[int]:
    """The order in which rows of ``lengths`` tokens are forwarded, ``size`` at a time: as they came when they fit in
    one forward, else longest first (ties as they came), as sentence-transformers' ``CrossEncoder.predict`` and
    ``encode`` sort theirs, so a chunk pads its rows to lengths near their own instead of to the longest of all."""
    if len(lengths) <= size:
        return list(range(len(lengths)))
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


class PoolingScheduler(Scheduler):
    """Dynamic batching of classify / logits / tokens / embed jobs (and one-off calls) on a classifier."""

    def __init__(self, name: str, model: nn.Module, labels: list[str], settings: EngineSettings, metrics: Metrics,
                 registry: AdapterRegistry, temperature: float = 1.0) -> None:
        super().__init__(name, model, settings, metrics, registry)
        self.labels = labels
        self.temperature = temperature  # the model's calibration (model.calibration): softmax(logits / T)
        self.device = next(model.parameters()).device

    def _iteration(self) -> None:
        jobs = []
        for job in self._take(self.settings.max_batch_size, alone_ok=True):
            if isinstance(job, CallJob):
                self._run_call(job)
            elif self._admit(job):
                self.metrics.prompt_tokens.labels(self.name, adapter_label(job.adapter_name)).inc(
                    sum(len(ids) for ids, _ in job.inputs))
                jobs.append(job)
        self.metrics.running.labels(self.name).set(len(jobs))
        heads = [j for j in jobs if j.endpoint in ("classify", "logits")]  # one forward through the head
        if heads:
            self._run_group(heads, self._classify, self._head_output)
        tokens = [j for j in jobs if j.endpoint == "tokens"]  # a token classification head's per-token logits
        if tokens:
            self._run_group(tokens, self.model.token_logits, _token_logits)
        for pooling in sorted({j.pooling for j in jobs if j.endpoint == "embed"}):
            group = [j for j in jobs if j.endpoint == "embed" and j.pooling == pooling]
            self._run_group(group, lambda ids, seg, p=pooling: self.model.embed_texts(ids, seg, p), _vectors)
        self._taken = []
        self.metrics.running.labels(self.name).set(0)

    def _run_group(self, jobs: list[PoolingJob], forward: Callable,
                   build: Callable[[PoolingJob, torch.Tensor], Any]) -> None:
        """Forward ``jobs``' inputs in chunks of max_batch_size rows; on failure retry job by job."""
        try:
            outputs = self._forward(jobs, forward)
        except Exception as exc:
            if len(jobs) > 1:
                logger.warning("model %r: batch of %d jobs failed (%s); retrying one by one", self.name, len(jobs), exc)
                for job in jobs:
                    self._run_group([job], forward, build)
                return
            logger.exception("model %r: request %r failed", self.name, jobs[0].id)
            self._finish(jobs[0], exc=self._failure(jobs[0], exc))
            return
        for job, out in zip(jobs, outputs, strict=True):
            if not bool(torch.isfinite(out).all()):
                self._finish(job, exc=self._failure(job, "the model produced non-finite outputs"))
            else:
                self._finish(job, build(job, out))

    def _forward(self, jobs: list[PoolingJob], forward: Callable) -> list[torch.Tensor]:
        rows = [(job, ids, seg) for job in jobs for ids, seg in job.inputs]
        size, chunks = self.settings.max_batch_size, []
        order = batch_order([len(ids) for _, ids, _ in rows], size)
        rows = [rows[i] for i in order]
        for start in range(0, len(rows), size):
            chunk = rows[start: start + size]
            ids, _ = pad_batch([r[1] for r in chunk], self.model.config.pad_id)
            seg, _ = pad_batch([r[2] for r in chunk], 0)
            owners = list({id(r[0]): r[0] for r in chunk}.values())
            out = self._call_model(owners, [internal_name(r[0]) for r in chunk], forward, ids.to(self.device),
                                   seg.to(self.device))
            self.metrics.batch_size.labels(self.name).observe(len(chunk))
            chunks.append(out)
        if chunks[0].dim() == 3:  # per-token outputs (B, T, L): chunks padded to one width T
            width = max(c.shape[1] for c in chunks)
            chunks = [F.pad(c, (0, 0, 0, width - c.shape[1])) for c in chunks]
        out = torch.cat(chunks)
        if len(chunks) > 1:  # rows went longest first: back in the jobs' order
            out = out[torch.tensor(order).argsort()]
        return list(out.split([len(job.inputs) for job in jobs]))

    def _classify(self, ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        return self.model(ids, segments)

    def _head_output(self, job: PoolingJob, logits: torch.Tensor) -> list[ClassifyOutput] | list[list[float]]:
        """classify: each row's labels ranked (_classify_output); logits: each row's raw logits (rerank's pairs,
        which the worker puts through the cross-encoder's activation)."""
        return self._classify_output(job, logits) if job.endpoint == "classify" else logits.float().tolist()

    def _classify_output(self, job: PoolingJob, logits: torch.Tensor) -> list[ClassifyOutput]:
        """Each row's labels ranked by score (model.classifier.label_scores: probabilities, or a regression's raw
        values, which never abstain)."""
        outputs = []
        activation = self.model.config.output_activation
        for probs in label_scores(logits.float(), activation, self.temperature).tolist():
            ranked = sorted(zip(self.labels, probs, strict=True), key=lambda lp: -lp[1])
            top = ranked[: job.top_k] if job.top_k else ranked
            label, score = ranked[0]
            abstained = activation != "none" and score < job.min_confidence
            outputs.append(ClassifyOutput(UNKNOWN_LABEL if abstained else label, score, dict(top), abstained))
        return outputs


def _token_logits(job: PoolingJob, out: torch.Tensor) -> list[torch.Tensor]:
    """A tokens job's logits per row (T, num_labels) in float32 on the CPU, trimmed to the row's length."""
    return [row[: len(ids)].float().cpu() for row, (ids, _) in zip(out, job.inputs, strict=True)]


def _vectors(job: PoolingJob, out: torch.Tensor) -> list[list[float]]:
    """An embed job's vectors, unit length when it asks for it."""
    out = out.float()
    return (F.normalize(out, dim=-1) if job.normalize else out).tolist()
