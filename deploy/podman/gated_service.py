"""``python -m gated_service GATE_DIR -- [python -m service flags]``: ``python -m service`` with a gate before each
model call, so that a test outside the container holds a request in flight at a known point.

tests/deploy/test_image.py mounts this directory read-only into the tserve image (which does not ship it) and
runs it instead of the image's CMD to check the SIGTERM drain: the signal handling is service.__main__.main's, as
in ``python -m service``. While ``GATE_DIR/hold`` exists, a model's worker parks before its next model call and
``GATE_DIR/parked-<model>`` exists; removing ``hold`` lets it go on. The protocol of
tests/reliability/gated_server.py, without that module's test dependencies (the image has no pytest).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from service.__main__ import main
from service.engine.scheduler import FaultHook, Scheduler, install_fault_hooks

HOLD = "hold"
POLL_S = 0.005  # how often a parked worker looks for the hold file's removal


def install(directory: Path) -> None:
    """Every Scheduler built from now on parks its worker while ``directory/hold`` exists."""
    hold = directory / HOLD

    def gate(scheduler: Scheduler) -> FaultHook:
        parked = directory / f"parked-{scheduler.name}"

        def park(ids: list[str]) -> None:
            if not hold.exists():
                return
            parked.write_text(" ".join(ids) + "\n")
            try:
                while hold.exists():
                    time.sleep(POLL_S)
            finally:
                parked.unlink(missing_ok=True)

        return park

    install_fault_hooks(gate)


if __name__ == "__main__":
    directory, separator, *argv = sys.argv[1:]
    assert separator == "--", sys.argv
    install(Path(directory))
    sys.exit(main(argv))
