"""How a training run shows its progress: a bar on a terminal, log lines now and then everywhere else.

A log file (``make run`` writes one) cannot hold a bar, so when stderr is not a terminal, or the bar
is turned off (``--quiet``), rank 0 logs one line at the first step of the run, then every
``interval_s`` seconds, and at its last step::

    code: step 120/2000 (6%), loss 3.2154, 1530 tokens/s, ETA 4:12
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType

from tqdm import tqdm

logger = logging.getLogger(__name__)

LINE_INTERVAL_S = 30.0  # seconds between two progress lines


def clock_text(seconds: float) -> str:
    """``seconds`` as m:ss, or h:mm:ss from an hour on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressDisplay:
    """The progress of steps ``first_step + 1 .. max_steps``: a tqdm bar when ``bar``, else (when ``lines``) a
    logged line at the first and last step and every ``interval_s`` seconds of ``clock`` in between.

    ``deadline`` (a ``clock()`` value) caps the ETA when the time budget ends the run before its steps do.
    """

    def __init__(
        self,
        first_step: int,
        max_steps: int,
        *,
        bar: bool,
        lines: bool,
        name: str = "",
        deadline: float | None = None,
        interval_s: float = LINE_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.first_step, self.max_steps = first_step, max_steps
        self.lines = lines and not bar
        self.prefix = f"{name}: " if name else ""
        self.deadline, self.interval_s, self.clock = deadline, interval_s, clock
        self.start = self.last_line = clock()
        self._bar = tqdm(
            total=max_steps, initial=first_step, disable=not bar, file=sys.stderr, unit="step", dynamic_ncols=True
        )

    @classmethod
    def for_stderr(
        cls, first_step: int, max_steps: int, *, main: bool, quiet: bool, name: str, deadline: float | None
    ) -> ProgressDisplay:
        """Rank 0's display: the bar on a terminal unless ``quiet``, else lines; nothing on the other ranks."""
        bar = main and not quiet and sys.stderr.isatty()
        return cls(first_step, max_steps, bar=bar, lines=main, name=name, deadline=deadline)

    def update(self, step: int, loss: float, tokens_per_s: float, last: bool = False) -> None:
        """Step ``step`` is done with training loss ``loss``; ``last``: the run stops after it."""
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
        self._bar.update(1)
        now = self.clock()
        if not self.lines or not (last or step == self.first_step + 1 or now - self.last_line >= self.interval_s):
            return
        self.last_line = now
        logger.info(
            "%sstep %d/%d (%d%%), loss %.4f, %.0f tokens/s, ETA %s",
            self.prefix,
            step,
            self.max_steps,
            100 * step // self.max_steps,
            loss,
            tokens_per_s,
            clock_text(self.eta(step, now)),
        )

    def eta(self, step: int, now: float) -> float:
        """Seconds left at this run's pace (steps since it started), or until the deadline if that is sooner."""
        done = step - self.first_step
        left = (self.max_steps - step) * (now - self.start) / done if done > 0 else 0.0
        if self.deadline is not None:
            left = min(left, max(self.deadline - now, 0.0))
        return left

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._bar.close()
