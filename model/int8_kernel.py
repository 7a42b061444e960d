"""The AVX512-VNNI int8 linear kernel (model/kernels/int8_vnni.cpp): build once, load, pack weights.

The kernel is a PyTorch C++ extension compiled on first use (about 20 s; ``torch.utils.cpp_extension``
with the system's C++ compiler and ninja) into ``TSERVE_KERNEL_DIR`` (default
``~/.cache/tserve/kernels``), under a name carrying the source's hash: later processes import the
built module directly (no compiler needed then, as in the Docker image, which builds it at image
build time), and an edited source builds afresh. ``TSERVE_INT8_KERNEL`` picks the int8 GEMM:
``auto`` (default: this kernel where it builds and the CPU has AVX512-VNNI, fbgemm otherwise),
``vnni`` (this kernel or an error) or ``fbgemm``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "int8_vnni.cpp"
KERNEL_CHOICES = ("auto", "vnni", "fbgemm")


class KernelUnavailable(RuntimeError):
    """``TSERVE_INT8_KERNEL=vnni`` was asked for and the kernel cannot run here."""


def kernel_dir() -> Path:
    return Path(os.environ.get("TSERVE_KERNEL_DIR") or Path.home() / ".cache" / "tserve" / "kernels")


def module_name() -> str:
    """The extension's name: the source's hash and the Python/torch versions it is built against."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    version = torch.__version__.split("+")[0].replace(".", "_")
    return f"tserve_int8_{digest}_py{sys.version_info.major}{sys.version_info.minor}_torch{version}"


def _import_built(directory: Path, name: str) -> ModuleType | None:
    """The already-built extension in ``directory``, or None."""
    library = directory / f"{name}.so"
    if not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(directory: Path, name: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    if shutil.which("ninja") is None:  # the venv's ninja (pip package) when the venv is not activated
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    logger.info("building the int8 VNNI kernel into %s (once, about 20 s)", directory)
    return load(name, sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"], build_directory=str(directory))


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    """(the extension, "") where it runs on this CPU, else (None, why not)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform != "linux":
        return None, f"the kernel is built for x86-64 Linux, not {sys.platform}/{platform.machine()}"
    directory, name = kernel_dir(), module_name()
    try:
        module = _import_built(directory, name) or _build(directory, name)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: fbgemm serves instead
        return None, f"could not build the int8 kernel ({type(exc).__name__}: {str(exc).strip()[:300]})"
    if not module.supported():
        return None, "this CPU has no AVX512-VNNI"
    return module, ""


def kernel_choice() -> str:
    choice = os.environ.get("TSERVE_INT8_KERNEL", "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise KernelUnavailable(f"TSERVE_INT8_KERNEL={choice!r}: expected one of {list(KERNEL_CHOICES)}")
    return choice


def vnni_kernel() -> ModuleType | None:
    """The VNNI extension when ``TSERVE_INT8_KERNEL`` allows it and it runs here; None means fbgemm."""
    choice = kernel_choice()
    if choice == "fbgemm":
        return None
    module, why = _load()
    if module is None:
        if choice == "vnni":
            raise KernelUnavailable(f"TSERVE_INT8_KERNEL=vnni: {why}")
        _warn_once(why)
    return module


@functools.cache
def _warn_once(why: str) -> None:
    logger.warning("int8 layers use fbgemm: %s", why)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 weights (out, in) -> the kernel's [out/16][in/4][16][4] layout, zero-padded."""
    out, inp = q.shape
    padded = torch.zeros(-(-out // 16) * 16, -(-inp // 4) * 4, dtype=torch.int8)
    padded[:out, :inp] = q
    return padded.view(-1, 16, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The inverse of :func:`pack`: int8 weights (out, in)."""
    blocks, steps = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, steps * 4)[:out, :inp]


def main() -> None:
    """``python -m model.int8_kernel``: build the kernel now (Docker image builds) and say whether it runs."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module, why = _load()
    print(f"int8 kernel: {'AVX512-VNNI, ' + str(kernel_dir() / module_name()) if module else 'fbgemm (' + why + ')'}")


if __name__ == "__main__":
    main()
