"""Every Prometheus collector of the service, on one registry per engine (vLLM's names, ``tserve_`` prefix).

A dedicated ``CollectorRegistry`` (not the global default) lets tests build several engines in one
process; the HTTP layer serves ``generate_latest(metrics.registry)``.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

# Seconds, from a fast GPU step (~1 ms) to a slow CPU request (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def adapter_label(adapter: str | None) -> str:
    """Label value for "no adapter" is the empty string."""
    return adapter or ""


class Metrics:
    """The collectors; labels ``model`` (directory name), ``endpoint``, ``adapter`` ("" = base) where meaningful."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tserve_requests", "Requests finished, by outcome (incremented by the HTTP layer)",
                                ["model", "endpoint", "adapter", "status"], registry=r)
        self.e2e_latency = Histogram("tserve_e2e_request_latency_seconds", "Submission to result, per request",
                                     ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("tserve_request_queue_time_seconds", "Time a request waited before compute",
                                    ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tserve_time_to_first_token_seconds", "Submission to first generated token",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tserve_inter_token_latency_seconds", "Time between two tokens of one request",
                             ["model"], buckets=ITL_BUCKETS, registry=r)
        self.batch_size = Histogram("tserve_batch_size", "Rows (generation) or inputs (classify/embed) per model step",
                                    ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.running = Gauge("tserve_num_requests_running", "Requests being computed", ["model"], registry=r)
        self.waiting = Gauge("tserve_num_requests_waiting", "Requests queued", ["model"], registry=r)
        self.prompt_tokens = Counter("tserve_prompt_tokens", "Input tokens processed", ["model", "adapter"],
                                     registry=r)
        self.generation_tokens = Counter("tserve_generation_tokens", "Tokens generated (every row of every step)",
                                         ["model", "adapter"], registry=r)
        self.adapter_loads = Counter("tserve_adapter_loads", "LoRA adapters loaded into a model", ["model"],
                                     registry=r)
        self.adapter_unloads = Counter("tserve_adapter_unloads", "LoRA adapters unloaded on request", ["model"],
                                       registry=r)
        self.adapter_evictions = Counter("tserve_adapter_evictions", "Idle LoRA adapters evicted (LRU)", ["model"],
                                         registry=r)
        self.resident_adapters = Gauge("tserve_resident_adapters", "LoRA adapters in memory", ["model"], registry=r)
        self.model_load_seconds = Gauge("tserve_model_load_seconds", "Time to load the checkpoint", ["model"],
                                        registry=r)
        self.prefix_cache_queries = Counter("tserve_prefix_cache_queries", "Prompt / source tokens looked up in the "
                                            "prefix cache", ["model"], registry=r)
        self.prefix_cache_hits = Counter("tserve_prefix_cache_hits", "Prompt / source tokens found in the prefix "
                                         "cache (their K/V reused, not computed)", ["model"], registry=r)
        self.prefix_cache_bytes = Gauge("tserve_prefix_cache_bytes", "Memory held by the prefix cache", ["model"],
                                        registry=r)
        self.kv_cache_bytes = Gauge("tserve_kv_cache_bytes", "KV cache memory of the running batch (its buffers and "
                                    "the cached prefix blocks its rows read, each once)", ["model"], registry=r)
        self.spec_draft_tokens = Counter("tserve_spec_decode_draft_tokens", "Draft tokens proposed by speculative "
                                         "decoding", ["model"], registry=r)
        self.spec_accepted_tokens = Counter("tserve_spec_decode_accepted_tokens", "Draft tokens the model's own "
                                            "choice confirmed (the acceptance rate is their ratio)", ["model"],
                                            registry=r)
        self.static_steps = Counter("tserve_static_steps", "Decoding steps of the running batch by path (TSERVE_CUDA_"
                                    "GRAPHS): static (the static step, a CUDA graph on a GPU), or why one ran eagerly "
                                    "(rows, width, length, vocabulary, head_copies, source)", ["model", "path"],
                                    registry=r)
        self._gpu_memory: Gauge | None = None
        self._lock = threading.Lock()  # workers of several CUDA models may report at once

    def record_request(self, model: str, endpoint: str, adapter: str | None, status: int | str) -> None:
        """Count one finished HTTP request (the HTTP layer calls this once per request)."""
        self.requests.labels(model, endpoint, adapter_label(adapter), str(status)).inc()

    def remove_model(self, model: str) -> None:
        """Drop every series labelled ``model`` (a model unloaded, or failed to load): /metrics stops reporting it."""
        for collector in vars(self).values():
            if isinstance(collector, MetricWrapperBase) and collector is not self._gpu_memory:
                collector.remove_by_labels({"model": model})

    def gpu_memory(self, device: str, allocated: int) -> None:
        """Set ``tserve_gpu_memory_bytes{device}``; the gauge exists only once a CUDA model reports."""
        with self._lock:
            if self._gpu_memory is None:
                self._gpu_memory = Gauge("tserve_gpu_memory_bytes", "CUDA memory allocated by torch", ["device"],
                                         registry=self.registry)
        self._gpu_memory.labels(device).set(allocated)
