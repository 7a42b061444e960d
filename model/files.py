"""Files the project reads and writes: every read of an operator's file goes through :func:`read_regular` (a
FIFO, device or socket never blocks a load, and a file's size is bounded before a byte is read); and the
permissions of what the project writes for others to read: checkpoints and adapters are built in a private
temporary directory (``tempfile.mkdtemp``: mode 0700; safetensors writes 0600 files) and then renamed into
place, where a server running as another user (the container image's uid 10001) must read them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE, FILE_MODE = 0o755, 0o644
# O_NONBLOCK: opening a FIFO for reading waits for a writer, forever; non-blocking it returns at once (then
# fstat refuses it). O_NOCTTY: a terminal named as a file never becomes the controlling one.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
_KINDS = {stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
          stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a directory"}


class UnreadableFile(OSError):
    """A file that is not a regular file, or is over its size limit (``str(exc)`` says which)."""


def read_regular(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (a symlink is followed), at most ``limit`` of them.

    Raises UnreadableFile for anything but a regular file, or one whose size (fstat, before reading) is over
    ``limit``; OSError (FileNotFoundError, ...) when it cannot be opened. A file that grows while it is read is
    still cut at ``limit`` + 1 bytes and refused."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _KINDS.items() if test(info.st_mode)), "not a regular file")
            raise UnreadableFile(f"{kind}, not a regular file")
        if info.st_size > limit:
            raise UnreadableFile(f"{info.st_size} bytes, over the limit of {limit}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise UnreadableFile(f"over the limit of {limit} bytes (it grew while read)")
    return b"".join(chunks)


def make_shareable(directory: Path) -> None:
    """``directory`` and everything under it readable by every user (directories 0755, files 0644)."""
    os.chmod(directory, DIR_MODE)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), DIR_MODE)
        for name in files:
            os.chmod(os.path.join(root, name), FILE_MODE)
