"""The image built from the Dockerfile and run for real, with podman (docs/deployment.md, "Built and run with
podman"): served from the host, its user, its HEALTHCHECK, a SIGTERM drain, and the compose stack's API with
Prometheus scraping it.

Needs podman able to run a container and the Dockerfile's base image built locally: scripts/podman-setup does
both on a Debian machine (root). Where either is missing the tests skip, saying so; CI has no podman.
scripts/podman-build builds the image (layers cached: seconds when nothing changed). The checkpoints are the
tiny ones of tests/service, trained in the session.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from service.api.schemas import GenerateOutput
from tests.deploy.conftest import ROOT
from tests.service.conftest import ADAPTERS, CLS, LM, MT, assert_same, offline
from tests.service.server import free_port, metric_samples

BASE = "docker.io/library/" + re.search(r"^ARG BASE_IMAGE=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)[1]
IMAGE = "tserve:cpu"  # docker-compose.yml's api image
PROMETHEUS_IMAGE = re.search(r"^PROMETHEUS_IMAGE=(\S+)$", (ROOT / "scripts/podman-setup").read_text(), re.M)[1]
SETUP = "run scripts/podman-setup (as root on Debian: installs podman, builds the base image)"
USER = "10001:10001"  # the Dockerfile's USER
STARTUP_S = 120.0  # the HEALTHCHECK's start period: model loading and warm-up
PROMPT = "the cat sat on the mat"


def podman(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        output = f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        pytest.fail(f"podman {' '.join(args)} failed with status {proc.returncode}:\n{output}")
    return proc


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, diagnose: Callable[[], str] = str) -> None:
    """Poll ``condition`` until it is true (transport errors count as false); fail naming ``what`` at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}\n{diagnose()}")


