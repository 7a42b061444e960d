"""Building and loading the C++ kernels (model/native.py): reuse of a build, stale locks, failures."""

import os
import time

import pytest

from model import native

built, why_not = native.load()
needs_build = pytest.mark.skipif(built is None, reason=f"the C++ kernels do not build here: {why_not}")


@needs_build
def test_a_built_extension_is_imported_without_building():
    module = native.import_built(native.kernel_dir(), native.module_name())
    assert module is not None and module.has_avx512() == built.has_avx512()
    assert native.import_built(native.kernel_dir(), "tserve_kernels_no_such_build") is None


def test_a_stale_build_lock_is_removed_before_building_and_a_recent_one_kept(tmp_path):
    """A build killed mid-way leaves torch's lock file, and torch waits for it to go away forever: the build
    removes a lock older than STALE_LOCK_S first; a recent one belongs to a build still running."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not native.remove_stale_lock(tmp_path) and lock.exists()
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert native.remove_stale_lock(tmp_path) and not lock.exists()
    assert not native.remove_stale_lock(tmp_path)  # nothing left to remove


def test_a_failed_build_reports_why_and_nothing_is_loaded(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("TSERVE_KERNEL_DIR", str(blocker))
    module, why = native.load.__wrapped__()  # uncached: the session's own load stays as it was
    assert module is None and "could not build the C++ kernels" in why


def test_the_name_follows_the_sources(monkeypatch, tmp_path):
    source = tmp_path / "extra.cpp"
    source.write_text("// a change\n")
    before = native.module_name()
    monkeypatch.setattr(native, "SOURCES", [*native.SOURCES, source])
    assert native.module_name() != before and native.module_name().startswith("tserve_kernels_")


@needs_build
def test_the_kernels_release_the_gil_while_they_compute():
    """The service's event loop keeps running while a decoding step computes in another thread."""
    import threading

    import torch

    from model import int8_kernel

    if not built.has_vnni():
        pytest.skip("no AVX512-VNNI here")
    q = torch.randint(-127, 128, (4096, 4096), dtype=torch.int8)
    args = (int8_kernel.pack(q), torch.full((4096,), 1e-3), q.sum(1, dtype=torch.int32), None)
    x = torch.randn(2048, 4096)
    span = {}

    def compute():
        span["start"] = time.perf_counter()
        built.int8_linear(x, *args)
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=compute)
    ticks = [time.perf_counter()]
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        ticks.append(time.perf_counter())
    worker.join()
    duration = span["end"] - span["start"]
    if duration < 0.02:
        pytest.skip(f"the call took only {duration * 1e3:.1f} ms: too short to tell")
    longest_gap = max(b - a for a, b in zip(ticks, ticks[1:], strict=False))
    assert longest_gap < duration / 2  # holding the GIL would stall this loop for the whole call
