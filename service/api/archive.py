"""Parsing of an uploaded PEFT adapter archive (.tar.gz or .zip) into its two files.

Only ``adapter_config.json`` and ``adapter_model.safetensors`` are taken, as regular files at the
archive's top level (a leading ``./`` and a ``./`` directory entry are tolerated). Anything else:
absolute paths, ``..``, links, devices, other files, duplicates, encrypted or oversize members,
rejects the whole archive.

The archive is untrusted, so every size is bounded before what it sizes is read: the number of
members and of tar extension headers, each extension header, each member's and all members' declared
sizes, a zip's central directory; decompression reads only as far as those sizes allow. Tar is read
here rather than by :mod:`tarfile`, whose pax parsing is quadratic before Python 3.11.10
(CVE-2024-6232: a 369-byte upload held every thread for 47 s) and which reads a GNU long name of
any declared size into memory; pax records are read only to refuse those that would change what
the ustar header says a member is. The server still parses in a child process with time and
memory limits (service.api.archive_sandbox). Only the standard library is imported here (the child
starts fast).
"""

from __future__ import annotations

import gzip
import io
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from model.lora_config import CONFIG_FILE, WEIGHTS_FILE, quote

MEMBERS = (CONFIG_FILE, WEIGHTS_FILE)
GZIP_MAGIC = b"\x1f\x8b"
ZIP_MAGIC = b"PK\x03\x04"

MAX_MEMBERS = len(MEMBERS) + 1  # the two files and a "./" directory entry
# pax extension headers: one per member and a global one. Their records describe a member whose name is
# short: times, ids, a few extended attributes (Python's tarfile writes 30 bytes, GNU tar --format=posix 90).
MAX_EXTENDED_HEADERS = MAX_MEMBERS + 1
MAX_EXTENDED_HEADER_BYTES = 4096
# zip: zipfile reads the whole central directory before any member; MAX_MEMBERS entries of short names
# and usual extra fields (timestamps, Unix ids, zip64 sizes) take ~400 bytes.
MAX_CENTRAL_DIRECTORY_BYTES = 4096

BLOCK = 512  # tar header and data block
FILE_TYPES = (b"0", b"\0", b"7")  # regular, old regular, contiguous
DIR_TYPE = b"5"
PAX_TYPES = (b"x", b"g")  # per-member and global pax extension headers
GNU_LONG_TYPES = (b"L", b"K")  # GNU long name and long link name
PAX_IDENTITY = (b"path", b"linkpath", b"size")  # records that would override the ustar header
ZIP_END = b"PK\x05\x06"  # end of central directory record (22 bytes + comment)
ZIP_END_BYTES = 22
ZIP64_LOCATOR = b"PK\x06\x07"  # 20 bytes right before ZIP_END in a zip64 archive


class ArchiveError(Exception):
    """The archive is refused; the message says why (user-supplied names quoted short)."""


@dataclass(frozen=True)
class _Member:
    name: str  # as the archive spells it
    is_dir: bool
    is_file: bool
    size: int  # declared
    read: Callable[[], bytes]  # its content; only for a regular file, before the next member


def _member_name(raw: str) -> str | None:
    """The member's file name, None for the tolerated top directory entry; rejects anything unsafe."""
    if raw.startswith(("/", "\\")) or (len(raw) > 1 and raw[1] == ":"):
        raise ArchiveError(f"absolute path {quote(raw)}")
    name = raw.removeprefix("./").rstrip("/")
    if name in ("", "."):
        return None
    if ".." in name.replace("\\", "/").split("/"):
        raise ArchiveError(f"path {quote(raw)} leaves the archive")
    if name not in MEMBERS:
        raise ArchiveError(f"unexpected member {quote(raw)}; only {' and '.join(MEMBERS)} at the top level are allowed")
    return name


# ---- tar ------------------------------------------------------------------------------------------


def _read_exact(stream: gzip.GzipFile, size: int, padded: bool) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ArchiveError("the tar stream ends inside a member")
    if padded:
        stream.read(-size % BLOCK)
    return data


def _octal(field: bytes) -> int:
    if field[0] & 0x80:  # GNU base-256: a size of 8 GiB or more, or negative
        raise ArchiveError("a tar header declares a size of 8 GiB or more")
    text = field.split(b"\0", 1)[0].strip()
    if text and not all(48 <= c <= 55 for c in text):
        raise ArchiveError("invalid tar header (a number field is not octal)")
    return int(text or b"0", 8)


def _check_header(header: bytes) -> None:
    """The header checksum, computed as tarfile does (unsigned or signed bytes, the field as spaces)."""
    rest = header[:148] + b" " * 8 + header[156:]
    unsigned = sum(rest)
    signed = sum(struct.unpack(f"{BLOCK}b", rest))
    if _octal(header[148:156]) not in (unsigned, signed):
        raise ArchiveError("not a tar archive (invalid header checksum)")


def _check_pax(records: bytes) -> None:
    """Refuse malformed pax records and those that would change a member's path, link or size."""
    records = records.rstrip(b"\0")
    pos = 0
    while pos < len(records):
        digits, space, _ = records[pos : pos + 20].partition(b" ")
        length = int(digits) if space and digits.isdigit() else 0
        record = records[pos : pos + length]
        keyword, equals, _ = record[len(digits) + 1 :].partition(b"=")
        if length <= len(digits) + 1 or len(record) != length or not record.endswith(b"\n") or not equals:
            raise ArchiveError("malformed pax header")
        if keyword in PAX_IDENTITY or keyword.startswith(b"GNU.sparse."):
            raise ArchiveError(f"a pax header sets {quote(keyword.decode('ascii', 'replace'))}: member names, "
                               "links and sizes must be those of the ustar header")
        pos += length


