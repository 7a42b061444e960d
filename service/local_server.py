"""A real server on this machine, for the tests and the benchmarks: ``python -m service`` in a subprocess on a free
127.0.0.1 port, and what a client needs around it (its metrics, its memory, an adapter upload, a trace receiver).

Usage::

    with running_server(models_dir, adapters_dir, TSERVE_MAX_QUEUE="2") as server:
        httpx.get(server.url + "/ready")

Settings go in as ``TSERVE_*`` environment variables (the way an operator sets them); the server's
output goes to a log file whose tail is shown if it fails to become ready.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from model.lora_io import CONFIG_FILE, WEIGHTS_FILE

ROOT = Path(__file__).resolve().parents[1]  # holds the service package: where ``python -m service`` runs


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Return once ``url``/ready answers 200; raise if ``process`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server at {url} not ready after {timeout_s} s")


def stop(process: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """SIGTERM (graceful: drains in-flight requests), SIGKILL if it does not exit in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@contextmanager
def running_server(
    models_dir: Path | str,
    adapters_dir: Path | None = None,
    ready_timeout_s: float = 60.0,
    module_args: Sequence[str] = ("-m", "service"),
    **env: str,
) -> Iterator[Server]:
    """Start ``python -m service`` with ``env`` (TSERVE_* settings) added; stop it on exit.

    ``module_args``: what runs instead of ``-m service``, e.g. a wrapper that installs fault hooks first
    (tests/reliability/gated_server.py); the server's own flags follow them."""
    port = free_port()
    args = [sys.executable, *module_args, "--models", str(models_dir), "--host", "127.0.0.1", "--port", str(port)]
    if adapters_dir is not None:
        args += ["--adapters", str(adapters_dir)]
    environ = {**os.environ, "TSERVE_THREADS": "1", "TSERVE_LOG_LEVEL": "warning", **env}
    log = tempfile.NamedTemporaryFile(prefix="tserve-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(args, cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, Path(log.name))
    try:
        try:
            wait_ready(server.url, process, ready_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; server log:\n{server.log()[-4000:]}") from None
        yield server
    finally:
        stop(process)
        log.close()
        os.unlink(log.name)


# ---- what a client reads and sends -------------------------------------------------------------------


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of metric ``name`` in Prometheus text: {sorted label pairs: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


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
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True)
    shutil.copy(source / CONFIG_FILE, target / CONFIG_FILE)
    tensors = load_file(str(source / WEIGHTS_FILE))
    save_file({k: (-v if "lora_B" in k else v) for k, v in tensors.items()}, str(target / WEIGHTS_FILE))
    return target


@contextmanager
def otlp_receiver() -> Iterator[tuple[str, list]]:
    """An OTLP/HTTP (protobuf) traces endpoint on 127.0.0.1: (its base URL, the spans received so far)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_service

    spans: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            request = trace_service.ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    spans.extend(scope.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", spans
    finally:
        server.shutdown()
