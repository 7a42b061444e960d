"""Trivial baselines a trained model must beat, measured on the same test split as the model.

- translation: copy the source sentence as its own translation (BLEU and chrF, sacrebleu);
- language id: always the train split's most frequent label (accuracy, macro-F1), and the
  `langdetect` package (a docs/benchmark-only dependency, imported lazily);
- language modelling: an add-one smoothed unigram over the model's own tokenizer, counted on the
  train split and scored on exactly the tokens the model's perplexity is computed over.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from model.tokenizer import TOKENIZER_FILE, Tokenizer
from training.data import LabeledText, Pair, read_documents, read_labeled, read_pairs
from training.errors import UserError
from training.metrics import accuracy_macro_f1, bleu_chrf, perplexity

logger = logging.getLogger(__name__)

LANGDETECT_PIN = "langdetect==1.0.9"
UNKNOWN = "<unknown>"  # the prediction when langdetect finds no language (never a gold label)


def copy_source(pairs: Sequence[Pair]) -> dict[str, float]:
    """BLEU and chrF of the sources taken as their own translations."""
    return bleu_chrf([p.source for p in pairs], [p.target for p in pairs])


def majority_label(train: Iterable[str]) -> str:
    """The most frequent label (ties: the first in sorted order, so the choice is stable)."""
    counts = Counter(train)
    if not counts:
        raise UserError("no training labels to take a majority of")
    return min(counts, key=lambda label: (-counts[label], label))


def majority_class(train: Sequence[LabeledText], test: Sequence[LabeledText]) -> dict[str, Any]:
    """Accuracy and macro-F1 of always predicting the train split's majority label."""
    label = majority_label(r.label for r in train)
    gold = [r.label for r in test]
    return {**accuracy_macro_f1(gold, [label] * len(gold)), "label": label}


def map_langdetect(code: str, labels: Sequence[str]) -> str:
    """A langdetect code as one of ``labels``: exact (``zh-cn`` -> ``zh_CN``), else by language alone.

    The fallback is generous to langdetect (``pt`` -> ``pt_BR``, ``zh-tw`` -> ``zh_CN``), so the
    baseline is if anything too strong; a code matching no label is returned unchanged (a miss).
    """
    lang, _, region = code.partition("-")
    exact = f"{lang}_{region.upper()}" if region else lang
    if exact in labels:
        return exact
    same_language = [label for label in labels if label.split("_")[0] == lang]
    return same_language[0] if len(same_language) == 1 else code


def langdetect_predict(texts: Sequence[str], labels: Sequence[str], seed: int = 0) -> list[str]:
    """langdetect's language of each text mapped to ``labels`` (``UNKNOWN`` where it finds none)."""
    try:
        from langdetect import DetectorFactory, detect
        from langdetect.lang_detect_exception import LangDetectException
    except ImportError:
        raise UserError(
            f"the langdetect baseline needs the langdetect package: pip install {LANGDETECT_PIN} "
            "(a docs/benchmark-only dependency in requirements-dev.txt)"
        ) from None
    DetectorFactory.seed = seed  # langdetect samples n-grams at random
    predictions = []
    for text in texts:
        try:
            predictions.append(map_langdetect(detect(text), labels))
        except LangDetectException:  # no letters it knows, e.g. only digits
            predictions.append(UNKNOWN)
    return predictions


def langdetect_baseline(test: Sequence[LabeledText], labels: Sequence[str]) -> dict[str, Any]:
    """Accuracy and macro-F1 of langdetect on ``test``.

    A prediction outside ``labels`` is a miss; it lowers the recall of the gold label, but its own
    F1 of 0 is left out of the mean (as it would be for the model, which can only predict ``labels``).
    """
    gold = [r.label for r in test]
    predicted = langdetect_predict([r.text for r in test], labels)
    other = {p for p in predicted if p not in labels} - set(gold)
    outside = sum(p in other for p in predicted)
    scores = accuracy_macro_f1(gold, predicted)
    if other:  # undo the zero F1s of labels the model could never predict
        n = len(set(gold) | set(predicted))
        scores["macro_f1"] = scores["macro_f1"] * n / (n - len(other))
    return {**scores, "outside_labels": outside, "unknown": predicted.count(UNKNOWN)}


def lm_targets(texts: Sequence[str], tokenizer: Tokenizer) -> list[int]:
    """The tokens a causal LM's perplexity is computed over: the ``<s> text </s>`` stream less its first."""
    stream: list[int] = []
    for ids in tokenizer.encode_batch(list(texts), add_bos=True, add_eos=True):
        stream.extend(ids)
    return stream[1:]


def unigram_perplexity(train: Sequence[int], test: Sequence[int], vocab_size: int) -> dict[str, float]:
    """Perplexity on ``test`` of p(t) = (count(t) + 1) / (N + V), counted on ``train`` (N tokens)."""
    if not test:
        raise UserError("no test tokens to score")
    counts = Counter(train)
    denominator = len(train) + vocab_size
    nll = -sum(math.log((counts[t] + 1) / denominator) for t in test) / len(test)
    return {"perplexity": perplexity(nll), "nll": nll, "tokens": float(len(test)), "train_tokens": float(len(train))}


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise UserError(f"--model: no {TOKENIZER_FILE} in {model_dir}")
    return Tokenizer.load(path)


def model_family(model_dir: Path) -> str:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))["family"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--model: {model_dir} is not a checkpoint directory ({e})") from e


def model_labels(model_dir: Path) -> list[str]:
    path = Path(model_dir) / "labels.json"
    if not path.is_file():
        raise UserError(f"--model: a classifier checkpoint needs labels.json in {model_dir}")
    return json.loads(path.read_text(encoding="utf-8"))


def baselines_for(model_dir: Path, train: Path, test: Path, langdetect: bool = True) -> dict[str, Any]:
    """Every trivial baseline of ``model_dir``'s family on ``test`` (fitted on ``train`` where they learn)."""
    family = model_family(model_dir)
    result: dict[str, Any] = {"family": family, "train_file": str(train), "test_file": str(test)}
    if family == "seq2seq":
        pairs = read_pairs(test).records
        result.update(test_examples=len(pairs), copy_source=copy_source(pairs))
    elif family == "classifier":
        test_records = read_labeled(test).records
        result.update(
            test_examples=len(test_records), majority=majority_class(read_labeled(train).records, test_records)
        )
        if langdetect:
            result["langdetect"] = langdetect_baseline(test_records, model_labels(model_dir))
    elif family == "causal_lm":
        tokenizer = load_tokenizer(model_dir)
        train_ids = lm_targets([d.text for d in read_documents(train).records], tokenizer)
        test_ids = lm_targets([d.text for d in read_documents(test).records], tokenizer)
        result.update(unigram=unigram_perplexity(train_ids, test_ids, tokenizer.vocab_size))
    else:
        raise UserError(f"no baselines for family {family!r}")
    return result
