"""Container and stack files, checked without a Docker engine: hadolint on the Dockerfile, the compose
specification's JSON schema on docker-compose.yml, promtool on the Prometheus config, and the
dashboard's metric names against a real server's /metrics."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import yaml

from tests.deploy import dashboard
from tests.deploy.conftest import ROOT, venv_tool
from tests.service.server import running_server

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
# Every metric of the engine's contract the dashboard must chart (tserve_gpu_memory_bytes exists on
# CUDA only, so a CPU test could never see data for it: not on the dashboard).
CHARTED = (
    "tserve_requests_total", "tserve_e2e_request_latency_seconds_bucket", "tserve_request_queue_time_seconds_bucket",
    "tserve_time_to_first_token_seconds_bucket", "tserve_inter_token_latency_seconds_bucket",
    "tserve_batch_size_bucket", "tserve_num_requests_running", "tserve_num_requests_waiting",
    "tserve_generation_tokens_total", "tserve_resident_adapters", "tserve_adapter_loads_total",
    "tserve_adapter_unloads_total", "tserve_adapter_evictions_total",
)


def hadolint(dockerfile: str) -> list[dict]:
    """hadolint's findings (JSON) for a Dockerfile given as text."""
    proc = subprocess.run([venv_tool("hadolint"), "--no-fail", "-f", "json", "-"], input=dockerfile,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout or "[]")


# ---- Dockerfile ------------------------------------------------------------------------------------


def test_hadolint_finds_nothing_in_the_dockerfile():
    findings = hadolint(DOCKERFILE.read_text())
    serious = [f for f in findings if f["level"] in ("error", "warning")]
    assert not serious, "\n".join(f"line {f['line']} {f['code']} {f['level']}: {f['message']}" for f in serious)


def test_hadolint_does_flag_a_bad_dockerfile():
    # Guards the test above against a linter that silently checks nothing.
    codes = {f["code"] for f in hadolint("FROM python:latest\nRUN cd /tmp && pip install requests\n")}
    assert {"DL3007", "DL3003", "DL3013"} <= codes


def stages(text: str) -> dict[str, str]:
    """Stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", text)
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if m := re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\w+))?", line, re.IGNORECASE):
            name = m.group(2) or m.group(1)
            out[name] = line + "\n"
        elif name is not None and line.strip() and not line.lstrip().startswith("#"):
            out[name] += line + "\n"
    return out


def test_dockerfile_stages_user_healthcheck_volumes_and_pins():
    text = DOCKERFILE.read_text()
    parts = stages(text)
    assert list(parts) == ["build", "train", "runtime"]  # runtime last: the default target
    runtime = parts["runtime"]
    assert re.search(r"^USER\s+[1-9]\d*(:\d+)?$", runtime, re.MULTILINE), "runtime must run as a numeric non-root user"
    assert re.search(r"^HEALTHCHECK .*CMD .*/health", runtime, re.MULTILINE)
    assert re.search(r'^VOLUME \["/models", "/adapters"\]', runtime, re.MULTILINE)
    assert "COPY --from=build /opt/venv /opt/venv" in runtime
    assert "TSERVE_MODELS=/models" in runtime and "TSERVE_ADAPTERS=/adapters" in runtime
    # The CUDA switch is a build argument; the default is the CPU wheel index.
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+\.\d+-slim-\w+", text, re.MULTILINE)
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    for image in re.findall(r"^ARG \w+_IMAGE=(\S+)", text, re.MULTILINE):
        assert re.search(r":\d+\.\d+\.\d+", image), f"base image {image} is not pinned to an exact version tag"
    # Dependencies come from the pinned files only.
    assert "-r /tmp/deps/requirements.txt -r /tmp/deps/requirements-otel.txt" in parts["build"]
    assert "-c /tmp/deps/constraints.txt" in parts["build"]
    assert "torch==2.13.0" in (ROOT / "requirements.txt").read_text().split()


def test_dockerignore_keeps_the_context_small_and_secret_free():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".cache", "checkpoints", "data", "runs"} <= ignored


# ---- docker-compose.yml ------------------------------------------------------------------------------


def check_compose(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([venv_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_compose_file_validates_against_the_compose_specification():
    proc = check_compose(COMPOSE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_schema_does_reject_a_bad_file(tmp_path: Path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  api:\n    image: x\n    deploy:\n      replicas: many\n    profile: gpu\n")
    assert check_compose(bad).returncode != 0


def test_compose_services_profiles_and_mounts():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"api", "api-gpu", "lb", "prometheus", "grafana", "train"} <= set(services)
    api, gpu, train = services["api"], services["api-gpu"], services["train"]
    assert "ports" not in api, "api publishes no host port, so that --scale api=N works (lb publishes)"
    mounts = {v["target"]: v for v in api["volumes"]}  # one volume: the recipe's models/ and adapters/
    assert mounts["/models"]["source"] == mounts["/adapters"]["source"] == "checkpoints"
    assert mounts["/models"]["volume"]["subpath"] == "models" and mounts["/models"]["read_only"] is True
    assert mounts["/adapters"]["volume"]["subpath"] == "adapters" and not mounts["/adapters"].get("read_only")
    assert gpu["profiles"] == ["gpu"] and "api" in gpu["networks"]["default"]["aliases"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "TORCH_INDEX" in gpu["build"]["args"] and "BASE_IMAGE" in gpu["build"]["args"]
    assert train["profiles"] == ["train"] and train["build"]["target"] == "train"
    assert train["volumes"] == ["checkpoints:/checkpoints"]
    for service in services.values():  # every bind-mounted file or folder exists in the repository
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{source} is mounted but missing"


def interpolated(words: list[str]) -> list[str]:
    """Compose's ${VAR:-default} with every variable unset."""
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", w) for w in words]


