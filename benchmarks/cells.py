"""A cell of the peers comparison and how its engines are timed: alternating, medians, slow thread counts pruned.

benchmarks/compare.py (the toy shape) and benchmarks/shape_compare.py (the HF-layout shapes) share it.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("benchmarks.compare")


@dataclass
class Cell:
    """One workload and the median seconds of each variant ("engine@threads")."""

    family: str
    label: str  # "greedy", "beam 4", "forward"
    batch: int
    beams: int
    items: int  # tokens (or sequences) per run, for the rate
    length: int = 0  # tokens per input row (prompt, source or sequence) where a table needs it
    seconds: dict[str, float] = field(default_factory=dict)
    pruned: list[str] = field(default_factory=list)  # variants timed by their warm-up only
    bandwidth: list[dict[int, float]] = field(default_factory=list)  # read rates probed before each timed run

    def read_bandwidth(self) -> dict[int, float]:
        """Working-set bytes -> the median of the rates probed during this cell's runs ({} without a probe)."""
        return {size: statistics.median(p[size] for p in self.bandwidth) for size in self.bandwidth[0]} \
            if self.bandwidth else {}

    def best(self, engine: str) -> tuple[float, int] | None:
        """(rate, threads) of ``engine`` in its fastest thread count."""
        found = [(self.items / s, int(v.rsplit("@", 1)[1])) for v, s in self.seconds.items()
                 if v.rsplit("@", 1)[0] == engine]
        return max(found) if found else None

    def ratio(self, engine: str, peer: str) -> float | None:
        a, b = self.best(engine), self.best(peer)
        return a[0] / b[0] if a and b else None


# Issue 40: an "n x HF" target is retired in a cell where HF itself runs above half the floor (twice HF's rate would
# be beyond what the floor allows).
HF_RETIRED_ABOVE = 0.5


def hf_retired(hf_share: float | None) -> str | None:
    """The verdict of an "n x HF" target in a cell where HF reads ``hf_share`` of the floor: "retired (...)" above
    :data:`HF_RETIRED_ABOVE`, else None (the target is checked)."""
    if hf_share is not None and hf_share > HF_RETIRED_ABOVE:
        return f"retired (HF at {hf_share:.0%} of the floor)"
    return None


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


_CALLED: set[tuple[str, str]] = set()  # (family, engine) pairs that have run once in this process
# A timed run shorter than this follows an untimed run of its own: the engine before it may leave its threads
# busy for tens of milliseconds (ONNX Runtime's spinning pool kept a 20 ms BERT forward of ours at 37-56 ms
# when interleaved), and its own threads wake up. Longer runs absorb that within noise.
LEAD_IN_BELOW_S = 1.0


def _slow(times: dict[str, list[float]], prune: float) -> list[str]:
    """Variants whose (warm-up) time is over ``prune`` x the fastest of the same engine."""
    fastest: dict[str, float] = {}
    for name, (warm,) in times.items():
        engine = name.rsplit("@", 1)[0]
        fastest[engine] = min(fastest.get(engine, warm), warm)
    return [n for n, (warm,) in times.items() if warm > prune * fastest[n.rsplit("@", 1)[0]]]


