"""``python -m tests.reliability.gated_server DIR -- <python -m service args>``: run the server with a fault hook
that parks a model's worker thread before each model call while ``DIR/hold`` exists, so that a test in another
process holds the work at a known point (the way kill_points.py stops training mid-save).

While a worker is parked, ``DIR/parked-<model>`` exists; it goes when the worker moves on. A parked worker also
moves on once the engine stops its scheduler (at the drain deadline of a shutdown), and then only into the stop.
Every model call appends its job ids, one line per call, to ``DIR/calls-<model>`` (the order of the work).
The test side is :class:`ServerGate`.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from service.__main__ import main
from service.engine.scheduler import FaultHook, Scheduler, install_fault_hooks
from tests.helpers import on_stop

HOLD = "hold"
POLL_S = 0.005  # how often a parked worker looks for the hold file's removal


@dataclass(frozen=True)
class ServerGate:
    """The test's side: ``hold()`` before requests, ``parked(model)`` once one is held, ``release()``."""

    directory: Path

    def args(self) -> list[str]:
        """What ``running_server(module_args=...)`` runs instead of ``-m service``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return ["-m", __name__, str(self.directory), "--"]

    def hold(self) -> None:
        (self.directory / HOLD).touch()

    def release(self) -> None:
        (self.directory / HOLD).unlink(missing_ok=True)

    def parked(self, model: str) -> bool:
        return (self.directory / f"parked-{model}").exists()

    def calls(self, model: str) -> list[list[str]]:
        """The job ids of each model call of ``model`` so far, in order."""
        path = self.directory / f"calls-{model}"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def install(directory: Path) -> None:
    """Every Scheduler built from now on parks its worker while ``directory/hold`` exists and logs its calls."""
    hold = directory / HOLD

    def gate(scheduler: Scheduler) -> FaultHook:
        parked, stopping = directory / f"parked-{scheduler.name}", threading.Event()
        calls = directory / f"calls-{scheduler.name}"

        def park(ids: list[str]) -> None:
            with calls.open("a") as log:
                log.write(" ".join(ids) + "\n")
            if not hold.exists() or stopping.is_set():
                return
            parked.write_text(" ".join(ids) + "\n")
            try:
                while hold.exists() and not stopping.wait(POLL_S):
                    pass
            finally:
                parked.unlink(missing_ok=True)

        on_stop(scheduler, stopping.set)
        return park

    install_fault_hooks(gate)


if __name__ == "__main__":
    directory, separator, *argv = sys.argv[1:]
    assert separator == "--", sys.argv
    install(Path(directory))
    sys.exit(main(argv))
