"""A real Prometheus scrapes a real server every second while the test sends traffic; then every
PromQL query of every dashboard panel must return data through Prometheus's HTTP API."""

from __future__ import annotations

import concurrent.futures
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy import dashboard
from tests.deploy.conftest import ROOT
from tests.service.conftest import LM, MT, make_adapter
from tests.service.server import Server, free_port, running_server, stop

SCRAPE_INTERVAL_S = 1.0
CLS = "tiny-cls"


def scrape_config(deployed: Path, target: str) -> dict:
    """deploy/prometheus/prometheus.yml with its api job pointed at `target` and a 1 s interval."""
    config = yaml.safe_load(deployed.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == "tserve"]
    assert len(jobs) == 1, "deploy/prometheus/prometheus.yml has no single `tserve` job"
    job = jobs[0]
    job.pop("dns_sd_configs")  # Docker's DNS name `api` -> the test server
    job["static_configs"] = [{"targets": [target]}]
    config["scrape_configs"] = [job]
    return config


@pytest.fixture(scope="module")
def adapters_two(adapters_dir: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture adapters plus a second one for the LM, so that one resident slot forces evictions."""
    root = tmp_path_factory.mktemp("deploy-adapters") / "adapters"
    shutil.copytree(adapters_dir, root)
    make_adapter(models_dir / LM, root / LM / "lm-b", seed=2)
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, adapters_two: Path) -> Iterator[Server]:
    with running_server(models_dir, adapters_two, TSERVE_MAX_RESIDENT_ADAPTERS="1", TSERVE_MAX_WAIT_MS="20") as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(prometheus_bin: Path, server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Prometheus on a free 127.0.0.1 port scraping `server`."""
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(ROOT / "deploy/prometheus/prometheus.yml", server.url[7:])))
    check = subprocess.run([str(prometheus_bin / "promtool"), "check", "config", str(config)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = work / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(prometheus_bin / "prometheus"), f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            cwd=work, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/-/ready", timeout=1).status_code == 200, 30, "Prometheus ready",
                 process, log)
        wait_for(lambda: target_health(url) == "up", 30, "the tserve target up", process, log)
        yield url
    finally:
        stop(process)


def target_health(url: str) -> str | None:
    targets = httpx.get(url + "/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
    return next((t["health"] for t in targets if t["labels"]["job"] == "tserve"), None)


def wait_for(condition, timeout_s: float, what: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if condition():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def send_traffic(client: httpx.Client) -> None:
    """Every kind of request the dashboard charts: generation (batched, streamed, with adapters that
    evict each other), classification, adapter load and unload, and requests that fail."""
    def generate(model: str, **body) -> None:
        r = client.post(f"/v1/models/{model}/generate", json={"max_new_tokens": 8, "min_new_tokens": 4, **body})
        assert r.status_code == 200, r.text

    # Load first: the unload at the end of the previous round made the server forget mt-a.
    assert client.put(f"/v1/models/{MT}/adapters/mt-a").status_code == 200, "load"
    calls = [
        lambda: generate(MT, inputs=["the cat sat on the mat", "hello world"], strategy="beam", num_beams=2),
        lambda: generate(MT, inputs=["all that glitters is not gold"], adapter="mt-a"),
        lambda: generate(LM, inputs=["hello"], strategy="sample", seed=1),
        lambda: generate(LM, inputs=["a journey of"], strategy="sample", seed=2),
        lambda: generate(LM, inputs=["all that"]),
        lambda: generate(LM, inputs=["the cat sat on the mat and the cat sat on the mat and the cat"],
                         max_new_tokens=24, speculative={"method": "ngram", "num_tokens": 4}),  # drafts once it repeats
    ]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:  # concurrent: batches of several rows
        for future in [pool.submit(call) for call in calls]:
            future.result()
    # One resident adapter slot per model (TSERVE_MAX_RESIDENT_ADAPTERS=1): each of these evicts the other.
    generate(LM, inputs=["the quick brown fox"], adapter="lm-a")
    generate(LM, inputs=["to be or not to be"], adapter="lm-b")
    with client.stream("POST", f"/v1/models/{LM}/generate",
                       json={"inputs": ["the cat"], "max_new_tokens": 6, "min_new_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    r = client.post(f"/v1/models/{CLS}/classify", json={"inputs": ["all good", ["a", "b"]], "adapter": "cls-a"})
    assert r.status_code == 200, r.text
    assert client.post(f"/v1/models/{CLS}/classify", json={"inputs": ["fine"]}).status_code == 200
    assert client.delete(f"/v1/models/{MT}/adapters/mt-a").status_code == 204, "unload"
    # Errors: an adapter the model does not have (404) and an invalid body (422).
    assert client.post(f"/v1/models/{CLS}/classify", json={"inputs": ["x"], "adapter": "nope"}).status_code == 404
    assert client.post(f"/v1/models/{LM}/generate", json={"inputs": []}).status_code == 422


def query(url: str, promql: str) -> dict:
    r = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=10)
    assert r.status_code == 200, f"{promql}: {r.status_code} {r.text}"
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]


def finite_samples(data: dict) -> list[float]:
    if data["resultType"] == "vector":
        values = [float(s["value"][1]) for s in data["result"]]
    elif data["resultType"] == "scalar":
        values = [float(data["result"][1])]
    else:
        values = [float(v[1]) for s in data["result"] for v in s["values"]]
    return [v for v in values if math.isfinite(v)]


def requests_counted(exposition: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
               if line.startswith("tserve_requests_total{"))


def wait_scraped(prometheus: str, server: Server, timeout_s: float = 30.0) -> None:
    """Until Prometheus holds a scrape taken after the traffic so far (its request count caught up)."""
    want = requests_counted(httpx.get(server.url + "/metrics", timeout=10).text)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = query(prometheus, "sum(tserve_requests_total)")["result"]
        if result and float(result[0]["value"][1]) >= want:
            return
        time.sleep(SCRAPE_INTERVAL_S / 4)
    raise TimeoutError(f"Prometheus did not catch up with {want} requests in {timeout_s} s")


def test_every_dashboard_query_returns_data(server: Server, prometheus: str):
    with server.client() as client:
        # Two rounds, each followed by a scrape: a series first seen at its first increment has no
        # earlier sample, so rate() over it needs the second round's increase to be non-zero (and
        # the quantiles not NaN).
        send_traffic(client)
        wait_scraped(prometheus, server)
        send_traffic(client)
    wait_scraped(prometheus, server)

    queries = dashboard.queries()
    assert len(queries) >= 20
    empty = {}
    for q in queries:
        data = query(prometheus, dashboard.substitute(q.expr))
        if not finite_samples(data):
            empty[str(q)] = data["result"]
    assert not empty, "dashboard queries without data:\n" + "\n".join(f"{k}\n  -> {v}" for k, v in empty.items())

    # The template variables list the models and adapters that had traffic.
    for name, variable in dashboard.variable_queries():
        m = dashboard.LABEL_VALUES.match(variable)
        assert m, f"variable {name}: unsupported query {variable!r}"
        params = {"match[]": dashboard.substitute(m.group("selector"))} if m.group("selector") else {}
        r = httpx.get(f"{prometheus}/api/v1/label/{m.group('label')}/values", params=params, timeout=10)
        values = set(r.json()["data"])
        expected = {LM, MT, CLS} if name == "model" else {"lm-a", "lm-b", "mt-a", "cls-a"}
        assert expected <= values, f"variable {name}: {values}"

    # Spot-check that the numbers mean what the panels say.
    by_model = {s["metric"]["model"]: float(s["value"][1]) for s in query(
        prometheus, 'sum by (model) (tserve_adapter_evictions_total)')["result"]}
    assert by_model.get(LM, 0) >= 1, f"expected LM adapter evictions with one resident slot: {by_model}"
    statuses = {s["metric"]["status"] for s in query(prometheus, "sum by (status) (tserve_requests_total)")["result"]}
    assert {"200", "404", "422"} <= statuses
