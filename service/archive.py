"""Safe extraction of an uploaded PEFT adapter archive (.tar.gz or .zip) into the adapter directory.

Only ``adapter_config.json`` and ``adapter_model.safetensors`` are taken, as regular files at the
archive's top level (a leading ``./`` and a ``./`` directory entry are tolerated). Anything else:
absolute paths, ``..``, links, devices, other files, duplicates, encrypted or oversize members,
rejects the whole archive. Files are written into a fresh temporary directory beside the target and
renamed into place, so a reader never sees a half-written adapter.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from model.lora_io import CONFIG_FILE, WEIGHTS_FILE
from service.http_errors import invalid

MEMBERS = (CONFIG_FILE, WEIGHTS_FILE)
GZIP_MAGIC = b"\x1f\x8b"
ZIP_MAGIC = b"PK\x03\x04"


def _reject(message: str) -> Exception:
    return invalid("body", f"adapter archive rejected: {message}")


def _member_name(raw: str) -> str | None:
    """The member's file name, None for the tolerated top directory entry; rejects anything unsafe."""
    if raw.startswith(("/", "\\")) or (len(raw) > 1 and raw[1] == ":"):
        raise _reject(f"absolute path {raw!r}")
    name = raw.removeprefix("./").rstrip("/")
    if name in ("", "."):
        return None
    if ".." in name.replace("\\", "/").split("/"):
        raise _reject(f"path {raw!r} leaves the archive")
    if name not in MEMBERS:
        raise _reject(f"unexpected member {raw!r}; only {' and '.join(MEMBERS)} at the top level are allowed")
    return name


def _tar_members(data: bytes, limit: int) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:
            name = _member_name(member.name)
            if name is None:
                if not member.isdir():
                    raise _reject(f"{member.name!r} is not a regular file")
                continue
            if not member.isfile() or member.issparse():
                raise _reject(f"{member.name!r} is not a regular file (links and devices are not allowed)")
            if member.size > limit:
                raise _reject(f"{member.name!r} is {member.size} bytes, over the limit of {limit}")
            handle = tar.extractfile(member)
            assert handle is not None  # regular file
            yield name, handle.read(limit + 1)


def _zip_members(data: bytes, limit: int) -> Iterator[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            name = _member_name(info.filename)
            if name is None:
                continue
            file_type = stat.S_IFMT(info.external_attr >> 16)  # 0: the creating tool recorded no Unix type
            if info.is_dir() or file_type not in (0, stat.S_IFREG):
                raise _reject(f"{info.filename!r} is not a regular file (links and devices are not allowed)")
            if info.flag_bits & 0x1:
                raise _reject(f"{info.filename!r} is encrypted")
            if info.file_size > limit:
                raise _reject(f"{info.filename!r} is {info.file_size} bytes, over the limit of {limit}")
            with archive.open(info) as handle:
                yield name, handle.read(limit + 1)


def read_adapter_archive(data: bytes, limit: int) -> dict[str, bytes]:
    """The two adapter files of a .tar.gz or .zip archive; their total size is at most ``limit``."""
    if data.startswith(GZIP_MAGIC):
        members = _tar_members
    elif data.startswith(ZIP_MAGIC):
        members = _zip_members
    else:
        raise _reject("the body is neither a gzip-compressed tar nor a zip archive")
    files: dict[str, bytes] = {}
    total = 0
    try:
        for name, content in members(data, limit):
            if name in files:
                raise _reject(f"{name} appears twice")
            total += len(content)
            if total > limit:
                raise _reject(f"its files add up to more than the limit of {limit} bytes")
            files[name] = content
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, RuntimeError, ValueError) as exc:
        raise _reject(f"cannot be read: {exc}") from None
    missing = [m for m in MEMBERS if m not in files]
    if missing:
        raise _reject(f"missing {', '.join(missing)}")
    return files


def write_temp_dir(files: dict[str, bytes], parent: Path) -> Path:
    """Write ``files`` into a new hidden directory under ``parent`` (same filesystem as the target)."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".upload-", dir=parent))
    try:
        for name, content in files.items():
            with open(tmp / name, "xb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def swap_in(tmp: Path, target: Path) -> Path | None:
    """Rename ``tmp`` to ``target``; an existing target is moved aside and its new name returned."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old{tmp.name}")  # tmp's name is unique
        os.replace(target, old)
    os.replace(tmp, target)
    return old


def restore(target: Path, old: Path | None) -> None:
    """Undo :func:`swap_in` (the new adapter failed to load)."""
    shutil.rmtree(target, ignore_errors=True)
    if old is not None:
        os.replace(old, target)
