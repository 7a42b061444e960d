"""Our C++ CPU kernels (model/kernels/*.cpp): built once, then imported; every caller has a PyTorch fallback.

The kernels are one PyTorch C++ extension compiled on first use (under a minute; ``torch.utils.cpp_extension``
with the system's C++ compiler and ninja) into ``TSERVE_KERNEL_DIR`` (default ``~/.cache/tserve/kernels``),
under a name carrying the sources' hash and the Python/torch versions: later processes import the built
module directly (no compiler needed then, as in the Docker image, which builds it at image build time),
and edited sources build afresh. Only x86-64 Linux; each kernel also checks the CPU features it needs
(``has_vnni``, ``has_avx512``), and :func:`extension` returns None, with the reason, where it cannot run.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
SOURCES = sorted(KERNELS.glob("*.cpp"))
HEADERS = sorted(KERNELS.glob("*.h"))


def kernel_dir() -> Path:
    return Path(os.environ.get("TSERVE_KERNEL_DIR") or Path.home() / ".cache" / "tserve" / "kernels")


def module_name() -> str:
    """The extension's name: the sources' (and headers') hash and the Python/torch versions it is built against."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:12]
    version = torch.__version__.split("+")[0].replace(".", "_")
    return f"tserve_kernels_{digest}_py{sys.version_info.major}{sys.version_info.minor}_torch{version}"


def import_built(directory: Path, name: str) -> ModuleType | None:
    """The already-built extension ``name`` under ``directory``, or None."""
    library = directory / name / f"{name}.so"
    if not library.is_file():
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
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        logger.warning("removing a stale kernel build lock %s", lock)
        lock.unlink(missing_ok=True)
        return True
    return False


def _build(directory: Path, name: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    directory = directory / name  # one folder per version: builds of different sources never share files
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_lock(directory)
    if shutil.which("ninja") is None:  # the venv's ninja (pip package) when the venv is not activated
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    logger.info("building the C++ kernels into %s (once, under a minute)", directory)
    sources = [str(path) for path in SOURCES]
    return load(name, sources=sources, extra_cflags=["-O3", "-fopenmp"], build_directory=str(directory))


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """(the extension, "") once built or imported, else (None, why not)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform != "linux":
        return None, f"the kernels are built for x86-64 Linux, not {sys.platform}/{platform.machine()}"
    directory, name = kernel_dir(), module_name()
    try:
        return import_built(directory, name) or _build(directory, name), ""
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the PyTorch paths serve instead
        return None, f"could not build the C++ kernels ({type(exc).__name__}: {str(exc).strip()[:300]})"


def main() -> None:
    """``python -m model.native``: build the kernels now (Docker image builds) and say which run here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module, why = load()
    if module is None:
        logger.info("C++ kernels: none (%s)", why)
        return
    logger.info("C++ kernels: %s; int8 AVX512-VNNI: %s, decoding step and attention (AVX-512): %s",
                kernel_dir() / module_name(), module.has_vnni(), module.has_avx512())

if __name__ == "__main__":
    main()
