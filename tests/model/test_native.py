"""Building and loading the C++ kernels (model/native.py): reuse of a build, stale locks, failures, options."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from model import native

built, why_not = native.load()
needs_build = pytest.mark.skipif(built is None, reason=f"the C++ kernels do not build here: {why_not}")


@needs_build
def test_a_built_extension_is_imported_without_building():
    module = native.import_built(native.options().kernel_dir, native.module_name())
    assert module is not None and module.has_avx512() == built.has_avx512()
    assert native.import_built(native.options().kernel_dir, "tserve_kernels_no_such_build") is None


def test_a_library_whose_build_still_holds_its_lock_is_not_imported(tmp_path):
    """Another process building the same version shows a partial library (the linker writes it in place): while the
    build's lock is there the import waits for the build (torch's lock) instead of loading a truncated file."""
    name = "tserve_kernels_partial"
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"\x7fELF partial")
    (tmp_path / name / "lock").touch()
    assert native.import_built(tmp_path, name) is None
    (tmp_path / name / "lock").unlink()  # the build finished (here: the same partial file, so the import fails)
    with pytest.raises(ImportError):
        native.import_built(tmp_path, name)


def test_a_build_waits_for_a_running_one_and_not_for_a_stale_lock(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    waiting = threading.Thread(target=native.wait_for_other_build, args=(tmp_path, 0.01))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()  # the other build still holds the lock
    lock.unlink()  # it finished
    waiting.join(60)
    assert not waiting.is_alive()
    lock.touch()
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    native.wait_for_other_build(tmp_path, 0.01)  # a killed build's lock: returns at once, for remove_stale_lock
    assert lock.exists()


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


def test_a_failed_build_reports_why_and_nothing_is_loaded(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    module, why = native.load_from(blocker)  # uncached: the session's own load stays as it was
    assert module is None and "could not build the C++ kernels" in why


def test_the_options_are_read_from_the_environment_once_and_changed_for_a_block():
    assert native.KernelOptions.from_env({}) == native.KernelOptions()
    env = {"TSERVE_KERNEL_DIR": "/k", "TSERVE_DECODE_KERNELS": " OFF ", "TSERVE_PACKED_WEIGHTS": "auto",
           "TSERVE_INT8_KERNEL": "FBGEMM"}
    assert native.KernelOptions.from_env(env) == native.KernelOptions(Path("/k"), False, True, "fbgemm")
    assert native.KernelOptions.from_env({"TSERVE_KERNEL_DIR": ""}).kernel_dir == native.DEFAULT_KERNEL_DIR
    before, kernels = native.options(), native.kernels()
    with native.using_options(decode_kernels=False) as changed:
        assert native.options() is changed and not changed.decode_kernels and native.kernels() is None
    assert native.options() is before and native.kernels() is kernels


def test_the_name_follows_the_sources(monkeypatch, tmp_path):
    source = tmp_path / "extra.cpp"
    source.write_text("// a change\n")
    before = native.module_name()
    monkeypatch.setattr(native, "SOURCES", [*native.SOURCES, source])
    assert native.module_name() != before and native.module_name().startswith("tserve_kernels_")


@needs_build
def test_the_kernels_release_the_gil_while_they_compute():
    """The service's event loop keeps running while a decoding step computes in another thread.

    Thread switches are left to the threads (a switch interval longer than the test): this thread, woken
    just before the worker's call, can take the GIL and count only while the call has let it go. A call
    that holds it leaves the count as it was, every time."""
    import torch

    from model import int8_kernel

    if not built.has_int8_kernel():
        pytest.skip("no int8 kernel here (neither AVX512-VNNI nor AVX2)")
    q = torch.randint(-127, 128, (4096, 4096), dtype=torch.int8)
    args = (int8_kernel.pack(q), torch.full((4096,), 1e-3), q.sum(1, dtype=torch.int32), None)
    x = torch.randn(256, 4096)
    counted = [0]
    calling, finished, overlapped = threading.Event(), threading.Event(), threading.Event()

    def compute():
        for _ in range(20):  # another try if this thread was not scheduled before the call returned
            seen = counted[0]
            calling.set()
            built.int8_linear(x, *args)
            if counted[0] != seen:
                overlapped.set()
                break
        finished.set()
        calling.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        worker = threading.Thread(target=compute)
        worker.start()
        while True:
            calling.wait()
            calling.clear()
            if finished.is_set():
                break
            counted[0] += 1
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert overlapped.is_set()  # holding the GIL would keep this thread from counting during any call
