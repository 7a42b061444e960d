"""The ``tserve`` command: ``pip install .`` into a fresh virtual environment gives a working ``tserve serve``, whose
package (playground page included) is the installed one, not this checkout's."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx

from service.local_server import ROOT, free_port, stop, wait_ready

PACKAGES = ("model", "training", "service")


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


def test_tserve_lists_the_server_and_every_training_command():
    from training.cli import command_names

    shown = run(sys.executable, "-m", "service.cli", "--help", cwd=ROOT).stdout
    assert "serve" in shown and all(name in shown for name in command_names())
    assert "usage: tserve train" in run(sys.executable, "-m", "service.cli", "train", "--help", cwd=ROOT).stdout
    assert "usage: tserve serve" in run(sys.executable, "-m", "service.cli", "serve", "--help", cwd=ROOT).stdout


def test_pip_install_gives_a_working_tserve_serve(models_dir, tmp_path):
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ behind
    for name in PACKAGES:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source,
        cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    # The dependencies (torch, fastapi, ...) from this environment, after the venv's own packages; not this
    # checkout, whose editable install's import hook a plain path entry does not run.
    site = Path(run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                    cwd=tmp_path).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    where = run(venv / "bin" / "python", "-c", "import service; print(service.__file__)", cwd=tmp_path).stdout
    assert Path(where.strip()).is_relative_to(site)
    port = free_port()
    log = tmp_path / "server.log"  # a file, not a pipe: a server that logs much never blocks on it
    with log.open("w") as out:
        process = subprocess.Popen([venv / "bin" / "tserve", "serve", "--models", models_dir, "--port", str(port),
                                    "--threads", "1", "--warmup", "false"], cwd=tmp_path, stdout=out,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, 120)
        assert httpx.get(url + "/v1/models").json()["data"]
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "<html" in page.text.lower()  # the static files were installed
    finally:
        assert stop(process) == 0, log.read_text()[-3000:]
