"""``python -m tests.reliability.upload_kill_points POINT MARKER -- <python -m service args>``: run the server,
stopping dead the first time an adapter upload reaches POINT: it writes MARKER, then sleeps, so that a test
can SIGKILL it there (the way tests/reliability/kill_points.py stops training mid-save).

Points (service.engine.adapter_store):

- ``parsed``: the upload's files are written to their ``.upload-*`` directory and checked; nothing swapped;
- ``exchanged``: the upload is swapped in; the adapter it replaced sits in the ``.upload-*`` directory;
- ``aside``: a filesystem without RENAME_EXCHANGE (forced): the previous adapter is moved to
  ``.<name>.old.upload-*``, the new one not renamed in yet.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from service.__main__ import main
from service.engine import adapter_store


def _stop_here(marker: Path) -> None:
    marker.write_text("reached\n")
    while True:
        time.sleep(60)


def install(point: str, marker: Path) -> None:
    real_swap_in, real_exchange, real_replace = adapter_store.swap_in, adapter_store.exchange, os.replace

    def swap_in(new: Path, target: Path) -> Path | None:
        if point == "parsed":
            _stop_here(marker)
        return real_swap_in(new, target)

    def exchange(a: Path, b: Path) -> None:
        if point == "aside":
            raise OSError(errno.EINVAL, "RENAME_EXCHANGE is not supported here (forced)")
        real_exchange(a, b)
        if point == "exchanged":
            _stop_here(marker)

    def replace(src, dst, **kw) -> None:
        real_replace(src, dst, **kw)
        if point == "aside" and ".old.upload-" in Path(dst).name:
            _stop_here(marker)

    adapter_store.swap_in = swap_in
    adapter_store.exchange = exchange
    os.replace = replace


if __name__ == "__main__":
    point, marker, separator, *argv = sys.argv[1:]
    assert separator == "--", sys.argv
    install(point, Path(marker))
    sys.exit(main(argv))
