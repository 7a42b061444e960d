"""What this CPU reports about itself, and the kernel settings chosen from it at run time.

Intel (Sapphire Rapids) and AMD (EPYC, Zen 4) machines run the same AVX-512 kernels but differ where it counts for
a GEMV that streams weights from memory: Zen 4 has 1 MB of L2 per core and executes 512-bit instructions as two
halves, Sapphire Rapids 2 MB and full-width units. :func:`kernel_tuning` turns :class:`CpuInfo` (``/proc/cpuinfo``
and the cache sizes in sysfs) into the panel GEMM's :class:`PanelTuning`; model/native.py hands it to the kernels
once per load. Each vendor's rule is the one measured on that vendor (docs/benchmarks.md, levers 7, 11 and 12);
`python -m benchmarks.cpu_rules` times every vendor's rule on the machine it runs on.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from dataclasses import dataclass
from pathlib import Path

PROC_CPUINFO = Path("/proc/cpuinfo")
SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
AMD, INTEL = "AuthenticAMD", "GenuineIntel"
DEFAULT_L2_BYTES = 1 << 20  # when sysfs does not say (containers that hide it): the smaller of the two CPUs'
# /proc/cpuinfo's flags the kernels choose by (the C++ kernels check their own with cpuid too): AVX-512 for every
# kernel, VNNI for int8, BF16 dot products for bf16 (model/bf16_linear.py), AMX tiles for Intel's matrix engine
KERNEL_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "amx_tile",
                          "amx_bf16", "amx_int8"})


@dataclass(frozen=True)
class CpuInfo:
    """The facts the kernels' settings depend on, as the CPU reports them."""

    vendor: str  # /proc/cpuinfo's vendor_id: AuthenticAMD, GenuineIntel, ... ("" when unknown)
    model_name: str
    l2_bytes: int  # L2 per core
    flags: frozenset[str] = frozenset()  # those of KERNEL_FLAGS the CPU reports
    family_model: str = ""  # "family 26 model 2" (AMD Zen 5; Zen 4 is family 25), what a VM's model name hides

    @classmethod
    def read(cls, cpuinfo: Path = PROC_CPUINFO, caches: Path = SYSFS_CACHES) -> CpuInfo:
        """This machine's (or the given files'): what cannot be read falls back to "" / DEFAULT_L2_BYTES."""
        fields: dict[str, str] = {}
        with contextlib.suppress(OSError), cpuinfo.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():  # the first processor's block is enough
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
        return cls(
            vendor=fields.get("vendor_id", ""),
            model_name=fields.get("model name") or platform.processor() or "unknown CPU",
            l2_bytes=_cache_bytes(caches, level=2) or DEFAULT_L2_BYTES,
            flags=KERNEL_FLAGS.intersection(fields.get("flags", "").split()),
            family_model=(f"family {fields['cpu family']} model {fields['model']}"
                          if "cpu family" in fields and "model" in fields else ""),
        )


def _cache_bytes(caches: Path, level: int) -> int | None:
    """The size of the data or unified cache of ``level`` under a sysfs cache folder, or None."""
    for index in sorted(caches.glob("index*")):
        try:
            if int((index / "level").read_text()) != level or (index / "type").read_text().strip() == "Instruction":
                continue
            return _size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return None


def _size_bytes(text: str) -> int:
    """sysfs sizes: "1024K", "2048K", "32M" -> bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


@dataclass(frozen=True)
class PanelTuning:
    """The panel GEMM's (model/kernels/packed_linear.cpp) blocking and prefetch rule.

    Tiles of up to ``streaming_tile_rows`` rows (decoding at batch 1, beams of one source) are bound by reading
    the weights; wider tiles by their FMAs."""

    row_block_bytes: int  # rows of x a thread keeps in L2 while it walks its panels
    prefetch_rows: int  # panel rows prefetched ahead into L1 by wide tiles
    streaming_tile_rows: int
    streaming_prefetch_rows: int  # panel rows prefetched ahead by streaming tiles
    streaming_into_l2: bool  # streaming tiles prefetch into L2 (else into L1)
    gemv_panels: int  # panels a tile of 1-2 rows walks side by side (1, 2 or 4): streams from memory per thread
    # The widest vectors the kernels use: 512 (AVX-512 where the CPU has it; else they take 256) or 256 (their AVX2 and
    # FMA twins: the panel GEMM's tiles of up to 6 rows, one panel each; a test or benchmark may cap an AVX-512 CPU)
    vector_bits: int = 512
    # Tiles of 1-2 rows prefetch by the streaming rule; else they leave the reading ahead to the hardware prefetchers
    # (a Zen 3, AVX2's tiles: 1.09-1.12x greedy batch-1 decoding, docs/benchmarks.md, session 36)
    gemv_prefetch: bool = True


def kernel_tuning(cpu: CpuInfo) -> PanelTuning:
    """The panel GEMM's settings for ``cpu``: x blocks of 3/4 of its L2; on AMD, tiles of up to 4 rows prefetch 64
    rows ahead into L2 (1.05-1.13x on Zen 4's 1-row GEMVs, lever 11) and tiles of 1-2 rows walk 4 panels side by
    side (lever 12); elsewhere every tile prefetches 32 rows ahead into L1 and walks one panel, the rule the
    Sapphire Rapids runs of sessions 1-6 measured for wide tiles (1-4 rows took another kernel there then:
    ``python -m benchmarks.cpu_rules`` on such a machine says whether AMD's rule would serve it better). AMD CPUs
    without AVX-512 (Zen 2 and 3) leave the reading ahead of 1-2 row tiles to their hardware prefetchers."""
    amd = cpu.vendor == AMD
    return PanelTuning(
        row_block_bytes=cpu.l2_bytes * 3 // 4,
        prefetch_rows=32,
        streaming_tile_rows=4,
        streaming_prefetch_rows=64 if amd else 32,
        streaming_into_l2=amd,
        gemv_panels=4 if amd else 1,
        gemv_prefetch=not amd or "avx512f" in cpu.flags,
    )


@functools.cache
def this_cpu() -> CpuInfo:
    """This machine's CPU, read once per process."""
    return CpuInfo.read()
