"""What ``--models`` (``TSERVE_MODELS``) names: a directory of model directories, Hugging Face repo ids found in the
local Hugging Face cache (model/hf/hub_cache.py), or both.

The value is a comma-separated list. An entry that is an existing directory is the models directory (one
subdirectory per model, each served under its directory name; at most one such entry); an entry spelled
``[SERVED=]ORG/NAME[@REVISION]`` is that repo's snapshot in the cache, served as SERVED (default: NAME, since a
model's name is one URL path segment: ``/v1/models/NAME/generate``). An existing directory wins over a repo id of
the same spelling (write ``./ORG/NAME`` to mean a directory that is not there yet); a value that is one existing
directory is that directory, commas and all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from model.hf.hub_cache import HubCacheError, RepoRef, hub_cache_dir, parse_repo_ref, snapshot_directory
from model.lora_config import NAME_RULE, is_valid_name, quote


class ModelSourceError(ValueError):
    """``--models`` names something that cannot be served; the message says which entry and why."""


@dataclass(frozen=True)
class ModelSources:
    """The models directory (if any) and the models served from the Hugging Face cache, by served name."""

    directory: Path | None = None
    snapshots: dict[str, Path] = field(default_factory=dict)  # served name -> its snapshot directory in the cache


def model_sources(value: str | Path) -> ModelSources:
    """The sources ``value`` names (see the module's docstring); ModelSourceError for a repo id that is not in the
    cache, two models served under one name, or two directories."""
    if isinstance(value, Path) or Path(value).is_dir():
        return ModelSources(Path(value))
    directory: Path | None = None
    snapshots: dict[str, Path] = {}
    repos: dict[str, RepoRef] = {}  # served name -> the repo it came from
    cache = hub_cache_dir()
    for entry in (e.strip() for e in value.split(",")):
        served, equals, spelled = entry.partition("=")
        ref = None if Path(entry).is_dir() else parse_repo_ref(spelled if equals else entry)
        if ref is None:
            if directory is not None or not entry or (equals and not Path(entry).is_dir()):
                raise ModelSourceError(f"{quote(entry)} is neither a directory nor a repo id ([NAME=]ORG/NAME"
                                       "[@REVISION]); give at most one models directory")
            directory = Path(entry)  # a missing directory is the engine's error ("not found"), as always
            continue
        name = served if equals else ref.name
        if not is_valid_name(name):
            raise ModelSourceError(f"{ref}: the model name {quote(name)} is invalid ({NAME_RULE}): name it "
                                   f"with NAME={ref}")
        if name in repos:
            raise ModelSourceError(f"{repos[name]} and {ref} would both be served as {name!r}: name one with "
                                   f"NAME={ref}")
        try:
            snapshots[name] = snapshot_directory(ref, cache)
        except HubCacheError as exc:  # say both: a directory's path may be spelled like a repo id
            raise ModelSourceError(f"{quote(spelled if equals else entry)} is not a directory, and {exc}") from None
        repos[name] = ref
    return ModelSources(directory, snapshots)
