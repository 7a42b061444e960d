"""Permissions of what the project writes for others to read: checkpoints and adapters are built in a private
temporary directory (``tempfile.mkdtemp``: mode 0700; safetensors writes 0600 files) and then renamed into
place, where a server running as another user (the container image's uid 10001) must read them."""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE, FILE_MODE = 0o755, 0o644


def make_shareable(directory: Path) -> None:
    """``directory`` and everything under it readable by every user (directories 0755, files 0644)."""
    os.chmod(directory, DIR_MODE)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), DIR_MODE)
        for name in files:
            os.chmod(os.path.join(root, name), FILE_MODE)
