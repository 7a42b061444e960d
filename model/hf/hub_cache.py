"""Models named by Hugging Face repo id (``ORG/NAME`` or ``ORG/NAME@REVISION``), found in the local Hugging Face
cache, offline: nothing is ever downloaded.

The cache is huggingface_hub's: ``<cache>/models--ORG--NAME/refs/<ref>`` (a file holding a commit hash) and
``<cache>/models--ORG--NAME/snapshots/<hash>/`` (the repo's files, usually links into ``../../blobs/``). The cache
directory is found as huggingface_hub finds it: ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else
``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from model.files import read_regular

DEFAULT_REVISION = "main"
MAX_REPO_ID = 96  # huggingface_hub's limit on ORG/NAME
MAX_REF_BYTES = 256  # a refs/ file holds one commit hash
# ORG and NAME: letters, digits, "_", "." and "-", neither starting nor ending with "." or "-" (huggingface_hub's
# validate_repo_id); a REVISION: a ref name (slashes allowed: refs/pr/1) or a commit hash.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_REPO = re.compile(rf"({_PART})/({_PART})(?:@([A-Za-z0-9_][A-Za-z0-9_./-]*))?")


class HubCacheError(LookupError):
    """A repo id (or its revision) is not in the local Hugging Face cache; the message names where it looked."""


@dataclass(frozen=True)
class RepoRef:
    """A model repo on the Hugging Face Hub at one revision."""

    repo_id: str  # ORG/NAME
    revision: str = DEFAULT_REVISION  # a ref under refs/ (main, a branch or tag) or a commit hash

    @property
    def name(self) -> str:
        """NAME, the part after the slash (what a model of this repo is served as by default)."""
        return self.repo_id.split("/", 1)[1]

    @property
    def folder(self) -> str:
        """The repo's directory in the cache: ``models--ORG--NAME``."""
        return "models--" + self.repo_id.replace("/", "--")

    def __str__(self) -> str:
        return self.repo_id if self.revision == DEFAULT_REVISION else f"{self.repo_id}@{self.revision}"


def parse_repo_ref(text: str) -> RepoRef | None:
    """``text`` (``ORG/NAME`` or ``ORG/NAME@REVISION``) as a RepoRef; None when it is not spelled as one."""
    match = _REPO.fullmatch(text)
    if match is None:
        return None
    org, name, revision = match.groups()
    repo_id = f"{org}/{name}"
    if len(repo_id) > MAX_REPO_ID or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return None
    if revision is not None and any(part in ("", ".", "..") for part in revision.split("/")):
        return None
    return RepoRef(repo_id, revision or DEFAULT_REVISION)


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache directory that ``environ`` (default: os.environ) names, as huggingface_hub
    finds it."""
    env = os.environ if environ is None else environ

    def expand(value: str) -> Path:
        return Path(os.path.expanduser(os.path.expandvars(value)))

    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(variable):
            return expand(env[variable])
    if env.get("HF_HOME"):
        return expand(env["HF_HOME"]) / "hub"
    cache_home = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return expand(cache_home) / "huggingface" / "hub"


def snapshot_directory(ref: RepoRef, cache: Path | None = None) -> Path:
    """The snapshot directory of ``ref`` in ``cache`` (default: :func:`hub_cache_dir`): ``snapshots/<hash>`` where
    ``refs/<revision>`` holds the hash, else ``snapshots/<revision>`` (a commit hash). HubCacheError, naming the
    directory it looked in, when the repo or the revision is not there."""
    cache = hub_cache_dir() if cache is None else cache
    repo = cache / ref.folder
    if not repo.is_dir():
        raise HubCacheError(f"{ref.repo_id} is not in the Hugging Face cache: no directory {repo} (nothing is "
                            f"downloaded: fetch it first, e.g. `hf download {ref.repo_id}`, or point HF_HUB_CACHE or "
                            "HF_HOME at the cache that holds it)")
    ref_file = repo / "refs" / PurePosixPath(ref.revision)
    commit = ref.revision
    if ref_file.is_file():
        commit = read_regular(ref_file, MAX_REF_BYTES).decode("ascii", "replace").strip()
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", commit):
            raise HubCacheError(f"{ref_file} does not hold a commit hash")
    snapshot = repo / "snapshots" / commit
    if "/" in commit or not snapshot.is_dir():
        cached = sorted(p.name for p in (repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
        raise HubCacheError(f"revision {ref.revision!r} of {ref.repo_id} is not in the Hugging Face cache: no "
                            f"{ref_file} nor {snapshot} (snapshots there: {', '.join(cached) or 'none'})")
    return snapshot
