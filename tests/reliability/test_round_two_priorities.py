"""Issue 33, item 2: one API key may not starve the others with a self-declared priority (a real server).

A user key may not ask for a priority below ``min_user_priority`` (422 naming the field; admin keys may), the
per-key cap counts a key's running requests as well as its waiting ones, and at equal priority the worker takes
waiting requests round-robin across keys, so a key flooding the queue never holds every row of the batch.
The worker is held by events (``block_worker``, ``StepGate``), never by the clock.
"""

from __future__ import annotations

import asyncio

import httpx

from tests.helpers import StepGate, block_worker, error_of, step_until, wait_until
from tests.reliability.helpers import inprocess_server
from tests.service.conftest import CLS, LM

LOWEST = -(2**31)
SERVER = dict(api_keys=("user-a", "user-b"), admin_keys=("admin-k",), max_queue_per_key=4, max_batch_size=4)


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


def generate(client: httpx.AsyncClient, user: str, rid: str, inputs: int = 1, priority: int = 0):
    """A generate request of ``user`` with ``inputs`` inputs (one batch row each), as a coroutine."""
    body = {"inputs": ["hello"] * inputs, "max_new_tokens": 4, "min_new_tokens": 4, "priority": priority}
    return client.post(f"/v1/models/{LM}/generate", json=body, headers={**key(user), "X-Request-ID": rid})


def test_a_user_key_may_not_ask_to_go_first_and_an_admin_key_may(models_dir):
    routes = {
        f"/v1/models/{LM}/generate": {"inputs": ["hello"], "max_new_tokens": 2},
        f"/v1/models/{CLS}/classify": {"inputs": ["i love this"]},
        f"/v1/models/{CLS}/embed": {"inputs": ["i love this"]},
        "/v1/completions": {"model": LM, "prompt": "hello", "max_tokens": 2},
        "/v1/embeddings": {"model": CLS, "input": "i love this"},
    }
    with inprocess_server(models_dir, **SERVER) as s, s.client() as c:
        for path, body in routes.items():
            error = error_of(c.post(path, json={**body, "priority": LOWEST}, headers=key("user-a")), 422,
                             "invalid_request")
            assert error["field"] == "priority", (path, error)
            assert str(LOWEST) in error["message"] and "min_user_priority=0" in error["message"], error
            assert c.post(path, json={**body, "priority": 0}, headers=key("user-a")).status_code == 200, path
            assert c.post(path, json={**body, "priority": 7}, headers=key("user-b")).status_code == 200, path
            assert c.post(path, json={**body, "priority": LOWEST}, headers=key("admin-k")).status_code == 200, path


def test_a_key_flooding_the_queue_cannot_starve_another_key_of_equal_priority(models_dir):
    """The issue's flood (24 concurrent requests of one key) at equal priority: the victim's request, queued after
    the flooder's, is in the very first batch, beside the flooder's oldest; FIFO would have run it last."""
    with inprocess_server(models_dir, **SERVER) as s:
        worker = s.engine.get(LM)

        async def main() -> tuple[list[httpx.Response], list[str], httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                release = block_worker(worker)  # requests only queue
                flood = [asyncio.ensure_future(generate(c, "user-a", f"flood-{i}", inputs=2)) for i in range(24)]
                await wait_until(lambda: worker.scheduler.num_waiting + sum(t.done() for t in flood) == 24)
                victim = asyncio.ensure_future(generate(c, "user-b", "victim"))
                await wait_until(lambda: worker.scheduler.num_waiting == 5 or victim.done())
                gate = StepGate(worker.scheduler)
                release.set()
                await gate.until_parked()  # the first model call: the prefill of the first batch
                first_batch = list(gate.ids)
                gate.release()
                return await asyncio.gather(*flood), first_batch, await victim

        flood, first_batch, victim = asyncio.run(main())
    statuses = [r.status_code for r in flood]
    assert sorted(statuses) == [200] * 4 + [429] * 20, statuses  # the flooder's cap: 4 of its requests at a time
    assert victim.status_code == 200, victim.text
    # 2 + 1 rows of 4: the flooder's next request (2 rows) does not fit beside them
    assert len(first_batch) == 2 and first_batch[0].startswith("flood-") and first_batch[1] == "victim", first_batch


def test_the_per_key_cap_counts_running_requests(models_dir):
    with inprocess_server(models_dir, **SERVER) as s:
        worker = s.engine.get(LM)

        async def main() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                release = block_worker(worker)
                running = [asyncio.ensure_future(generate(c, "user-a", f"a{i}")) for i in range(4)]
                await wait_until(lambda: worker.scheduler.num_waiting == 4 or any(t.done() for t in running))
                gate = StepGate(worker.scheduler)
                release.set()
                await step_until(gate, lambda: worker.scheduler.num_running == 4)  # all four hold rows
                assert worker.scheduler.num_waiting == 0
                fifth = asyncio.ensure_future(generate(c, "user-a", "a-fifth"))
                await wait_until(lambda: fifth.done() or worker.scheduler.num_waiting == 1)
                other = asyncio.ensure_future(generate(c, "user-b", "b0"))
                await wait_until(lambda: worker.scheduler.num_waiting == 1 + (not fifth.done()) or other.done())
                gate.release()
                accepted = await asyncio.gather(*running, other)
                return accepted, await fifth, await generate(c, "user-a", "a-later")

        accepted, refused, later = asyncio.run(main())
    assert [r.status_code for r in accepted] == [200] * 5, [r.text for r in accepted]
    error = error_of(refused, 429, "queue_full")
    assert "max_queue_per_key=4" in error["message"] and refused.headers.get("retry-after"), error
    assert later.status_code == 200  # once its requests ran, the key may send again
