"""Fixtures for the deployment tests: the tools they need (Prometheus, Chromium) fetched by the
project's scripts, and the tiny checkpoints of tests/service.

The setup scripts exit 3 when they cannot reach the Debian registry (or apt is missing); only then
do the tests that need the tool skip, naming the reason. Any other failure fails the test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import adapters_dir, models_dir, tiny_root  # noqa: F401  (shared fixtures)

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = 3  # exit status of scripts/*.sh when the registry cannot be reached


def run_setup_script(name: str, timeout_s: float) -> str:
    """Run scripts/<name>; skip on exit 3 (registry unreachable), fail on any other error; return stdout."""
    script = ROOT / "scripts" / name
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode == UNREACHABLE:
        pytest.skip(f"scripts/{name}: Debian registry unreachable, cannot fetch the tool: {proc.stderr.strip()[-500:]}")
    if proc.returncode != 0:
        output = f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        pytest.fail(f"scripts/{name} failed with status {proc.returncode}:\n{output}")
    return proc.stdout


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    """Directory holding the `prometheus` and `promtool` binaries (cached under .cache/prometheus)."""
    out = run_setup_script("fetch_prometheus.sh", timeout_s=300)
    return Path(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def nginx_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Debian's nginx binary, unpacked (not installed) under .cache/nginx: `nginx -t` checks the lb config."""
    root = ROOT / ".cache" / "nginx"
    binary = root / "root" / "usr" / "sbin" / "nginx"
    if not binary.exists():
        download = tmp_path_factory.mktemp("nginx-deb")
        proc = subprocess.run(["apt-get", "download", "-q", "nginx"], cwd=download, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            pytest.skip(f"apt-get download nginx: Debian registry unreachable: {proc.stderr.strip()[-500:]}")
        deb = next(download.glob("nginx_*.deb"))
        unpacked = download / "root"
        subprocess.run(["dpkg", "-x", str(deb), str(unpacked)], check=True, timeout=120)
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / "root", ignore_errors=True)
        shutil.move(unpacked, root / "root")
    return binary


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """(chromium binary, chromedriver binary), installed from Debian by scripts/install_browser.sh."""
    run_setup_script("install_browser.sh", timeout_s=900)
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.fail("scripts/install_browser.sh succeeded but chromium/chromedriver are not on PATH")
    return browser, driver


def venv_tool(name: str) -> str:
    """A console script of a dev dependency: next to this interpreter first, then on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it is a dev dependency (pip install -r requirements-dev.txt)")
    return found