@dataclass(frozen=True)
class Container:
    name: str
    url: str  # the published port, from the host

    def logs(self) -> str:
        proc = podman("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def inspect(self, template: str) -> str:
        return podman("inspect", "--format", template, self.name).stdout.strip()

    def exec(self, *command: str) -> subprocess.CompletedProcess:
        return podman("exec", self.name, *command, check=False)

    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"


@contextmanager
def running(volumes: tuple[Path, Path], *command: str, mounts: tuple[str, ...] = (), **env: str) -> Iterator[Container]:
    """``podman run`` of the image with the checkpoints mounted as the Dockerfile's volumes expect (/models
    read-only; /adapters writable, owned by the image's user through podman's ``U`` option), its port published
    on 127.0.0.1, until /ready answers 200; removed on exit. ``command``: instead of the image's CMD."""
    models, adapters = volumes
    container = Container(f"tserve-test-{uuid.uuid4().hex[:8]}", f"http://127.0.0.1:{free_port()}")
    environ = {"TSERVE_THREADS": "1", "TSERVE_LOG_LEVEL": "info", **env}  # a shared 2-core machine: one thread
    podman("--runtime", "runc", "run", "--detach", "--name", container.name, "--publish",
           f"{container.url[7:]}:8000", "--volume", f"{models}:/models:ro", "--volume", f"{adapters}:/adapters:U",
           *[f"--volume={m}" for m in mounts], *[f"--env={k}={v}" for k, v in environ.items()], IMAGE, *command)
    try:
        def ready() -> bool:
            if not container.running():
                pytest.fail(f"the container exited before /ready:\n{container.logs()[-4000:]}")
            return httpx.get(container.url + "/ready", timeout=2).status_code == 200

        wait_for(ready, STARTUP_S, "/ready", lambda: container.logs()[-4000:])
        yield container
    finally:
        podman("rm", "--force", "--time", "0", container.name, check=False)


# ---- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> str:
    """The image (target runtime), built by scripts/podman-build: skip where podman cannot run a container."""
    if shutil.which("podman") is None:
        pytest.skip(f"podman is not installed: {SETUP}")
    if podman("image", "exists", BASE, check=False).returncode != 0:
        pytest.skip(f"the base image {BASE} is not built (no registry serves it here): {SETUP}")
    probe = podman("--runtime", "runc", "run", "--rm", BASE, "true", check=False)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container here ({probe.stderr.strip()[-500:]}): {SETUP}")
    build = subprocess.run(["bash", str(ROOT / "scripts/podman-build"), IMAGE], cwd=ROOT, capture_output=True,
                           text=True, timeout=1800)
    if build.returncode == 3:
        pytest.skip(f"scripts/podman-build: {build.stderr.strip()[-500:]}")
    assert build.returncode == 0, f"scripts/podman-build failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    return IMAGE


@pytest.fixture(scope="module")
def volumes(models_dir: Path, adapters_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(models, adapters): copies of the tiny checkpoints, their modes kept (the tests' own writes must not reach
    the session's fixtures). The image's user (uid 10001) reads them as the project wrote them: checkpoints and
    adapters are published world-readable (model/files.py)."""
    root = tmp_path_factory.mktemp("volumes")
    return shutil.copytree(models_dir, root / "models"), shutil.copytree(adapters_dir, root / "adapters")


@pytest.fixture(scope="module")
def served(image: str, volumes: tuple[Path, Path]) -> Iterator[Container]:
    """The image as built, its own CMD."""
    with running(volumes) as container:
        yield container


# ---- one container ----------------------------------------------------------------------------------


def test_serves_health_ready_generation_and_metrics_to_the_host(served: Container, volumes: tuple[Path, Path]):
    models, adapters = volumes
    with httpx.Client(base_url=served.url, timeout=60) as client:
        assert client.get("/health").json() == {"status": "ok"}
        ready = client.get("/ready")
        assert ready.status_code == 200 and sorted(ready.json()["models"]) == sorted([LM, MT, CLS])
        # The image computes what the code computes: greedy outputs equal model.generation's, offline, here.
        cases = [(MT, None, {"max_new_tokens": 12}), (LM, ADAPTERS[LM], {"max_new_tokens": 12})]
        for model, adapter, fields in cases:
            r = client.post(f"/v1/models/{model}/generate", json={"inputs": [PROMPT], "adapter": adapter, **fields})
            assert r.status_code == 200, r.text
            adapter_dir = adapters / model / adapter if adapter else None
            assert_same([GenerateOutput(**o) for o in r.json()["outputs"]],
                        offline(models / model, [PROMPT], fields, adapter_dir))
        samples = metric_samples(client.get("/metrics").text, "tserve_requests_total")
    counted = {(dict(k)["model"], dict(k)["adapter"]): v for k, v in samples.items()
               if dict(k)["endpoint"] == "generate" and dict(k)["status"] == "200"}
    assert counted == {(MT, ""): 1.0, (LM, ADAPTERS[LM]): 1.0}


def test_runs_as_the_non_root_user_with_read_only_checkpoints(served: Container):
    assert served.inspect("{{.Config.User}}") == USER
    status = served.exec("cat", "/proc/1/status").stdout  # the server itself, PID 1
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids == ["10001"] * 4, status
    assert served.exec("id", "-u").stdout.strip() == "10001"
    assert served.exec("touch", "/models/probe").returncode != 0, "/models is writable"
    assert served.exec("touch", "/adapters/probe").returncode == 0, "/adapters is not writable (uploads)"
    served.exec("rm", "-f", "/adapters/probe")


def test_runtime_has_no_compiler_and_loads_the_prebuilt_kernels(served: Container):
    assert served.exec("sh", "-c", "command -v g++ || command -v gcc || command -v c++").returncode != 0
    check = "from model import native; m, why = native.load(); print(m is not None, why)"
    loaded = served.exec("python", "-c", check)
    assert loaded.stdout.strip() == "True", loaded.stdout + loaded.stderr


def test_healthcheck_probes_health_and_passes(served: Container):
    config = json.loads(served.inspect("{{json .Config.Healthcheck}}"))
    assert "/health" in " ".join(config["Test"]) and config["StartPeriod"] == STARTUP_S * 1e9, config
    # podman schedules periodic checks with systemd timers (none in this sandbox); `healthcheck run` runs one.
    check = podman("healthcheck", "run", served.name, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert served.inspect("{{.State.Health.Status}}") == "healthy"


def test_sigterm_drains_the_request_in_flight_and_exits_0(image: str, volumes: tuple[Path, Path], tmp_path: Path):
    """A generation held in its model call (deploy/podman/gated_service.py) when `podman kill -s TERM` arrives
    is let go only once the server logs that it is shutting down (and refuses new connections); it still answers
    200, with the output it has without the signal, and the container exits 0. The signal takes podman's path
    (conmon, runc) to the server as PID 1."""
    gate = tmp_path / "gate"
    gate.mkdir()
    gated = ["python", "-m", "gated_service", "/gate", "--"]
    mounts = (f"{gate}:/gate:U", f"{ROOT / 'deploy/podman'}:/gate-bin:ro")
    body = {"inputs": [PROMPT], "max_new_tokens": 16}
    with running(volumes, *gated, mounts=mounts, PYTHONPATH="/gate-bin") as container:
        url = f"{container.url}/v1/models/{LM}/generate"
        expected = httpx.post(url, json=body, timeout=60).json()["outputs"]
        (gate / "hold").touch()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                in_flight = pool.submit(httpx.post, url, json=body, timeout=120)
                wait_for(lambda: (gate / f"parked-{LM}").exists(), 30, "the request held in its model call")
                podman("kill", "--signal", "TERM", container.name)
                wait_for(lambda: "Shutting down" in container.logs(), 30, "the server to begin shutting down",
                         container.logs)
                with pytest.raises(httpx.TransportError):  # no new connections once it is shutting down
                    httpx.get(container.url + "/health", timeout=5)
                assert not in_flight.done()
            finally:
                (gate / "hold").unlink(missing_ok=True)
            response = in_flight.result(timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == expected
        assert podman("wait", container.name, timeout_s=60).stdout.strip() == "0"


# ---- the compose stack --------------------------------------------------------------------------------

VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's ``${VAR}`` / ``${VAR:-default}`` in every string of ``value``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: env.get(m[1], m[2] or ""), value)
    return value


def podman_compose_file(volumes: tuple[Path, Path], prometheus_port: int) -> dict:
    """docker-compose.yml's `api` and `prometheus` services as podman 4.3 and Debian's podman-compose 1.0.3 run
    them. Changed: variables substituted here (1.0.3 leaves `${VAR:-}`, an empty default, as literal text: an API
    key); the checkpoints volume's `subpath` mounts (podman < 5 has none) become bind mounts of the test's
    checkpoints; Prometheus' image is Debian's prometheus built locally (no registry); ports on 127.0.0.1;
    relative paths made absolute. The rest, the Prometheus config (DNS service discovery of `api`) included,
    is the file's."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    api = interpolate(compose["services"]["api"], {})
    prometheus = interpolate(compose["services"]["prometheus"], {})
    models, adapters = volumes
    for key in ("build", "deploy"):
        api.pop(key)
    api["volumes"] = [f"{models}:/models:ro", f"{adapters}:/adapters:U"]
    api["environment"]["TSERVE_THREADS"] = "1"
    prometheus["image"] = PROMETHEUS_IMAGE
    prometheus["ports"] = [f"127.0.0.1:{prometheus_port}:9090"]
    prometheus["volumes"] = [str(ROOT / v[2:]) if v.startswith("./") else v for v in prometheus["volumes"]]
    named = {v.split(":")[0] for v in prometheus["volumes"] if not v.startswith("/")}
    return {"services": {"api": api, "prometheus": prometheus}, "volumes": {name: {} for name in named}}


@pytest.fixture
def compose_stack(image: str, volumes: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(project, Prometheus URL) of `podman-compose up -d` of the api and prometheus services."""
    if shutil.which("podman-compose") is None:
        pytest.skip(f"podman-compose is not installed: {SETUP}")
    if podman("image", "exists", PROMETHEUS_IMAGE, check=False).returncode != 0:
        pytest.skip(f"{PROMETHEUS_IMAGE} is not built (no registry serves prom/prometheus here): {SETUP}")
    port, project = free_port(), f"tserve-test-{uuid.uuid4().hex[:8]}"
    file = tmp_path / "compose.yml"
    file.write_text(yaml.safe_dump(podman_compose_file(volumes, port)))
    compose = ["podman-compose", "--podman-run-args=--runtime runc", "--project-name", project, "--file", str(file)]
    try:
        up = subprocess.run([*compose, "up", "--detach"], capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield project, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([*compose, "down", "--volumes"], capture_output=True, text=True, timeout=300)
        podman("network", "rm", "--force", f"{project}_default", check=False)


def test_compose_api_scraped_by_prometheus(compose_stack: tuple[str, str]):
    project, prometheus = compose_stack

    def logs() -> str:
        return "\n".join(podman("logs", f"{project}_{s}_1", check=False).stderr[-2000:] for s in ("api", "prometheus"))

    def tserve_targets() -> list[dict]:
        targets = httpx.get(prometheus + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        return [t for t in targets if t["labels"]["job"] == "tserve"]

    wait_for(lambda: httpx.get(prometheus + "/-/ready", timeout=2).status_code == 200, 60, "Prometheus ready", logs)
    # dns_sd_configs on `api` (refreshed every 10 s) finds the replica; scrapes every 5 s.
    wait_for(lambda: [t["health"] for t in tserve_targets()] == ["up"], 90, "the api target up", logs)
    api_ip = podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                    f"{project}_api_1").stdout.strip()
    (target,) = tserve_targets()
    assert target["labels"]["instance"] == f"{api_ip}:8000" and target["labels"]["service"] == "api", target

    def running_series() -> set[str]:
        r = httpx.get(prometheus + "/api/v1/query", params={"query": "tserve_num_requests_running"}, timeout=5)
        return {s["metric"]["model"] for s in r.json()["data"]["result"]}

    wait_for(lambda: running_series() == {LM, MT, CLS}, 30, "the api's metrics in Prometheus", logs)
