"""LoRA adapters of one model: what is known on disk, what is resident, who uses which version.

Like vLLM's LRU adapter manager, with hot swapping:

- A public name maps to its *current version*, loaded into the model under a unique internal name
  (``<name>.<n>``). A request pins the version it starts with (``in_flight``); replacing or unloading
  the name retires that version, and a retired version leaves the model only once it is idle. So a
  request never sees its adapter change or vanish mid-generation.
- At most ``max_resident`` current versions are in memory. Loading another evicts the least recently
  used *idle* one (it stays known and is reloaded from disk on its next use); when every resident
  adapter is in use, the load is refused with ``QueueFull`` (retry later) rather than evicting a busy one.
- Adapters are only read from inside the configured adapters directory (paths resolved, symlinks
  leading outside refused). What the API sees (``AdapterInfo.path``, error messages) names paths
  relative to it.
- At start-up (``discover``) what killed uploads left is cleared first (service.engine.adapter_store), and a
  directory whose files are unusable is skipped alone, logged.

Threads: ``acquire``/``release``/``infos`` may run on any thread (one lock guards the bookkeeping);
everything that touches the model (``check``, ``ensure_resident``, ``load``, ``unload``, ``collect``)
runs on the model's worker thread, between steps.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from model import lora, lora_io
from model.lora_config import NAME_RULE, is_valid_name, quote
from service.engine import adapter_store
from service.engine.errors import InvalidRequest, NotFound, QueueFull
from service.engine.metrics import Metrics
from service.engine.types import AdapterInfo

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0


@dataclass
class AdapterVersion:
    """One load of an adapter's files into the model."""

    public: str
    internal: str  # the name inside the model; unique per load
    path: Path
    loaded_at: float | None = None  # unix time; None until resident
    in_flight: int = 0  # jobs pinning this version
    retired: bool = False  # replaced, unloaded or evicted: removed from the model once idle


@dataclass
class _Entry:
    name: str
    path: Path
    config: lora.LoRAConfig
    current: AdapterVersion | None = None  # None: known on disk, loaded on first use
    last_used: float | None = None


def check_name(name: object) -> str:
    if not is_valid_name(name):
        raise InvalidRequest(None, f"adapter name {quote(name)} is invalid: use {NAME_RULE}")
    return name


