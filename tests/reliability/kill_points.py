"""``python -m tests.reliability.kill_points POINT[@N] MARKER -- <training CLI args>``: run the training
CLI, stopping dead the N-th time (default 1) it reaches POINT of a save: it writes MARKER, then sleeps, so
that a test can SIGKILL it there.

Points:

- ``checkpoint-swap``: model.checkpoint moved the previous best checkpoint aside, the new one is not in yet;
- ``checkpoint-cleanup``: the new checkpoint is in, the previous one not yet removed;
- ``state-files``: a resume-state step directory has its trainable weights but no optimizer state yet;
- ``state-pointer``: the step directory is renamed into place, LATEST still names the previous one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import training.state
from training.cli import main


def _stop_here(marker: Path) -> None:
    marker.write_text("reached\n")
    while True:
        time.sleep(60)


def install(point: str, marker: Path) -> None:
    point, _, nth = point.partition("@")
    remaining = [int(nth or 1)]
    real_replace, real_save, real_pointer = os.replace, training.state.save_file, training.state.write_bytes_atomic

    def reached(name: str) -> None:
        if name == point:
            remaining[0] -= 1
            if remaining[0] == 0:
                _stop_here(marker)

    def replace(src, dst, **kw) -> None:
        real_replace(src, dst, **kw)
        src, dst = Path(src), Path(dst)
        if dst.name == f".{src.name}.old":
            reached("checkpoint-swap")
        elif (dst.parent / f".{dst.name}.old").is_dir():
            reached("checkpoint-cleanup")

    def save_file(tensors, filename, *args, **kw) -> None:
        real_save(tensors, filename, *args, **kw)
        if Path(filename).name == training.state.TRAINABLE_FILE:
            reached("state-files")

    def write_bytes_atomic(path: Path, data: bytes) -> None:
        if path.name == training.state.LATEST and path.exists():
            reached("state-pointer")
        real_pointer(path, data)

    os.replace = replace
    training.state.save_file = save_file
    training.state.write_bytes_atomic = write_bytes_atomic


if __name__ == "__main__":
    point, marker, separator, *argv = sys.argv[1:]
    assert separator == "--", sys.argv
    install(point, Path(marker))
    sys.exit(main(argv))
