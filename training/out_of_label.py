"""How a calibrated classifier's "unknown" answer treats texts outside its labels (the recipe's out-of-label
evaluation of langid).

The served classifier abstains when its calibrated top probability is below the threshold of its calibration.json
(training.calibration, fitted to reject a share of the valid split). This counts the texts it abstains on among
texts in languages outside its labels (a langid corpus's out-of-label.tsv, training.corpora), which it should
reject, and among in-label test texts, which it should not.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from model.calibration import Calibration
from training.calibration import abstains, calibrated, file_logits, load_classifier


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def rejections(
    model_dir: Path, outside: Path, in_label: Mapping[str, Path], batch_tokens: int = 8192
) -> dict[str, Any]:
    """The shares of ``outside``'s texts (in all and per language) and of each ``in_label`` file's texts (by name)
    that ``model_dir`` abstains on under its calibration (none: temperature 1, threshold 0, so it abstains on
    nothing)."""
    checkpoint = load_classifier(model_dir)
    calibration = checkpoint.calibration or Calibration()

    def rejected(path: Path, any_label: bool) -> tuple[list[bool], list[str]]:
        logits, records = file_logits(checkpoint, path, batch_tokens, any_label)
        flags = abstains(calibrated(logits, calibration.temperature), calibration.min_confidence).tolist()
        return flags, [r.label for r in records]

    flags, languages = rejected(outside, any_label=True)
    by_language = {
        lang: _share([f for f, other in zip(flags, languages, strict=True) if other == lang])
        for lang in sorted(set(languages))
    }
    in_label_flags = {name: rejected(path, any_label=False)[0] for name, path in in_label.items()}
    return {
        "temperature": calibration.temperature,
        "min_confidence": calibration.min_confidence,
        "out_of_label": {"texts": len(flags), "rejected": _share(flags), "rejected_by_language": by_language},
        "in_label": {name: {"texts": len(f), "rejected": _share(f)} for name, f in in_label_flags.items()},
    }