class AdapterRegistry:
    """Adapters of one model; see the module docstring for the rules."""

    def __init__(self, model: nn.Module, model_name: str, root: Path | None, max_resident: int,
                 metrics: Metrics, layout: lora_io.AdapterLayout | None = None) -> None:
        self.model = model
        self.layout = layout  # an imported HF model's: PEFT adapters trained on it name its modules otherwise
        self.model_name = model_name
        self.root = root.resolve() if root is not None else None
        self.max_resident = max_resident
        self.metrics = metrics
        self._entries: dict[str, _Entry] = {}
        self._retired: list[AdapterVersion] = []  # replaced/unloaded versions still in the model
        self._lock = threading.Lock()
        self._serial = 0
        self.changes = 0  # bumped whenever the model's adapters change (the scheduler re-selects rows then)

    @property
    def base(self) -> Path | None:
        """``<root>/<model>/``: where this model's adapters live (one directory each), if adapters are on disk."""
        return self.root / self.model_name if self.root is not None else None

    # ---- any thread -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def infos(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(e) for _, e in sorted(self._entries.items())]

    def info(self, name: str) -> AdapterInfo:
        with self._lock:
            return self._info(self._entry(name))

    def acquire(self, name: str) -> AdapterVersion:
        """Pin the current version of ``name`` for one job (made resident at admission if it is not)."""
        with self._lock:
            entry = self._entry(name)
            if entry.current is None:
                entry.current = self._new_version(entry.name, entry.path)
            entry.current.in_flight += 1
            entry.last_used = time.time()
            return entry.current

    def release(self, version: AdapterVersion) -> None:
        """Unpin; a retired version left idle is removed from the model by the next ``collect``."""
        with self._lock:
            version.in_flight -= 1

    def check_directory(self, directory: Path) -> Path:
        """``directory`` resolved, if it and its files lie inside the adapters directory."""
        if self.root is None:
            raise InvalidRequest("directory", "adapter loading is disabled (no adapters directory is configured)")
        shown = self._shown(directory)
        try:
            resolved = Path(directory).resolve()
            if not resolved.is_relative_to(self.root):
                raise InvalidRequest(None, f"adapter directory {shown} is outside the adapters directory")
            if not resolved.is_dir():
                raise InvalidRequest(None, f"adapter directory {shown} is not a directory")
            for name in (lora_io.CONFIG_FILE, lora_io.WEIGHTS_FILE):
                if (resolved / name).exists() and not (resolved / name).resolve().is_relative_to(self.root):
                    raise InvalidRequest(None, f"{shown}/{name} links outside the adapters directory")
        except (OSError, RuntimeError) as exc:  # a symlink loop, a permission
            raise InvalidRequest(None, f"adapter directory {shown}: {exc.strerror or exc}") from None
        return resolved

    def check(self, name: str, directory: Path) -> lora.LoRAConfig:
        """Everything ``load`` checks of ``directory`` (config, tensors against the model), the model unchanged."""
        path = self.check_directory(directory)
        try:
            return lora_io.check_adapter(self.model, path, name, self.layout)
        except lora.AdapterError as exc:
            raise InvalidRequest(None, self._public(str(exc))) from None

    def discover(self) -> list[str]:
        """Register ``<root>/<model>/<adapter>/`` directories (not loaded); returns their names, sorted."""
        base = self.base
        if base is None or not base.is_dir():
            return []
        try:
            for done in adapter_store.recover(base):
                logger.warning("model %r: adapters directory %s: %s", self.model_name, base, done)
        except OSError as exc:
            logger.error("model %r: cannot clear interrupted uploads in %s: %s", self.model_name, base, exc)
        found = []
        for directory in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
            try:
                check_name(directory.name)
                path = self.check_directory(directory)
                config = self._config(directory.name, path)
            except InvalidRequest as exc:
                logger.warning("model %r: skipping adapter directory %s: %s", self.model_name, directory, exc)
                continue
            with self._lock:
                self._entries.setdefault(directory.name, _Entry(directory.name, path, config))
            found.append(directory.name)
        return found

    # ---- worker thread (touches the model) -------------------------------------------------------

    def ensure_resident(self, version: AdapterVersion) -> None:
        """Load a pinned version into the model if it is not there yet (evicting an idle one if full)."""
        with self._lock:
            if version.loaded_at is not None:
                return
            victims = self._make_room(exclude=version.public)
        self._remove(victims, evicted=True)
        try:
            config = lora_io.load_adapter(self.model, version.path, version.internal, layout=self.layout)
        except lora.AdapterError as exc:
            with self._lock:
                entry = self._entries.get(version.public)
                if entry is not None and entry.current is version:
                    entry.current = None
            raise InvalidRequest(None, self._public(str(exc))) from None
        with self._lock:
            version.loaded_at = time.time()
            entry = self._entries.get(version.public)
            if entry is not None and entry.current is version:
                entry.config = config
            if version.retired:  # replaced or unloaded while its job waited: removed once idle
                self._retired.append(version)
        self.metrics.adapter_loads.labels(self.model_name).inc()
        self._update_gauge()

    def preload(self, name: str) -> None:
        """Make ``name`` resident now (start-up); an adapter that does not fit the model is forgotten."""
        version = self.acquire(name)
        try:
            self.ensure_resident(version)
        except InvalidRequest:
            with self._lock:
                self._entries.pop(name, None)
            raise
        finally:
            self.release(version)

    def load(self, name: str, directory: Path) -> AdapterInfo:
        """Load ``directory`` as ``name``; an existing version of ``name`` is retired (removed once idle)."""
        path = self.check_directory(directory)
        config = self._config(name, path)
        with self._lock:
            version = self._new_version(name, path)
            victims = self._make_room(exclude=name)
        self._remove(victims, evicted=True)
        try:
            lora_io.load_adapter(self.model, path, version.internal, layout=self.layout)
        except lora.AdapterError as exc:
            raise InvalidRequest(None, self._public(str(exc))) from None
        with self._lock:
            version.loaded_at = time.time()
            entry = self._entries.get(name)
            if entry is None:
                entry = self._entries[name] = _Entry(name, path, config)
            elif entry.current is not None:
                self._retire(entry.current)
            entry.path, entry.config, entry.current = path, config, version
            info = self._info(entry)
        self.metrics.adapter_loads.labels(self.model_name).inc()
        self._update_gauge()
        self.collect()
        logger.info("model %r: loaded adapter %r from %s (as %s)", self.model_name, name, path, version.internal)
        return info

    def unload(self, name: str) -> None:
        """Forget ``name``; its resident version leaves the model once its in-flight jobs finish."""
        with self._lock:
            entry = self._entry(name)
            del self._entries[name]
            if entry.current is not None:
                self._retire(entry.current)
        self.metrics.adapter_unloads.labels(self.model_name).inc()
        self.collect()
        logger.info("model %r: unloaded adapter %r", self.model_name, name)

    def collect(self) -> None:
        """Remove retired versions that no job uses any more from the model."""
        with self._lock:
            idle = [v for v in self._retired if v.in_flight == 0]
            if not idle:
                return
            self._retired = [v for v in self._retired if v.in_flight > 0]
        self._remove(idle, evicted=False)

    # ---- helpers (the caller holds the lock where noted) -----------------------------------------

    def _config(self, name: str, directory: Path) -> lora.LoRAConfig:
        try:
            return lora_io.read_config(directory, name, self.layout)
        except lora.AdapterError as exc:
            raise InvalidRequest(None, self._public(str(exc))) from None

    def _shown(self, path: Path) -> str:
        """``path`` relative to the adapters directory, or its last component when it lies outside."""
        absolute = Path(os.path.abspath(path))
        assert self.root is not None
        return str(absolute.relative_to(self.root)) if absolute.is_relative_to(self.root) else absolute.name

    def _public(self, message: str) -> str:
        """``message`` with the adapters directory's paths made relative to it."""
        return message.replace(f"{self.root}{os.sep}", "") if self.root is not None else message

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise NotFound(f"adapter {quote(name)} not found for model {self.model_name!r}; "
                           f"available: {sorted(self._entries)}")
        return entry

    def _new_version(self, name: str, path: Path) -> AdapterVersion:  # lock held
        self._serial += 1
        return AdapterVersion(name, f"{name[:40]}.{self._serial}", path)

    def _resident(self) -> list[_Entry]:  # lock held
        return [e for e in self._entries.values() if e.current is not None and e.current.loaded_at is not None]

    def _make_room(self, exclude: str) -> list[AdapterVersion]:  # lock held
        """Detach least-recently-used idle versions until one more fits; returns them for removal."""
        resident = [e for e in self._resident() if e.name != exclude]
        victims = []
        while len(resident) >= self.max_resident:
            idle = [e for e in resident if e.current.in_flight == 0]
            if not idle:
                raise QueueFull(f"model {self.model_name!r}: all {self.max_resident} resident adapters "
                                f"(max_resident_adapters) are in use; retry later", retry_after=RETRY_AFTER_S)
            lru = min(idle, key=lambda e: e.last_used or 0.0)
            victims.append(lru.current)
            lru.current = None
            resident.remove(lru)
        return victims

    def _retire(self, version: AdapterVersion) -> None:  # lock held
        version.retired = True
        if version.loaded_at is not None:
            self._retired.append(version)

    def _remove(self, versions: list[AdapterVersion], evicted: bool) -> None:
        if versions:
            lora.clear_adapters(self.model)  # between steps: the next model call selects its rows' adapters again
        for version in versions:
            version.retired = True
            if version.loaded_at is not None:
                lora.delete_adapter(self.model, version.internal)
                version.loaded_at = None
            if evicted:
                self.metrics.adapter_evictions.labels(self.model_name).inc()
                logger.info("model %r: evicted idle adapter %r", self.model_name, version.public)
        if versions:
            self._update_gauge()

    def _update_gauge(self) -> None:
        self.changes += 1
        self.metrics.resident_adapters.labels(self.model_name).set(len(lora.adapter_names(self.model)))

    def _info(self, entry: _Entry) -> AdapterInfo:  # lock held
        current = entry.current
        resident = current is not None and current.loaded_at is not None
        in_flight = (current.in_flight if current is not None else 0)
        in_flight += sum(v.in_flight for v in self._retired if v.public == entry.name)
        return AdapterInfo(
            name=entry.name,
            rank=entry.config.r,
            alpha=entry.config.lora_alpha,
            target_modules=list(entry.config.target_modules),
            path=self._shown(entry.path),
            loaded_at=current.loaded_at if resident else None,
            last_used=entry.last_used,
            in_flight=in_flight,
            resident=resident,
        )
