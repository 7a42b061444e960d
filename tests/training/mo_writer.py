"""Write GNU gettext `.mo` catalogs from a dict, so tests can build their own locale trees."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

MO_MAGIC = 0x950412DE
HEADER = "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n"

# A key is a msgid ("ctx\x04msgid" for a context) or a (singular, plural) tuple for plural entries,
# whose value is then the list of translated forms.
Messages = Mapping[str | tuple[str, str], str | Sequence[str]]


def mo_bytes(messages: Messages, header: str | None = HEADER) -> bytes:
    """Encode `messages` (plus the header as the empty msgid, unless None) as a little-endian .mo."""
    entries: dict[bytes, bytes] = {}
    if header is not None:
        entries[b""] = header.encode()
    for key, value in messages.items():
        if isinstance(key, tuple):
            msgid = "\x00".join(key).encode()
            msgstr = "\x00".join(value).encode()
        else:
            msgid, msgstr = key.encode(), str(value).encode()
        entries[msgid] = msgstr
    keys = sorted(entries)  # msgfmt sorts by msgid bytes; readers may binary-search
    n = len(keys)
    orig_table, trans_table = 28, 28 + 8 * n
    data_start = 28 + 16 * n
    data = bytearray()
    orig, trans = [], []
    for strings, table in ((keys, orig), ([entries[k] for k in keys], trans)):
        for s in strings:
            table.append((len(s), data_start + len(data)))
            data += s + b"\x00"
    head = struct.pack("<7I", MO_MAGIC, 0, n, orig_table, trans_table, 0, 0)
    tables = b"".join(struct.pack("<2I", *entry) for entry in orig + trans)
    return head + tables + bytes(data)


def write_mo(path: Path, messages: Messages, header: str | None = HEADER) -> Path:
    """Write a .mo catalog to `path` (parents created) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(mo_bytes(messages, header))
    return path


def write_locale_tree(root: Path, catalogs: Mapping[str, Mapping[str, Messages]]) -> Path:
    """Write `{lang: {package: messages}}` as `root/<lang>/LC_MESSAGES/<package>.mo`; return `root`."""
    for lang, packages in catalogs.items():
        for package, messages in packages.items():
            write_mo(root / lang / "LC_MESSAGES" / f"{package}.mo", messages)
    return root
