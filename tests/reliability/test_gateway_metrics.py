"""vLLM's metric names for a gateway (``TSERVE_METRICS_COMPAT=vllm``), read from a real server's /metrics while a
test holds its worker (gated_server.py): the queue, the running requests, the batch in use and the running and
waiting adapters are what the server is doing; off by default."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client import generate_latest

from service.api.app import create_app
from service.engine.engine import Engine
from service.settings import Settings
from tests.helpers import wait_until
from tests.reliability.gated_server import ServerGate
from tests.service.conftest import ADAPTERS, LM
from tests.service.server import metric_samples, running_server

LORA_INFO = "vllm:lora_requests_info"


def gauges(url: str) -> dict[str, float | dict]:
    """The vLLM-named gauges of model LM, and the adapter report's labels and value."""
    text = httpx.get(url + "/metrics").text
    out: dict[str, float | dict] = {
        name: metric_samples(text, name).get((("model_name", LM),), -1.0)
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "vllm:gpu_cache_usage_perc")}
    (labels, value), = metric_samples(text, LORA_INFO).items()
    out[LORA_INFO] = {**dict(labels), "value": value}
    return out


def test_the_gateway_gauges_follow_the_queue_and_the_adapters(models_dir, adapters_dir, tmp_path):
    gate = ServerGate(tmp_path / "gate")
    adapter = f"{LM}:{ADAPTERS[LM]}"

    async def phase(client: httpx.AsyncClient, url: str, running: str | None, waiting: str | None) -> dict:
        """Hold a request of adapter ``running`` in the worker and queue one of ``waiting``; report the gauges."""
        def send(adapter_name: str | None):
            fields = {"inputs": ["hello"], "max_new_tokens": 2} | ({"adapter": adapter_name} if adapter_name else {})
            return asyncio.ensure_future(client.post(f"/v1/models/{LM}/generate", json=fields))

        gate.hold()
        first = send(running)
        await wait_until(lambda: gate.parked(LM))
        second = send(waiting)
        await wait_until(lambda: gauges(url)["vllm:num_requests_waiting"] == 1)
        seen = gauges(url)
        gate.release()
        responses = await asyncio.gather(first, second)
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return seen

    async def main(url: str) -> tuple[dict, dict, dict]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            base_runs = await phase(client, url, None, ADAPTERS[LM])
            adapter_runs = await phase(client, url, ADAPTERS[LM], None)
            return base_runs, adapter_runs, gauges(url)

    before = time.time()
    with running_server(models_dir, adapters_dir, module_args=gate.args(), TSERVE_MAX_BATCH_SIZE="1",
                        TSERVE_METRICS_COMPAT="vllm", TSERVE_MAX_RESIDENT_ADAPTERS="3") as server:
        base_runs, adapter_runs, idle = asyncio.run(main(server.url))
    for seen, running, waiting in ((base_runs, "", adapter), (adapter_runs, adapter, "")):
        assert (seen["vllm:num_requests_waiting"], seen["vllm:num_requests_running"]) == (1, 1)
        assert seen["vllm:kv_cache_usage_perc"] == seen["vllm:gpu_cache_usage_perc"] == 1.0  # 1 row of 1
        info = seen[LORA_INFO]
        assert (info["running_lora_adapters"], info["waiting_lora_adapters"], info["max_lora"]) == (running, waiting,
                                                                                                      "3")
        assert info["value"] >= before  # the time of the report: the picker keeps the latest
    assert (idle["vllm:num_requests_waiting"], idle["vllm:num_requests_running"], idle["vllm:kv_cache_usage_perc"]) \
        == (0, 0, 0)
    assert (idle[LORA_INFO]["running_lora_adapters"], idle[LORA_INFO]["waiting_lora_adapters"]) == ("", "")


def test_the_vllm_names_are_exported_only_when_asked_for(models_dir):
    for mode, present in (("none", False), ("vllm", True)):
        engine = Engine(Settings(models=models_dir, metrics_compat=mode).engine_settings(), models_dir, None)
        create_app(Settings(models=models_dir, metrics_compat=mode), engine)
        text = generate_latest(engine.metrics.registry).decode()
        assert ("vllm:num_requests_waiting" in text) is present and ("tserve_num_requests_waiting" in text)