def alternate(cell: Cell, variants: dict[str, tuple[int, Callable[[], list[int]]]], expected: int,
              repeats: int, prune: float, probe: Callable[[], dict[int, float]] | None = None) -> Cell:
    """Warm up, then time every variant ``repeats`` times in rotating order (a short run after an untimed one of
    its own: :data:`LEAD_IN_BELOW_S`); store the medians. ``probe`` (benchmarks/floor.py's BandwidthProbe) runs
    before each timed run (a round of several engines lasts long enough for the machine's bandwidth to move), its
    readings kept in ``cell.bandwidth``.

    A thread count whose warm-up took over ``prune`` x the same engine's fastest warm-up, twice, is
    not timed further (on a shared machine, spinning OpenMP threads can make it 5-30x slower): its
    faster warm-up stands as its result, which is never an engine's best.
    """
    times: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    short: set[str] = set()  # variants whose timed runs follow a lead-in (known after the warm-up round)
    for name, (threads, run) in variants.items():  # an engine's first call ever may set things up: not timed
        key = (cell.family, name.rsplit("@", 1)[0])
        if key not in _CALLED:
            _CALLED.add(key)
            torch.set_num_threads(threads)
            run()
    for round_ in range(repeats + 1):
        for name in order[round_ % len(order):] + order[: round_ % len(order)]:
            if round_ and probe is not None:
                cell.bandwidth.append(probe())
            threads, run = variants[name]
            torch.set_num_threads(threads)
            if name in short:
                run()
            start = time.perf_counter()
            produced = run()
            elapsed = time.perf_counter() - start
            if any(n != expected for n in produced):
                raise RuntimeError(f"{name} in {cell.family} {cell.label} b{cell.batch}: produced {produced}, "
                                   f"expected {expected} each")
            times[name].append(elapsed)
        if round_ == 0:
            slow = _slow(times, prune)
            for name in slow:  # a second chance: one slow warm-up may be a burst of other work
                threads, run = variants[name]
                torch.set_num_threads(threads)
                start = time.perf_counter()
                run()
                times[name] = [min(times[name][0], time.perf_counter() - start)]
            slow = _slow(times, prune)
            if slow:
                logger.info("%s %s b%d: not timing %s further (warm-up over %.1fx its engine's fastest)",
                            cell.family, cell.label, cell.batch, ", ".join(slow), prune)
                cell.pruned += slow
            order = [n for n in order if n not in slow]
            short = {name for name in order if times[name][0] < LEAD_IN_BELOW_S}
            for name in order:
                times[name].clear()
    cell.seconds = {v: statistics.median(t) for v, t in times.items()}
    logger.info("%s %s b%d: %s", cell.family, cell.label, cell.batch,
                ", ".join(f"{v} {cell.items / s:,.0f}/s" for v, s in cell.seconds.items()))
    return cell


def rate(cell: Cell, engine: str) -> str:
    """``engine``'s best rate in ``cell`` and its thread count, or "-"."""
    best = cell.best(engine)
    return f"{best[0]:,.0f} ({best[1]}t)" if best else "-"


def ratio_text(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def versions() -> str:
    import transformers

    parts = [f"transformers {transformers.__version__}"]
    try:
        import ctranslate2

        parts.append(f"ctranslate2 {ctranslate2.__version__}")
    except ImportError:
        parts.append("ctranslate2 not installed")
    try:
        import onnxruntime

        parts.append(f"onnxruntime {onnxruntime.__version__}")
    except ImportError:
        parts.append("onnxruntime not installed")
    return " · ".join(parts)


def kernels() -> str:
    """Which of our C++ kernels run here (model/native.py), or why none does."""
    from model import bf16_linear, int8_kernel, native, packed_weights

    module, why = int8_kernel.available()
    int8 = ("AVX512-VNNI kernel" if module.has_vnni() else "AVX2 kernel") \
        if module is not None and int8_kernel.kernel_choice() != "fbgemm" else \
        f"fbgemm ({why or 'TSERVE_INT8_KERNEL=fbgemm'})"
    bf16 = bf16_linear.kernel()
    bf16_gemm = "torch (float32 upcast)" if bf16 is None else \
        "AVX512-BF16 kernel" if bf16.has_avx512_bf16() else "AVX2 kernel (bf16 pairs split for float32 FMAs)"
    gemms = f"int8 GEMM {int8}; bf16 GEMM {bf16_gemm}"
    module = native.kernels()
    if module is None:
        return f"{gemms}; decoding step: Python replay, float32 MKL, SDPA"
    width = "AVX-512" if module.has_avx512() else "AVX2"
    packed = "panel GEMM over packed weights" if packed_weights.enabled() else "MKL (TSERVE_PACKED_WEIGHTS=off)"
    return (f"{gemms}; decoding step ({width}): native layers, float32 {packed}, attention, "
            "LayerNorm/activations/cache writes, greedy choice")