def test_compose_train_command_is_the_recipe_and_parses():
    from training.cli import build_parser

    command = interpolated(yaml.safe_load(COMPOSE.read_text())["services"]["train"]["command"])
    assert command[:4] == ["python", "-m", "training", "recipe"]
    args = build_parser().parse_args(command[3:])  # the CLI accepts it (argparse exits on an error)
    assert str(args.out) == "/checkpoints" and str(args.data).startswith("/checkpoints/")
    # The image's default command is the same recipe, for `docker run tserve:train`.
    cmd = re.search(r"^CMD (\[.*\])$", stages(DOCKERFILE.read_text())["train"], re.MULTILINE).group(1)
    assert json.loads(cmd)[:6] == command[:6]


def test_nginx_accepts_the_load_balancer_config(nginx_bin: Path, tmp_path: Path):
    config = ROOT / "deploy" / "nginx" / "nginx.conf"
    text = config.read_text()
    assert "http://api:8000" in text and "resolver 127.0.0.11" in text and "proxy_buffering off" in text
    proc = subprocess.run([str(nginx_bin), "-t", "-p", str(tmp_path), "-c", str(config), "-e", "stderr"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "test is successful" in proc.stderr, proc.stderr


def test_grafana_provisioning_points_at_the_dashboard_and_datasource():
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tserve.yml").read_text())
    uid = datasources["datasources"][0]["uid"]
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    board = dashboard.load(GRAFANA / "dashboards" / "tserve.json")
    source_var = next(v for v in board["templating"]["list"] if v["type"] == "datasource")
    assert source_var["current"]["value"] == uid
    ids = [p["id"] for p in dashboard.panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


# ---- Prometheus config -----------------------------------------------------------------------------


def promtool(prometheus_bin: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(prometheus_bin / "promtool"), *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_prometheus_config(prometheus_bin: Path):
    proc = promtool(prometheus_bin, "check", "config", str(PROMETHEUS_CONFIG))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_rejects_a_broken_config(prometheus_bin: Path, tmp_path: Path):
    broken = tmp_path / "prometheus.yml"
    broken.write_text("scrape_configs:\n  - job_name: x\n    scrape_interval: often\n")
    assert promtool(prometheus_bin, "check", "config", str(broken)).returncode != 0


# ---- the dashboard against the service's real metric names ------------------------------------------


def exported_series_names(exposition: str) -> set[str]:
    """Sample names a scrape can yield: from the `# TYPE` lines, since a labelled family is listed
    before its first sample (counters appear there with their `_total`), and from the samples."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", exposition, re.MULTILINE))
    for family, kind in re.findall(r"^# TYPE (\S+) (\w+)$", exposition, re.MULTILINE):
        base = family.removesuffix("_total") if kind == "counter" else family
        names.update(base + suffix for suffix in suffixes.get(kind, ("",)))
    return names


def test_dashboard_queries_only_metrics_the_service_exports(models_dir: Path, adapters_dir: Path):
    with running_server(models_dir, adapters_dir) as server:
        exposition = httpx.get(server.url + "/metrics", timeout=10).text
    exported = exported_series_names(exposition)
    queries = dashboard.queries() + [dashboard.Query("variables", n, n, q) for n, q in dashboard.variable_queries()]
    assert queries, "no dashboard queries found"
    unknown = {q.panel: dashboard.metric_names(q.expr) - exported for q in queries}
    unknown = {panel: names for panel, names in unknown.items() if names}
    assert not unknown, f"dashboard queries metrics the service does not export: {unknown}"
    used = set().union(*(dashboard.metric_names(q.expr) for q in queries))
    assert set(CHARTED) <= used, f"not charted: {sorted(set(CHARTED) - used)}"


def test_every_dashboard_query_is_valid_promql(prometheus_bin: Path, tmp_path: Path):
    # promtool parses each expression as a recording rule would (syntax and types), with no server.
    queries = dashboard.queries()
    rules = [{"record": f"tserve:check_{i}", "expr": dashboard.substitute(q.expr)} for i, q in enumerate(queries)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = promtool(prometheus_bin, "check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(queries)} rules found" in proc.stdout
