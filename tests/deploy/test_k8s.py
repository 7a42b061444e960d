"""The Kubernetes manifests (deploy/k8s), checked offline with the real tools: `kubectl kustomize` renders every
overlay and example; every object validates against the pinned Kubernetes API (kubernetes-validate, strict) or,
for a custom resource, against its CRD's schema (deploy/k8s/crds); checkov finds nothing, each skip justified in
the manifest; and the ports, probe paths, settings, drain budget and metric names agree with the service's own
code and with a real server's /metrics."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from model.native import KernelOptions
from service.__main__ import BACKSTOP_S
from service.api.routes import chat, openai
from service.api.routes.health import router as health_router
from service.engine.metrics import Metrics
from service.settings import Settings
from tests.deploy.conftest import ROOT
from tests.deploy.test_containers import exported_series_names, stages
from tests.service.server import running_server
from training.recipes import FAMILIES

K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.32.0"  # the API the manifests target; kubectl here is 1.32 too
KUSTOMIZATIONS = ("overlays/cpu", "overlays/gpu", "examples/keda", "examples/object-store",
                  "examples/inference-extension", "examples/kserve")
# Custom resources whose CRD is too large to vendor (the validation of the rest is in deploy/k8s/crds).
NOT_VALIDATED = {
    "HTTPRoute": "the Gateway API's HTTPRoute CRD is 340 kB",
    "InferenceService": "KServe's CRD is 2 MB; its predictor is validated as a core Pod (kserve_pod)",
}
# KServe's ComponentExtensionSpec: the predictor fields that are not PodSpec fields.
KSERVE_EXTENSION_FIELDS = {"minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "scaleMetricType",
                           "autoScaling", "containerConcurrency", "timeout", "canaryTrafficPercent", "logger",
                           "batcher", "labels", "annotations", "deploymentStrategy"}
CHECKOV_LOCK = K8S / "checkov-requirements.txt"
# pip's messages when PyPI cannot be reached (then the checkov test skips; any other install failure fails it).
UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
               "Network is unreachable", "ConnectTimeout", "ProxyError")


# ---- rendering -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` renders the manifests (kustomize v5 built in)")
    return found


def render(kubectl: str, path: Path) -> list[dict]:
    """The objects `kubectl kustomize` builds from ``path`` (what `kubectl apply -k` applies; the KServe example
    reads the base's settings files, outside its directory, so it needs the load restrictor off)."""
    loose = ["--load-restrictor", "LoadRestrictionsNone"] if path.name == "kserve" else []
    proc = subprocess.run([kubectl, "kustomize", *loose, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{path}: {proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(kubectl: str) -> dict[str, list[dict]]:
    return {name: render(kubectl, K8S / name) for name in KUSTOMIZATIONS}


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def kserve_pod(isvc: dict) -> dict:
    """The pod KServe runs for an InferenceService's predictor: its PodSpec fields, as a core Pod."""
    predictor = isvc["spec"]["predictor"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{isvc['metadata']['name']}-predictor", "namespace": isvc["metadata"]["namespace"],
                     "labels": predictor.get("labels", {}), "annotations": isvc["metadata"].get("annotations", {})},
        "spec": {k: v for k, v in predictor.items() if k not in KSERVE_EXTENSION_FIELDS},
    }


def server_pods(objects: list[dict]) -> Iterator[dict]:
    """The pod specs that run tserve: the Deployment `tserve`, or the InferenceService's predictor."""
    for deployment in find(objects, "Deployment", "tserve"):
        yield deployment["spec"]["template"]["spec"]
    for isvc in find(objects, "InferenceService"):
        yield kserve_pod(isvc)["spec"]


def server_container(pod: dict) -> dict:
    return next(c for c in pod["containers"] if c["name"] in ("tserve", "kserve-container"))


def container_env(container: dict, objects: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env (which wins)."""
    def data(kind: str, name: str) -> dict[str, str]:
        obj = one(objects, kind, name)
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
        return obj.get("data", {})

    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(data("ConfigMap", source["configMapRef"]["name"]))
        else:
            env.update(data("Secret", source["secretRef"]["name"]))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif ref := var.get("valueFrom", {}).get("secretKeyRef"):
            env[var["name"]] = data("Secret", ref["name"])[ref["key"]]
        elif ref := var.get("valueFrom", {}).get("configMapKeyRef"):
            env[var["name"]] = data("ConfigMap", ref["name"])[ref["key"]]
    return env


def test_every_kustomization_renders_into_one_namespace(rendered: dict[str, list[dict]]):
    for name, objects in rendered.items():
        assert list(server_pods(objects)), f"{name}: no tserve pods"
        ids = [(o["kind"], o["metadata"]["name"]) for o in objects]
        assert len(ids) == len(set(ids)), f"{name}: duplicate objects"
        namespace = one(objects, "Namespace")["metadata"]["name"]
        cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
        stray = [i for o, i in zip(objects, ids, strict=True)
                 if o["kind"] not in cluster_scoped and o["metadata"].get("namespace") != namespace]
        assert not stray, f"{name}: objects outside namespace {namespace}: {stray}"


# ---- schemas ---------------------------------------------------------------------------------------


def strict(schema: dict) -> dict:
    """A CRD's schema as the API server's strict field validation applies it: unknown fields are errors
    (structural schemas would otherwise prune them silently)."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    return out


@pytest.fixture(scope="module")
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict schema of every served version of every vendored CRD."""
    schemas = {}
    for path in sorted((K8S / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd:
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version["served"]:
                    schemas[(f"{group}/{version['name']}", kind)] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


def validation_errors(obj: dict, crd_schemas: dict[tuple[str, str], dict]) -> list[str]:
    """Why ``obj`` is not a valid object of the pinned API (empty: it is); a kind nobody knows is an error."""
    name = f"{obj['kind']}/{obj['metadata']['name']}"
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return []
    except kubernetes_validate.ValidationError as exc:
        return [f"{name}: {'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        pass
    schema = crd_schemas.get((obj["apiVersion"], obj["kind"]))
    if schema is None:
        return [] if obj["kind"] in NOT_VALIDATED else [f"{name}: no schema for {obj['apiVersion']}"]
    errors = jsonschema.Draft7Validator(schema).iter_errors(obj)
    return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors]


def test_every_object_validates_against_the_pinned_api(rendered, crd_schemas):
    errors, custom_kinds = [], set()
    for name, objects in rendered.items():
        for obj in objects + [kserve_pod(isvc) for isvc in find(objects, "InferenceService")]:
            errors += [f"{name}: {e}" for e in validation_errors(obj, crd_schemas)]
            if (obj["apiVersion"], obj["kind"]) in crd_schemas:
                custom_kinds.add(obj["kind"])
    assert not errors, "\n".join(errors)
    # Every vendored CRD is used: a renamed kind would otherwise fall through unvalidated.
    assert custom_kinds == {kind for _, kind in crd_schemas}


def test_validation_rejects_unknown_fields(rendered, crd_schemas):
    # Guards the test above against schemas that accept anything: a typo in a core and in a custom object.
    objects = rendered["overlays/cpu"]
    deployment = json.loads(json.dumps(one(objects, "Deployment", "tserve")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    monitor = json.loads(json.dumps(one(objects, "PodMonitor")))
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    assert "readinesProbe" in " ".join(validation_errors(deployment, crd_schemas))
    assert "podMetricEndpoints" in " ".join(validation_errors(monitor, crd_schemas))


# ---- checkov ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkov_python() -> Path:
    """The interpreter of checkov's own venv, .cache/checkov/<hash of the lock>/ (its pins conflict with the
    project's: deploy/k8s/checkov-requirements.txt); built on first use (about 30 s), under a file lock."""
    digest = hashlib.sha256(CHECKOV_LOCK.read_bytes()).hexdigest()[:12]
    cache = ROOT / ".cache" / "checkov"
    cache.mkdir(parents=True, exist_ok=True)
    venv, done = cache / digest, cache / f"{digest}.done"
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run building the same venv
        if not done.exists():
            shutil.rmtree(venv, ignore_errors=True)  # a build that was interrupted
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                                   "-q", "-r", str(CHECKOV_LOCK)], capture_output=True, text=True, timeout=600)
            output = proc.stdout + proc.stderr
            if proc.returncode != 0 and any(marker in output for marker in UNREACHABLE):
                pytest.skip(f"PyPI unreachable, cannot install checkov: {output.strip()[-500:]}")
            assert proc.returncode == 0, output[-3000:]
            done.touch()
    return venv / "bin" / "python"


BAD_POD = """apiVersion: v1
kind: Pod
metadata: {name: bad, namespace: default}
spec:
  containers:
    - name: bad
      image: busybox:latest
      securityContext: {privileged: true, allowPrivilegeEscalation: true}
"""


def checkov_results(python: Path, directory: Path) -> dict:
    proc = subprocess.run([str(python), "-m", "checkov.main", "-d", str(directory), "--framework", "kubernetes",
                           "--skip-download", "--compact", "-o", "json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]  # 1: some check failed
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    return report["results"]


def test_checkov_finds_nothing_and_every_skip_is_justified(rendered, checkov_python, tmp_path: Path):
    for name, objects in rendered.items():
        pods = [kserve_pod(isvc) for isvc in find(objects, "InferenceService")]  # checkov knows no KServe kinds
        (tmp_path / f"{name.replace('/', '-')}.yaml").write_text(yaml.safe_dump_all(objects + pods))
    (tmp_path / "bad.yaml").write_text(BAD_POD)
    results = checkov_results(checkov_python, tmp_path)

    failed = [f"{c['file_path']} {c['resource']} {c['check_id']} {c['check_name']}"
              for c in results["failed_checks"] if c["file_path"] != "/bad.yaml"]
    assert not failed, "\n".join(failed)
    # The guard: the same run does flag a privileged root pod, and it read every file.
    flagged = {c["check_id"] for c in results["failed_checks"] if c["file_path"] == "/bad.yaml"}
    assert {"CKV_K8S_16", "CKV_K8S_20", "CKV_K8S_21"} <= flagged
    scanned = {c["file_path"] for c in results["passed_checks"]}
    assert scanned == {f"/{p.name}" for p in tmp_path.glob("*.yaml")}
    for check in results["skipped_checks"]:
        reason = check["check_result"].get("suppress_comment") or ""
        assert len(reason) > 20, f"{check['resource']} skips {check['check_id']} without a reason"


# ---- agreement with the service ----------------------------------------------------------------------


def known_env_names() -> set[str]:
    return {f.metadata["env"] for f in fields(Settings)} | {f.metadata["env"] for f in fields(KernelOptions)}


def health_paths() -> dict[str, str]:
    """Route name -> path of the operations router (health, ready, metrics)."""
    return {route.name: route.path for route in health_router.routes}


def port_number(container: dict, port: str | int) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def test_settings_are_the_service_settings(rendered):
    known = known_env_names()
    for name, objects in rendered.items():
        for pod in server_pods(objects):
            container = server_container(pod)
            env = container_env(container, objects)
            unknown = {k for k in env if k.startswith("TSERVE_")} - known
            assert not unknown, f"{name}: not settings of the service: {unknown}"
            settings = Settings.from_env(env)  # parses and validates every value (SettingsError otherwise)
            assert settings.host == "0.0.0.0", f"{name}: the server must listen on the pod's address"
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            if "STORAGE_URI" in env:  # KServe mounts what STORAGE_URI names, read-only, at /mnt/models
                assert str(settings.models) == "/mnt/models", name
            else:
                assert mounts[str(settings.models)].get("readOnly") is True, f"{name}: models must be read-only"
            assert not mounts[str(settings.adapters)].get("readOnly"), f"{name}: adapter uploads need a writable volume"
            # Each model worker runs TSERVE_THREADS threads (service/engine/threads.py): together within the CPU limit.
            cpus = float(container["resources"]["limits"]["cpu"])
            assert settings.threads is not None and settings.threads * len(FAMILIES) <= cpus, name
            assert settings.device == ("cuda" if name == "overlays/gpu" else "cpu"), name
            assert ("nvidia.com/gpu" in container["resources"]["limits"]) == (settings.device == "cuda"), name
            # Read-only root filesystem, non-root as the image's own user.
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            uid = re.search(r"^USER\s+(\d+)", stages((ROOT / "Dockerfile").read_text())["runtime"], re.MULTILINE)
            assert pod["securityContext"]["runAsUser"] == int(uid.group(1)) and pod["securityContext"]["runAsNonRoot"]
    gateway_env = container_env(server_container(next(server_pods(rendered["examples/inference-extension"]))),
                                rendered["examples/inference-extension"])
    assert gateway_env.get("TSERVE_METRICS_COMPAT") == "vllm", "the InferencePool's pods export vLLM's names"


def test_probes_ports_and_scrape_paths_are_the_service_routes(rendered):
    paths = health_paths()
    for name, objects in rendered.items():
        pod = next(server_pods(objects))
        container = server_container(pod)
        port = int(container_env(container, objects)["TSERVE_PORT"])
        assert [p["containerPort"] for p in container["ports"]] == [port], name
        for probe, route in (("startupProbe", "health"), ("livenessProbe", "health"), ("readinessProbe", "ready")):
            get = container[probe]["httpGet"]
            assert get["path"] == paths[route], f"{name}: {probe}"
            assert port_number(container, get["port"]) == port, f"{name}: {probe} port"
        for service in find(objects, "Service"):
            if service["spec"]["selector"] == {"app": "tserve"}:
                assert port_number(container, service["spec"]["ports"][0]["targetPort"]) == port, name
        for monitor in find(objects, "PodMonitor"):
            endpoint = monitor["spec"]["podMetricsEndpoints"][0]
            assert endpoint["path"] == paths["metrics"], name
            assert port_number(container, endpoint["port"]) == port, name
        for pool in find(objects, "InferencePool"):
            assert pool["spec"]["targetPortNumber"] == port, name


def test_grace_period_covers_the_drain(rendered):
    drain_default = next(f.default for f in fields(Settings) if f.name == "drain_timeout_s")
    for name, objects in rendered.items():
        for pod in server_pods(objects):
            env = container_env(server_container(pod), objects)
            drain = float(env.get("TSERVE_DRAIN_TIMEOUT_S", drain_default))
            pre_stop = server_container(pod)["lifecycle"]["preStop"]["sleep"]["seconds"]
            # preStop runs first, then SIGTERM: the drain, then uvicorn's backstop, all before SIGKILL.
            assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + BACKSTOP_S, name
            for epp in find(objects, "Deployment", "tserve-epp"):
                assert epp["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= \
                    pod["terminationGracePeriodSeconds"], f"{name}: the EPP outlives the pool's drain"
        for hpa in find(objects, "HorizontalPodAutoscaler"):
            pdb = one(objects, "PodDisruptionBudget")
            assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"], f"{name}: a drain must leave a replica"


def test_dashboard_configmap_is_generated_from_the_grafana_file(rendered):
    board = (ROOT / "deploy" / "grafana" / "dashboards" / "tserve.json").read_text()
    for name in ("overlays/cpu", "overlays/gpu", "examples/kserve"):
        configmap = one(rendered[name], "ConfigMap", "tserve-grafana-dashboard")
        assert configmap["data"] == {"tserve.json": board}, name
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_inference_models_target_the_recipes_causal_lm_and_adapter(rendered):
    # Only causal LMs answer /v1/completions; "model:adapter" is how the OpenAI routes name an adapter.
    served = {f.model for f in FAMILIES if f.family == "causal_lm"}
    adapters = {f"{f.model}:{f.adapter}" for f in FAMILIES if f.family == "causal_lm"}
    models = find(rendered["examples/inference-extension"], "InferenceModel")
    targets = {t["name"] for m in models for t in m["spec"].get("targetModels", [])}
    bases = {m["spec"]["modelName"] for m in models if not m["spec"].get("targetModels")}
    assert targets and targets <= adapters and bases and bases <= served, (targets, bases)
    pool = one(rendered["examples/inference-extension"], "InferencePool")["metadata"]["name"]
    assert {m["spec"]["poolRef"]["name"] for m in models} == {pool}


def test_the_pool_routes_every_generation_route_that_names_its_model(rendered):
    # The endpoint picker reads the body's "model": the pool takes the OpenAI routes that generate (their bodies have
    # "model" and "max_tokens"), and nothing else.
    generation = set()
    for route in (*openai.router.routes, *chat.router.routes):
        body = route.body_field.field_info.annotation if route.body_field else None
        if body is not None and {"model", "max_tokens"} <= set(body.model_fields):
            generation.add(route.path)
    httproute = one(rendered["examples/inference-extension"], "HTTPRoute")
    paths = {m["path"]["value"] for rule in httproute["spec"]["rules"] for m in rule["matches"]}
    assert generation == {"/v1/completions", "/v1/chat/completions"} and paths == generation, (paths, generation)


# ---- metric names against a real server ------------------------------------------------------------


def autoscaler_queries(objects: list[dict]) -> dict[str, str]:
    """Where each autoscaler names its metric -> the metric name or PromQL."""
    out = {}
    for hpa in find(objects, "HorizontalPodAutoscaler"):
        out[f"HPA {hpa['metadata']['name']}"] = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    for scaled in find(objects, "ScaledObject"):
        out[f"ScaledObject {scaled['metadata']['name']}"] = scaled["spec"]["triggers"][0]["metadata"]["query"]
    for isvc in find(objects, "InferenceService"):
        metric = isvc["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"]["metric"]
        out[f"InferenceService {isvc['metadata']['name']}"] = metric["query"]
    return out


@pytest.fixture(scope="module")
def exposition(models_dir: Path, adapters_dir: Path) -> str:
    """A real server's /metrics, with the vLLM-compatible names on (ignored by a server without that setting)."""
    with running_server(models_dir, adapters_dir, TSERVE_METRICS_COMPAT="vllm") as server:
        return httpx.get(server.url + "/metrics", timeout=10).text


def test_autoscalers_scale_on_the_queue_metric_the_service_exports(rendered, exposition):
    waiting = Metrics().waiting.describe()[0].name  # the queue gauge of service/engine/metrics.py
    assert waiting in exported_series_names(exposition)
    queries = {f"{name}: {where}": query for name, objects in rendered.items()
               for where, query in autoscaler_queries(objects).items()}
    assert {where.split(": ")[1].split()[0] for where in queries} == {"HPA", "ScaledObject", "InferenceService"}
    rule = yaml.safe_load((K8S / "components/autoscaling-prometheus-adapter/prometheus-adapter-values.yaml")
                          .read_text())["rules"]["custom"][0]
    queries["prometheus-adapter rule"] = rule["seriesQuery"]
    queries["prometheus-adapter name"] = rule["name"]["as"]
    for where, query in queries.items():
        assert set(re.findall(r"\btserve_\w+", query)) == {waiting}, f"{where}: {query}"
    # KEDA's and KServe's queries select the namespace their pods run in (the PodMonitor's `namespace` label).
    for name, objects in rendered.items():
        namespace = one(objects, "Namespace")["metadata"]["name"]
        for where, query in autoscaler_queries(objects).items():
            if "{" in query:
                assert f'namespace="{namespace}"' in query, f"{name}: {where}"


def test_the_endpoint_picker_reads_metrics_the_service_exports(rendered, exposition):
    if "metrics_compat" not in {f.name for f in fields(Settings)}:
        pytest.skip("the service has no TSERVE_METRICS_COMPAT setting yet (vLLM-compatible metric names)")
    args = one(rendered["examples/inference-extension"], "Deployment", "tserve-epp")["spec"]["template"]["spec"]
    args = args["containers"][0]["args"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].endswith("Metric")}
    assert set(flags) == {"-totalQueuedRequestsMetric", "-kvCacheUsagePercentageMetric", "-loraInfoMetric"}
    missing = set(flags.values()) - exported_series_names(exposition)
    assert not missing, f"the EPP reads metrics the service does not export: {missing}"
