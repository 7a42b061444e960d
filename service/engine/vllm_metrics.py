"""vLLM's names for the gauges a gateway routes by (``--metrics-compat vllm``), computed at each scrape.

The Gateway API Inference Extension's endpoint picker reads a model server's queue, KV-cache use and LoRA
adapters under vLLM's metric names (its model-server protocol). With this collector registered, /metrics also
carries, next to the ``tserve_`` metrics:

- ``vllm:num_requests_waiting`` / ``vllm:num_requests_running`` {model_name}: requests queued / being computed;
- ``vllm:kv_cache_usage_perc`` {model_name}, and its older name ``vllm:gpu_cache_usage_perc``: the share of the
  model's batch in use, 0 to 1 (the rows the running requests reserve over ``max_batch_size``). tserve's KV cache
  has no fixed pool of blocks: it holds exactly the running rows, and a full batch is what makes new requests
  wait, as a full block pool does in vLLM;
- ``vllm:lora_requests_info`` {running_lora_adapters, waiting_lora_adapters, max_lora}: one series whose value is
  the time of the scrape (the picker keeps the latest), listing the adapters of running and waiting requests as
  the OpenAI routes name them ("model:adapter", comma-separated), and how many adapters a model keeps resident.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from service.engine.engine import Engine
    from service.engine.jobs import Job

COMPAT_MODES = ("none", "vllm")


def _adapters(model: str, jobs: list[Job]) -> list[str]:
    """The distinct adapters of ``jobs`` as "model:adapter", in order of first appearance."""
    return list(dict.fromkeys(f"{model}:{job.adapter_name}" for job in jobs if job.adapter_name is not None))


class VllmCompatCollector(Collector):
    """The engine's queue, batch use and adapters under vLLM's metric names (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued", labels=["model_name"])
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests being computed", labels=["model_name"])
        usage = [GaugeMetricFamily(name, "Share of the model's batch in use (running rows / max_batch_size), 0-1",
                                   labels=["model_name"])
                 for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")]
        running_adapters: list[str] = []
        waiting_adapters: list[str] = []
        settings = self.engine.settings
        for worker in self.engine.workers():
            queued, computing = worker.scheduler.waiting_jobs(), worker.scheduler.running_jobs()
            waiting.add_metric([worker.name], len(queued))
            running.add_metric([worker.name], len(computing))
            for family in usage:
                family.add_metric([worker.name], min(1.0, sum(job.rows for job in computing) / settings.max_batch_size))
            running_adapters += _adapters(worker.name, computing)
            waiting_adapters += _adapters(worker.name, queued)
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters (value: the time of "
                                 "this report)", labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        lora.add_metric([",".join(running_adapters), ",".join(waiting_adapters), str(settings.max_resident_adapters)],
                        time.time())
        yield from (waiting, running, *usage, lora)
