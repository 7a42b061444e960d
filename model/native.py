"""Our C++ CPU kernels (model/kernels/*.cpp): built once, then imported; every caller has a PyTorch fallback.

The kernels are one PyTorch C++ extension compiled on first use (under a minute; ``torch.utils.cpp_extension``
with the system's C++ compiler and ninja) into ``TSERVE_KERNEL_DIR`` (default ``~/.cache/tserve/kernels``),
under a name carrying the sources' hash and the Python/torch versions: later processes import the built
module directly (no compiler needed then, as in the Docker image, which builds it at image build time),
and edited sources build afresh. Only x86-64 Linux; each kernel also checks the CPU features it needs
(``has_int8_kernel``, ``has_avx512``, ``has_avx2``), and :func:`load` returns None, with the reason, where it cannot
run.
The rule that depends on the CPU's make and caches (model/cpu.py) is set at every load, not compiled in: an image
built on one CPU runs with the rule of the CPU it runs on.

How they are used is one :class:`KernelOptions`, read once per process from the environment (``TSERVE_*``,
listed in the service's settings table); :func:`kernels` is the module every decoding-step caller asks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from model.cpu import PanelTuning, kernel_tuning, this_cpu

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "kernels"
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))
HEADERS = sorted(SOURCE_DIR.glob("*.h"))
DEFAULT_KERNEL_DIR = Path.home() / ".cache" / "tserve" / "kernels"
INT8_KERNELS = ("auto", "kernel", "fbgemm")  # model.int8_kernel's choices


def _switch(value: str) -> bool:
    return value.strip().lower() != "off"


def _option(default: Any, env: str, help: str, parse: Callable[[str], Any], shown: str | None = None) -> Any:
    """A field read from ``env``; ``shown``: its default as the settings table writes it (``str(default)``)."""
    return field(default=default, metadata={"env": env, "help": help, "parse": parse, "shown": shown or str(default)})


@dataclass(frozen=True)
class KernelOptions:
    """How this process uses the C++ kernels; each field has its ``TSERVE_*`` environment variable."""

    kernel_dir: Path = _option(
        DEFAULT_KERNEL_DIR, "TSERVE_KERNEL_DIR", "where the C++ kernels are built once and imported from",
        lambda value: Path(value) if value else DEFAULT_KERNEL_DIR, shown="~/.cache/tserve/kernels",
    )
    decode_kernels: bool = _option(
        True, "TSERVE_DECODE_KERNELS",
        "off: inference uses PyTorch ops (MKL, SDPA) instead of our AVX-512 / AVX2 kernels",
        _switch,
        shown="auto",
    )
    packed_weights: bool = _option(
        True, "TSERVE_PACKED_WEIGHTS",
        "off: float32 linear layers read the weights as stored (few-rows GEMV, MKL), not a packed copy of each",
        _switch,
        shown="auto",
    )
    # checked where an int8 layer is made (model.int8_kernel.kernel_choice), as an unknown name always was
    int8_kernel: str = _option(
        "auto", "TSERVE_INT8_KERNEL",
        f"int8 GEMM, one of {', '.join(INT8_KERNELS)}: auto is ours on AVX512-VNNI or AVX2, else fbgemm; kernel is "
        "ours or an error",
        lambda value: value.strip().lower() or "auto",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelOptions:
        """The defaults, overridden by the ``TSERVE_*`` variables set in ``environ`` (default: os.environ)."""
        environ = os.environ if environ is None else environ
        values = {f.name: f.metadata["parse"](environ[f.metadata["env"]])
                  for f in dataclasses.fields(cls) if f.metadata["env"] in environ}
        return cls(**values)

    @classmethod
    def env(cls, name: str) -> str:
        """The environment variable of the field ``name``."""
        return next(f.metadata["env"] for f in dataclasses.fields(cls) if f.name == name)


_options: KernelOptions | None = None


def options() -> KernelOptions:
    """This process's kernel options: the environment's, read on first use."""
    global _options
    if _options is None:
        _options = KernelOptions.from_env()
    return _options


@contextlib.contextmanager
def using_options(**changes: Any) -> Iterator[KernelOptions]:
    """Run a block with some options changed (tests and benchmarks that switch kernels within one process).
    ``kernel_dir`` counts only before the first :func:`load`."""
    global _options
    previous = options()
    _options = dataclasses.replace(previous, **changes)
    kernels.cache_clear()
    try:
        yield _options
    finally:
        _options = previous
        kernels.cache_clear()


def module_name() -> str:
    """The extension's name: the sources' (and headers') hash and the Python/torch versions it is built against."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:12]
    version = torch.__version__.split("+")[0].replace(".", "_")
    return f"tserve_kernels_{digest}_py{sys.version_info.major}{sys.version_info.minor}_torch{version}"


def import_built(directory: Path, name: str) -> ModuleType | None:
    """The already-built extension ``name`` under ``directory``, or None: none built, or a build still holding its
    lock (the linker writes the library in place, so another process's build in progress shows a partial file; the
    caller then goes through torch's build, which waits for the lock and imports the finished library)."""
    library = directory / name / f"{name}.so"
    if not library.is_file() or (directory / name / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STALE_LOCK_S = 600  # a build lock older than this was left by a killed build


def remove_stale_lock(build_directory: Path) -> bool:
    """Remove torch's build lock in ``build_directory`` if a killed build left it (older than STALE_LOCK_S):
    torch waits for it to go away, forever. A recent lock is a running build's and stays. True if removed."""
    lock = build_directory / "lock"
    if _lock_age(lock) > STALE_LOCK_S:
        logger.warning("removing a stale kernel build lock %s", lock)
        lock.unlink(missing_ok=True)
        return True
    return False


def wait_for_other_build(build_directory: Path, poll_s: float = 1.0) -> None:
    """Wait while another process's build holds the lock in ``build_directory``, until it goes or grows stale
    (STALE_LOCK_S: then :func:`remove_stale_lock` takes it), instead of torch's wait, which never ends when a killed
    build left its lock."""
    lock = build_directory / "lock"
    if _lock_age(lock) >= 0:
        logger.info("waiting for another process's kernel build in %s", build_directory)
    while 0 <= _lock_age(lock) <= STALE_LOCK_S:
        time.sleep(poll_s)


def _lock_age(lock: Path) -> float:
    """Seconds since ``lock`` was taken; -1 when there is none (never taken, or released between two looks)."""
    try:
        return max(0.0, time.time() - lock.stat().st_mtime)
    except FileNotFoundError:
        return -1.0


def _build(directory: Path, name: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    directory = directory / name  # one folder per version: builds of different sources never share files
    directory.mkdir(parents=True, exist_ok=True)
    wait_for_other_build(directory)
    remove_stale_lock(directory)
    if shutil.which("ninja") is None:  # the venv's ninja (pip package) when the venv is not activated
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    logger.info("building the C++ kernels into %s (once, under a minute)", directory)
    sources = [str(path) for path in SOURCES]
    return load(name, sources=sources, extra_cflags=["-O3", "-fopenmp"], build_directory=str(directory))


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """(the extension, "") once built or imported under ``options().kernel_dir``, else (None, why not)."""
    return load_from(options().kernel_dir)


def load_from(directory: Path) -> tuple[ModuleType | None, str]:
    """(the extension, "") built or imported under ``directory``, else (None, why not); not cached."""
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform != "linux":
        return None, f"the kernels are built for x86-64 Linux, not {sys.platform}/{platform.machine()}"
    name = module_name()
    try:
        module = import_built(directory, name) or _build(directory, name)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the PyTorch paths serve instead
        return None, f"could not build the C++ kernels ({type(exc).__name__}: {str(exc).strip()[:300]})"
    apply_tuning(module, kernel_tuning(this_cpu()))
    return module, ""


def apply_tuning(module: ModuleType, tuning: PanelTuning) -> None:
    """Set the kernels' CPU-dependent rule (model/cpu.py) in ``module``."""
    module.set_panel_tuning(module.PanelTuning(**dataclasses.asdict(tuning)))


@functools.cache
def kernels() -> ModuleType | None:
    """The C++ kernels of inference (the decoding step's attention, native layers and greedy choice, and the
    linear layers, LayerNorms and activations of model/kernel_layers.py) where they run on this CPU (AVX-512, or
    AVX2 + FMA: AMD Zen 2 and 3, Intel before Skylake-SP, whose 8-lane twins of these kernels run instead; the
    encoder and prefill attention kernels and int8 / bf16 GEMMs ask for their own features), unless
    ``options().decode_kernels`` is off; None: PyTorch ops instead."""
    if not options().decode_kernels:
        return None
    module, why = load()
    if module is not None and not module.has_vector_kernels():
        module, why = None, "this CPU has neither AVX-512 nor AVX2 with FMA"
    if module is None:
        logger.info("inference uses PyTorch ops (SDPA, MKL): %s", why)
    return module


def main() -> None:
    """``python -m model.native``: build the kernels now (Docker image builds) and say which run here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module, why = load()
    if module is None:
        logger.info("C++ kernels: none (%s)", why)
        return
    logger.info("C++ kernels: %s; int8 GEMM: %s; decoding step, attention and float32 panel GEMM: %s",
                options().kernel_dir / module_name(),
                "AVX512-VNNI" if module.has_vnni() else "AVX2" if module.has_int8_kernel() else "no (fbgemm)",
                "AVX-512" if module.has_avx512() else "AVX2" if module.has_avx2() else "no (PyTorch ops)")
    logger.info("CPU: %s; panel GEMM: %s", this_cpu(), kernel_tuning(this_cpu()))

if __name__ == "__main__":
    main()
