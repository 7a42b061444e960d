"""The run's log: one CSV row per optimiser step, TensorBoard when installed, and a loss plot."""

from __future__ import annotations

import csv
import logging
import math
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COLUMNS = ("step", "epoch", "loss", "lr", "tokens", "tokens_per_s", "elapsed", "valid_loss", "valid_metric")
LOG_FILE = "train_log.csv"
PLOT_FILE = "loss.png"
PLOT_INTERVAL_S = 60.0  # redraw during training at most this often (drawing costs ~0.2 s)


def _summary_writer(directory: Path) -> Any | None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(directory / "tensorboard"))


class RunLog:
    """``train_log.csv`` in ``directory``; resuming at step N drops rows after N (a killed run's tail)."""

    def __init__(self, directory: Path, resume_step: int | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOG_FILE
        self.plot_path = directory / PLOT_FILE
        self.rows: list[dict[str, str]] = []
        if resume_step is not None and self.path.exists():
            with open(self.path, newline="") as f:
                rows = csv.DictReader(f)
                self.rows = [r for r in rows if r.get("step", "").isdigit() and int(r["step"]) <= resume_step]
        self._file = open(self.path, "w", newline="")  # noqa: SIM115 (kept open for the whole run)
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
        self._csv.writeheader()
        self._csv.writerows(self.rows)
        self._file.flush()
        self._tensorboard = _summary_writer(directory)
        self._last_plot = time.monotonic()

    def log(self, row: dict[str, Any]) -> None:
        """Append one step's values (missing columns stay empty)."""
        text = {k: "" if row.get(k) is None else _format(row[k]) for k in COLUMNS}
        self.rows.append(text)
        self._csv.writerow(text)
        self._file.flush()
        if self._tensorboard is not None:
            for key in ("loss", "lr", "tokens_per_s", "valid_loss", "valid_metric"):
                if row.get(key) is not None:
                    self._tensorboard.add_scalar(key, row[key], row["step"])

    def plot(self, metric_name: str = "valid_metric", force: bool = True) -> Path | None:
        """Draw training and validation loss (and the metric on a second axis) into ``loss.png``.

        Without ``force`` nothing is drawn within PLOT_INTERVAL_S of the previous drawing.
        """
        if not self.rows or (not force and time.monotonic() - self._last_plot < PLOT_INTERVAL_S):
            return None
        self._last_plot = time.monotonic()
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [int(r["step"]) for r in self.rows]
        losses = [float(r["loss"]) for r in self.rows]
        valid = [(int(r["step"]), float(r["valid_loss"])) for r in self.rows if r["valid_loss"]]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, losses, label="train loss", linewidth=1)
        if valid:
            ax.plot(*zip(*valid, strict=True), "o-", label="valid loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        metric = [(int(r["step"]), float(r["valid_metric"])) for r in self.rows if r["valid_metric"]]
        if metric:
            twin = ax.twinx()
            twin.plot(*zip(*metric, strict=True), "s--", color="tab:green", label=metric_name)
            twin.set_ylabel(metric_name)
        handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
        ax.legend(handles=handles, loc="upper right")
        fig.tight_layout()
        tmp = self.plot_path.with_name(f".{PLOT_FILE}.tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(self.plot_path)
        return self.plot_path

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _format(value: Any) -> str:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)
