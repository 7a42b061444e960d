"""The on-disk side of adapter uploads in ``<adapters>/<model>/``: upload directories, the swap, recovery.

An upload is written into a fresh hidden ``.upload-*`` directory beside its target, checked in full,
then put in place by one atomic rename: Linux's ``renameat2(RENAME_EXCHANGE)`` swaps it with the
adapter it replaces, whose files then sit under the ``.upload-*`` name until they are deleted. So a
process killed at any point leaves ``<name>`` complete, old or new, and hidden leftovers only.
Where the filesystem cannot exchange, the previous adapter is first moved aside to
``.<name>.old.upload-*`` (the name uploads used before), leaving a window in which ``<name>`` is missing.

:func:`recover`, at start-up, removes every ``.upload-*`` directory and puts a stranded
``.<name>.old.upload-*`` back where ``<name>`` is missing (or deletes it).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from model.files import make_shareable

UPLOAD_PREFIX = ".upload-"
_ASIDE = re.compile(r"\.(?P<name>.+)\.old\.upload-[^/]+")  # .<name>.old.upload-<random>
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)  # filesystem or kernel lacks it
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def new_upload_dir(parent: Path) -> Path:
    """A new empty ``.upload-*`` directory in ``parent`` (created if missing)."""
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=UPLOAD_PREFIX, dir=parent))


def write_files(files: dict[str, bytes], directory: Path) -> None:
    """Write ``files`` (new names) into ``directory``, each flushed to disk, readable by every user."""
    for name, content in files.items():
        with open(directory / name, "xb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    make_shareable(directory)


def exchange(a: Path, b: Path) -> None:
    """Swap two existing paths atomically; OSError (errno in _NO_EXCHANGE) where that is not supported."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def swap_in(new: Path, target: Path) -> Path | None:
    """Put directory ``new`` (beside ``target``) at ``target``; returns where the previous target now is."""
    old: Path | None = None
    if not os.path.lexists(target):
        os.rename(new, target)
    else:
        try:
            exchange(new, target)
            old = new
        except OSError as exc:
            if exc.errno not in _NO_EXCHANGE:
                raise
            old = target.with_name(f".{target.name}.old{new.name}")
            os.replace(target, old)
            os.replace(new, target)
    _sync_dir(target.parent)
    return old


def restore(target: Path, old: Path | None) -> None:
    """Undo :func:`swap_in`: ``old`` (or nothing) back at ``target``; the files swapped in are deleted."""
    if old is not None:
        try:
            exchange(old, target)
            shutil.rmtree(old)
            return
        except OSError as exc:
            if exc.errno not in _NO_EXCHANGE:
                raise
    trash = new_upload_dir(target.parent)
    os.replace(target, trash)  # onto the empty directory: one rename, then no adapter half-deleted under its name
    if old is not None:
        os.replace(old, target)
    shutil.rmtree(trash)


def recover(directory: Path) -> list[str]:
    """Clear what killed uploads left in ``directory`` (one model's adapters); returns what was done."""
    done = []
    for entry in sorted(directory.iterdir()):
        if not entry.is_dir() or entry.is_symlink():
            continue
        aside = _ASIDE.fullmatch(entry.name)
        if entry.name.startswith(UPLOAD_PREFIX):
            shutil.rmtree(entry)
            done.append(f"removed the unfinished upload {entry.name}")
        elif aside is not None and not os.path.lexists(entry.with_name(aside["name"])):
            os.replace(entry, entry.with_name(aside["name"]))
            done.append(f"restored {aside['name']} from {entry.name}")
        elif aside is not None:
            shutil.rmtree(entry)
            done.append(f"removed {entry.name}, a replaced copy of {aside['name']}")
    return done


def _sync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename in it) to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
