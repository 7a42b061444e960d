"""A classifier's calibration (calibration.json beside its checkpoint): the temperature that makes its softmax
confidences match its accuracy, and the confidence below which it answers "unknown" by default.

Written by `python -m training calibrate` (training/calibration.py), which fits both on the valid split; read by
model.checkpoint for classifier checkpoints; applied by the service's classify (service/engine/pooling.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CALIBRATION_FILE = "calibration.json"


class CalibrationError(ValueError):
    """A calibration.json that is not a valid calibration."""


@dataclass(frozen=True)
class Calibration:
    """softmax(logits / ``temperature``) are the calibrated probabilities; a top one below ``min_confidence`` is
    an "unknown" answer unless a request sets its own threshold. ``report``: how they were chosen."""

    temperature: float = 1.0
    min_confidence: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature > 0):
            raise CalibrationError(f"temperature must be finite and > 0, got {self.temperature!r}")
        if not (isinstance(self.min_confidence, int | float) and 0 <= self.min_confidence <= 1):
            raise CalibrationError(f"min_confidence must be in [0, 1], got {self.min_confidence!r}")

    def save(self, directory: Path) -> Path:
        path = directory / CALIBRATION_FILE
        path.write_text(json.dumps({"temperature": self.temperature, "min_confidence": self.min_confidence,
                                    "report": self.report}, indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: Path) -> Calibration | None:
        """``directory``'s calibration, or None when it has none."""
        path = directory / CALIBRATION_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(float(data["temperature"]), float(data["min_confidence"]), dict(data.get("report", {})))
        except (ValueError, KeyError, TypeError) as exc:
            raise CalibrationError(f"{path}: {exc}") from None
