"""Priorities and the per-API-key queue cap, on a real server whose worker a test holds (gated_server.py): waiting
requests are taken by priority, FIFO within one, whatever the endpoint; a key over its cap (requests waiting or
running) gets 429, other keys do not."""

from __future__ import annotations

import asyncio

import httpx

from tests.helpers import wait_until
from tests.reliability.gated_server import ServerGate
from tests.service.conftest import CLS, LM
from tests.service.server import metric_samples, running_server


def waiting(url: str, model: str) -> float:
    return metric_samples(httpx.get(url + "/metrics").text, "tserve_num_requests_waiting").get(
        (("model", model),), 0.0)


def first_calls(gate: ServerGate, model: str) -> list[str]:
    """Request ids in the order the worker first ran them (the start-up warm-up left out)."""
    seen: list[str] = []
    for ids in gate.calls(model):
        seen += [i for i in ids if i not in seen and not i.startswith("warmup-")]
    return seen


async def queue_in_order(url: str, model: str, sends: list, already: int = 0) -> list[asyncio.Task]:
    """Start each send once the previous one is queued, so that their arrival order is the list's."""
    tasks = []
    for i, send in enumerate(sends):
        tasks.append(asyncio.ensure_future(send()))
        await wait_until(lambda n=already + i + 1: waiting(url, model) == n or any(t.done() for t in tasks))
    return tasks


def test_waiting_requests_are_taken_by_priority_then_arrival(models_dir, tmp_path):
    gate = ServerGate(tmp_path / "gate")
    order = [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]

    async def main(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            def generate(rid: str, priority: int):
                return lambda: client.post(f"/v1/models/{LM}/generate", headers={"X-Request-ID": rid},
                                           json={"inputs": ["hello"], "max_new_tokens": 3, "priority": priority})

            gate.hold()
            first = asyncio.ensure_future(generate("first", 100)())
            await wait_until(lambda: gate.parked(LM))  # taken: it runs whatever comes next
            tasks = await queue_in_order(url, LM, [generate(rid, p) for rid, p in order])
            gate.release()
            return await asyncio.gather(first, *tasks)

    with running_server(models_dir, None, module_args=gate.args(), TSERVE_MAX_BATCH_SIZE="1") as server:
        responses = asyncio.run(main(server.url))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert first_calls(gate, LM) == ["first", "d", "b", "e", "a", "c"]


def test_priorities_order_classification_and_completions_too(models_dir, tmp_path):
    gate = ServerGate(tmp_path / "gate")

    async def main(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            def classify(rid: str, priority: int):
                return lambda: client.post(f"/v1/models/{CLS}/classify", headers={"X-Request-ID": rid},
                                           json={"inputs": ["i love this"], "priority": priority})

            def complete(rid: str, priority: int):
                return lambda: client.post("/v1/completions", headers={"X-Request-ID": rid},
                                           json={"model": LM, "prompt": "hello", "max_tokens": 2, "priority": priority})

            gate.hold()
            held = [asyncio.ensure_future(classify("c0", 0)()), asyncio.ensure_future(complete("g0", 0)())]
            await wait_until(lambda: gate.parked(CLS) and gate.parked(LM))
            tasks = await queue_in_order(url, CLS, [classify("c1", 1), classify("c2", -3)])
            tasks += await queue_in_order(url, LM, [complete("g1", 2), complete("g2", 1)])
            gate.release()
            return await asyncio.gather(*held, *tasks)

    env = dict(TSERVE_MAX_BATCH_SIZE="1")
    with running_server(models_dir, None, module_args=gate.args(), **env) as server:
        responses = asyncio.run(main(server.url))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert first_calls(gate, CLS) == ["c0", "c2", "c1"]
    assert first_calls(gate, LM) == ["g0", "g2", "g1"]


def test_a_key_over_its_queue_cap_gets_429_and_other_keys_do_not(models_dir, tmp_path):
    gate = ServerGate(tmp_path / "gate")
    env = dict(TSERVE_API_KEYS="key-a,key-b", TSERVE_MAX_QUEUE_PER_KEY="2", TSERVE_MAX_BATCH_SIZE="1")

    async def main(url: str) -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            def generate(key: str):
                return lambda: client.post(f"/v1/models/{LM}/generate", headers={"Authorization": f"Bearer {key}"},
                                           json={"inputs": ["hello"], "max_new_tokens": 2})

            gate.hold()
            running = asyncio.ensure_future(generate("key-a")())
            await wait_until(lambda: gate.parked(LM))  # taken: running, and counted
            queued = await queue_in_order(url, LM, [generate("key-a")])
            refused = await generate("key-a")()  # a third request of key-a (one running, one waiting)
            other = await queue_in_order(url, LM, [generate("key-b")], already=1)
            gate.release()
            return await asyncio.gather(running, *queued, *other), refused, await generate("key-a")()

    with running_server(models_dir, None, module_args=gate.args(), **env) as server:
        accepted, refused, later = asyncio.run(main(server.url))
    assert [r.status_code for r in accepted] == [200, 200, 200], [r.text for r in accepted]
    assert refused.status_code == 429 and refused.headers.get("retry-after")
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and "max_queue_per_key=2" in error["message"]
    assert later.status_code == 200  # once its requests ran, the key may queue again