def _tar_name(header: bytes) -> str:
    """name, prefixed by the ustar prefix field where set (as tarfile reads it)."""
    name = header[:100].split(b"\0", 1)[0]
    prefix = header[345:500].split(b"\0", 1)[0]
    return (prefix + b"/" + name if prefix else name).decode("utf-8", "surrogateescape")


def _tar_members(data: bytes) -> Iterator[_Member]:
    stream = gzip.GzipFile(fileobj=io.BytesIO(data))
    extended = 0
    while True:
        header = stream.read(BLOCK)
        if not header.strip(b"\0"):  # end-of-archive block, or the stream ends at a header boundary
            return
        if len(header) < BLOCK:
            raise ArchiveError("the tar stream ends inside a header")
        _check_header(header)
        kind, size = header[156:157], _octal(header[124:136])
        if kind in GNU_LONG_TYPES:
            raise ArchiveError("GNU long-name headers are not allowed (member names are at most 100 bytes)")
        if kind in PAX_TYPES:
            extended += 1
            if extended > MAX_EXTENDED_HEADERS:
                raise ArchiveError(f"more than {MAX_EXTENDED_HEADERS} pax headers")
            if size > MAX_EXTENDED_HEADER_BYTES:
                raise ArchiveError(f"a pax header of {size} bytes, over the limit of {MAX_EXTENDED_HEADER_BYTES}")
            _check_pax(_read_exact(stream, size, padded=True))
            continue
        name = _tar_name(header)
        is_dir = kind == DIR_TYPE or (kind == b"\0" and name.endswith("/"))
        if is_dir and size:
            raise ArchiveError(f"directory entry {quote(name)} declares {size} bytes of content")
        is_file = not is_dir and kind in FILE_TYPES
        yield _Member(name, is_dir, is_file, size, partial(_read_exact, stream, size, padded=True))


# ---- zip ------------------------------------------------------------------------------------------


def _check_zip_directory(data: bytes) -> None:
    """Bound the central directory that zipfile reads in full, finding its record as zipfile does."""
    end = len(data) - ZIP_END_BYTES
    if not (end >= 0 and data[end : end + 4] == ZIP_END and data[-2:] == b"\0\0"):
        end = data.rfind(ZIP_END, max(0, len(data) - ZIP_END_BYTES - 0xFFFF))
    if end < 0 or len(data) - end < ZIP_END_BYTES:
        raise ArchiveError("not a zip archive (no end of central directory record)")
    if end >= 20 and data[end - 20 : end - 16] == ZIP64_LOCATOR:
        raise ArchiveError("zip64 archives are not accepted (adapters are far smaller than 4 GiB)")
    entries, size = struct.unpack("<HI", data[end + 10 : end + 16])
    if entries > MAX_MEMBERS or size > MAX_CENTRAL_DIRECTORY_BYTES:
        raise ArchiveError(f"its central directory lists {entries} members in {size} bytes, over the limits of "
                           f"{MAX_MEMBERS} members and {MAX_CENTRAL_DIRECTORY_BYTES} bytes")


def _read_zip(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    with archive.open(info) as handle:
        return handle.read(info.file_size)


def _zip_members(data: bytes) -> Iterator[_Member]:
    _check_zip_directory(data)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            if info.flag_bits & 0x1:
                raise ArchiveError(f"{quote(info.filename)} is encrypted")
            file_type = stat.S_IFMT(info.external_attr >> 16)  # 0: the creating tool recorded no Unix type
            is_file = not info.is_dir() and file_type in (0, stat.S_IFREG)
            yield _Member(info.filename, info.is_dir(), is_file, info.file_size, partial(_read_zip, archive, info))


# ---- both -----------------------------------------------------------------------------------------


def _take(members: Iterator[_Member], limit: int) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    total = 0
    for count, member in enumerate(members, 1):
        if count > MAX_MEMBERS:
            raise ArchiveError(f"more than {MAX_MEMBERS} members")
        name = _member_name(member.name)
        if name is None and member.is_dir:
            continue
        if name is None or not member.is_file:
            raise ArchiveError(f"{quote(member.name)} is not a regular file (links and devices are not allowed)")
        if name in files:
            raise ArchiveError(f"{name} appears twice")
        if member.size > limit:
            raise ArchiveError(f"{name} is {member.size} bytes, over the limit of {limit}")
        total += member.size
        if total > limit:
            raise ArchiveError(f"its files add up to more than the limit of {limit} bytes")
        files[name] = member.read()
    return files


def read_adapter_archive(data: bytes, limit: int) -> dict[str, bytes]:
    """The two adapter files of a .tar.gz or .zip archive; their declared sizes add up to at most ``limit``."""
    if data.startswith(GZIP_MAGIC):
        members = _tar_members(data)
    elif data.startswith(ZIP_MAGIC):
        members = _zip_members(data)
    else:
        raise ArchiveError("the body is neither a gzip-compressed tar nor a zip archive")
    try:
        files = _take(members, limit)
    except ArchiveError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, ValueError, NotImplementedError,
            struct.error) as exc:
        raise ArchiveError(f"cannot be read: {exc}") from None
    missing = [m for m in MEMBERS if m not in files]
    if missing:
        raise ArchiveError(f"missing {', '.join(missing)}")
    return files
