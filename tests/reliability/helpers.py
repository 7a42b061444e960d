"""Helpers of the reliability tests: an in-process real server, process memory, shared checks.

``inprocess_server`` runs uvicorn on a real 127.0.0.1 socket in a thread of the test process, so a
test can reach into the engine (fault hooks that slow down or break model calls, the batch's rows)
while clients talk HTTP; ``tests.service.server.running_server`` is the subprocess server for
everything that needs a process of its own (signals, memory, logs).
"""

from __future__ import annotations

import io
import shutil
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI
from safetensors.torch import load_file, save_file

from model.lora_io import CONFIG_FILE, WEIGHTS_FILE
from service.__main__ import server_config
from service.app import create_app
from service.engine import Engine
from service.settings import Settings
from tests.service.server import free_port, metric_samples


@dataclass
class InProcessServer:
    url: str
    app: FastAPI

    @property
    def engine(self) -> Engine:
        return self.app.state.engine

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``, read over HTTP."""
        samples = metric_samples(httpx.get(self.url + "/metrics").text, name)
        return sum(v for k, v in samples.items() if set(labels.items()) <= set(k))


@contextmanager
def inprocess_server(models_dir: Path, adapters_dir: Path | None = None, **settings) -> Iterator[InProcessServer]:
    """``python -m service``'s app and uvicorn, in a thread of this process (CPU, no warm-up by default)."""
    port = free_port()
    service_settings = Settings(
        models=models_dir,
        adapters=adapters_dir,
        **{"device": "cpu", "warmup": False, "host": "127.0.0.1", "port": port, "log_level": "warning", **settings},
    )
    app = create_app(service_settings)
    server = uvicorn.Server(server_config(app, service_settings))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield InProcessServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(30)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def adapter_archive(directory: Path) -> bytes:
    """A PEFT-layout adapter directory as the .tar.gz an upload sends."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            tar.add(directory / name, arcname=name)
    return buf.getvalue()


def adapter_variant(source: Path, target: Path) -> Path:
    """A second version of an adapter: the same A, B negated (other outputs, same shapes)."""
    target.mkdir(parents=True)
    shutil.copy(source / CONFIG_FILE, target / CONFIG_FILE)
    tensors = load_file(str(source / WEIGHTS_FILE))
    save_file({k: (-v if "lora_B" in k else v) for k, v in tensors.items()}, str(target / WEIGHTS_FILE))
    return target


def wait_until(condition, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


def health_latencies(client: httpx.Client, count: int) -> list[float]:
    """Seconds each of ``count`` sequential GET /health calls took (each must answer 200)."""
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - start)
    return latencies
