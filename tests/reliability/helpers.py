"""Helpers of the reliability tests: an in-process real server and shared checks.

``inprocess_server`` runs uvicorn on a real 127.0.0.1 socket in a thread of the test process, so a
test can reach into the engine (fault hooks that slow down or break model calls, the batch's rows)
while clients talk HTTP; ``service.local_server.running_server`` is the subprocess server for
everything that needs a process of its own (signals, memory, logs), and the home of the helpers the
benchmarks share with these tests (process memory, adapter uploads), re-exported here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from service.__main__ import server_config
from service.api.app import create_app
from service.engine.engine import Engine
from service.local_server import adapter_archive, adapter_variant, free_port, metric_samples, rss_bytes
from service.settings import Settings

__all__ = ["InProcessServer", "adapter_archive", "adapter_variant", "health_latencies", "inprocess_server",
           "rss_bytes", "wait_until"]


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
