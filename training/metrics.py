"""Evaluation metrics: BLEU and chrF (sacrebleu), accuracy and macro-F1, perplexity."""

from __future__ import annotations

import math
from collections.abc import Sequence


def bleu_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU and chrF (0-100) of detokenised ``hypotheses`` against one reference each."""
    import sacrebleu

    return {
        "bleu": sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score,
        "chrf": sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score,
    }


def accuracy_macro_f1(gold: Sequence[int], predicted: Sequence[int]) -> dict[str, float]:
    """Accuracy and the F1 averaged over every label that occurs in ``gold`` or ``predicted``."""
    if len(gold) != len(predicted) or not gold:
        raise ValueError("gold and predicted must be non-empty and of equal length")
    accuracy = sum(g == p for g, p in zip(gold, predicted, strict=True)) / len(gold)
    f1s = []
    for label in sorted(set(gold) | set(predicted)):
        tp = sum(g == label and p == label for g, p in zip(gold, predicted, strict=True))
        gold_n, pred_n = sum(g == label for g in gold), sum(p == label for p in predicted)
        f1s.append(2 * tp / (gold_n + pred_n))  # == 2PR / (P + R); 0 when tp == 0
    return {"accuracy": accuracy, "macro_f1": sum(f1s) / len(f1s)}


def perplexity(mean_nll: float) -> float:
    """exp of the mean per-token negative log-likelihood (capped at exp(700), so it stays JSON-safe)."""
    return math.exp(min(mean_nll, 700.0))
