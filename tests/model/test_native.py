"""Building and loading the C++ kernels (model/native.py): reuse of a build, stale locks, failures."""

import os
import threading
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


@needs_build
def test_a_stale_build_lock_is_removed_instead_of_waited_for():
    """A build killed mid-way leaves torch's lock file; the next build must remove it rather than wait on it
    forever. Built in place over the session's own up-to-date build (ninja has nothing to compile, whatever the
    machine's speed); the join's bound only keeps a hang from stalling the suite."""
    name = native.module_name()
    lock = native.kernel_dir() / name / "lock"
    lock.touch()
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    result = {}
    thread = threading.Thread(target=lambda: result.update(module=native._build(native.kernel_dir(), name)),
                              daemon=True)
    thread.start()
    thread.join(timeout=1800)
    assert not thread.is_alive(), "the build is still waiting (on the stale lock)"
    assert result["module"].has_avx512() == built.has_avx512() and not lock.exists()


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
