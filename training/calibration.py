"""A classifier's calibration on its valid split (`python -m training calibrate`): temperature scaling and the
confidence threshold below which it answers "unknown".

Temperature scaling (Guo et al., 2017) divides the logits by one T > 0 fitted to minimize the negative
log-likelihood of the valid labels; the accuracy is unchanged (the argmax is), the confidences come to match it.
The expected calibration error (ECE: the confidence-vs-accuracy gap averaged over ``ECE_BINS`` equal-width bins,
weighted by their share of examples) is reported before and after. The threshold is the calibrated confidence
below which ``max_rejected`` of the valid examples fall: a model default that rejects that share of in-label
texts, which texts outside the labels (usually less confident) fall under more often.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model.calibration import Calibration
from training.data import LabeledText

if TYPE_CHECKING:
    from model.checkpoint import Checkpoint

ECE_BINS = 15
LOG_T_RANGE = (-4.0, 4.0)  # T searched in [e^-4, e^4]
SEARCH_STEPS = 80  # golden-section steps: far below float64 noise on T


def nll(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> float:
    """Mean negative log-likelihood of ``labels`` under softmax(``logits`` / T), in float64."""
    return float(torch.nn.functional.cross_entropy(logits.double() / temperature, labels))


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float | None:
    """The T minimizing :func:`nll` (a convex function of 1 / T): golden-section search over log T; None when the
    minimum is not inside the searched range (a valid split the model separates perfectly: its NLL falls as T
    goes to 0, which says nothing about texts it gets wrong)."""
    ratio = (math.sqrt(5) - 1) / 2
    low, high = LOG_T_RANGE
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = nll(logits, labels, math.exp(a)), nll(logits, labels, math.exp(b))
    for _ in range(SEARCH_STEPS):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = nll(logits, labels, math.exp(a))
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = nll(logits, labels, math.exp(b))
    best = (low + high) / 2
    return None if min(best - LOG_T_RANGE[0], LOG_T_RANGE[1] - best) < 1e-3 else math.exp(best)


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> float:
    """ECE of probabilities (examples, labels): sum over confidence bins of share x |accuracy - confidence|."""
    confidence, predicted = probs.double().max(dim=-1)
    correct = (predicted == labels).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    error = 0.0
    for lower, upper in zip(edges[:-1], edges[1:], strict=True):
        inside = (confidence > lower) & (confidence <= upper)
        if inside.any():
            error += float(inside.double().mean() * (correct[inside].mean() - confidence[inside].mean()).abs())
    return error


def calibrated(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64: the probabilities a calibrated classifier serves."""
    return torch.softmax(logits.double() / temperature, -1)


def abstains(probs: torch.Tensor, min_confidence: float) -> torch.Tensor:
    """Per example, whether its top probability is below ``min_confidence``: an "unknown" answer, as served."""
    return probs.max(dim=-1).values < min_confidence


def calibrate(logits: torch.Tensor, labels: torch.Tensor, max_rejected: float) -> Calibration:
    """Temperature and threshold fitted on valid ``logits`` (examples, labels) and their ``labels``, with a
    report of ECE before and after and what the threshold rejects. A temperature that cannot be fitted (see
    :func:`fit_temperature`) stays 1."""
    fitted = fit_temperature(logits, labels)
    temperature = fitted if fitted is not None else 1.0
    before, after = calibrated(logits, 1.0), calibrated(logits, temperature)
    confidence = after.max(dim=-1).values
    threshold = float(torch.quantile(confidence, max_rejected)) if max_rejected > 0 else 0.0
    accepted = ~abstains(after, threshold)
    correct = after.argmax(-1) == labels
    report = {"examples": len(labels), "temperature_fitted": fitted is not None,
              "accuracy": float(correct.double().mean()),
              "ece_before": expected_calibration_error(before, labels),
              "ece_after": expected_calibration_error(after, labels),
              "nll_before": nll(logits, labels, 1.0), "nll_after": nll(logits, labels, temperature),
              "rejected": float(1 - accepted.double().mean()),
              "accuracy_of_accepted": float(correct[accepted].double().mean()) if accepted.any() else None}
    return Calibration(temperature, threshold, report)


def load_classifier(model_dir: Path) -> Checkpoint:
    """A single-label (softmax) classifier checkpoint with labels, on the CPU in float32 (ValueError for another
    model)."""
    from model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(model_dir, device="cpu", dtype=torch.float32)
    if checkpoint.family != "classifier" or not checkpoint.labels:
        raise ValueError(f"{model_dir}: calibrates a classifier with labels, got a {checkpoint.family} model")
    activation = checkpoint.config.output_activation
    if activation != "softmax":
        raise ValueError(f"{model_dir}: output_activation={activation!r}, but calibration fits the temperature of a "
                         "single-label classifier's softmax (output_activation='softmax'); a multi-label (sigmoid) "
                         "or regression (none) model is not calibrated")
    return checkpoint


def file_logits(
    checkpoint: Checkpoint, path: Path, batch_tokens: int = 8192, any_label: bool = False
) -> tuple[torch.Tensor, list[LabeledText]]:
    """The classifier's logits (examples, labels) on the texts of ``path`` (the training data's format), and its
    records; with ``any_label``, labels outside the model's are allowed (they are not scored)."""
    from training.tasks import TASKS, TaskOptions
    from training.tasks.base import TokenIds

    task = TASKS["classifier"](TaskOptions(batch_tokens=batch_tokens, ids=TokenIds.of(checkpoint.config)))
    records = task.read(path).records
    if not records:
        raise ValueError(f"{path}: no examples")
    scored = [replace(r, label=checkpoint.labels[0]) for r in records] if any_label else records
    examples = task.encode(scored, checkpoint.tokenizer, checkpoint.config, checkpoint.labels, path)
    return task.logits(checkpoint.model, examples), records


def calibrate_checkpoint(model_dir: Path, valid: Path, max_rejected: float, batch_tokens: int = 8192) -> Calibration:
    """:func:`calibrate` a classifier checkpoint on its valid file (the training data's format)."""
    checkpoint = load_classifier(model_dir)
    logits, records = file_logits(checkpoint, valid, batch_tokens)
    index = {label: i for i, label in enumerate(checkpoint.labels)}
    return calibrate(logits, torch.tensor([index[r.label] for r in records]), max_rejected)
