"""What the service adds over the model: one 128-token greedy generation at batch 1, three ways.

- offline: ``model.generation.generate_causal`` on the prompt's ids;
- engine: ``service.engine.worker.ModelWorker.generate`` in this process (scheduler thread, searches, detokenising);
- HTTP: ``POST /v1/models/<name>/generate`` to ``python -m service`` on 127.0.0.1 (uvicorn), one client.

Runs alternate; the server process and this one both use one intra-op thread.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from model.checkpoint import load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_causal
from model.layout import use_input_major_weights

PROMPT = "the service adds what over the engine"


def measure(models_dir: Path, name: str, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds per generation for "offline", "engine" and "http"."""
    from service.api.convert import generation_request
    from service.api.schemas import GenerateRequest
    from service.engine.engine import Engine
    from service.engine.types import EngineSettings
    from service.local_server import running_server

    ckpt = load_checkpoint(models_dir / name, device="cpu")
    use_input_major_weights(ckpt.model)  # as the engine does
    prompt = ckpt.tokenizer.encode(PROMPT, add_bos=True)  # what the engine feeds for this text
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=ckpt.config.eos_id)
    request = generation_request(GenerateRequest(inputs=[PROMPT], max_new_tokens=new_tokens, min_new_tokens=new_tokens))
    body = {"inputs": [PROMPT], "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    loop = asyncio.new_event_loop()
    engine = Engine(EngineSettings(device="cpu", dtype="float32"), models_dir, None)
    loop.run_until_complete(engine.start())
    worker = engine.get(name)
    counter = iter(range(1_000_000))

    def offline() -> int:
        return len(generate_causal(ckpt.model, [prompt], config)[0][0].tokens)

    def in_engine() -> int:
        out = loop.run_until_complete(worker.generate(request, f"bench-{next(counter)}"))
        return len(out[0].tokens)

    times: dict[str, list[float]] = {"offline": [], "engine": [], "http": []}
    try:
        with running_server(models_dir, TSERVE_THREADS="1") as server, server.client(timeout=300.0) as client:

            def http() -> int:
                response = client.post(f"/v1/models/{name}/generate", json=body)
                response.raise_for_status()
                return len(response.json()["outputs"][0]["tokens"])

            runs = {"offline": offline, "engine": in_engine, "http": http}
            for fn in runs.values():  # warm-up
                fn()
            for i in range(repeats):
                for key in list(runs)[i % 3:] + list(runs)[: i % 3]:  # rotate the order
                    start = time.perf_counter()
                    produced = runs[key]()
                    times[key].append(time.perf_counter() - start)
                    if produced != new_tokens:
                        raise RuntimeError(f"{key} produced {produced} tokens, expected {new_tokens}")
    finally:
        loop.run_until_complete(engine.stop(5.0))
        loop.close()
    return {k: statistics.median(v) for k, v in times.items()}


__all__ = ["measure"]
