"""Load, faults and shutdown over real sockets: backpressure, client disconnects, a failing request in
a batch, adapter swaps under sustained load, graceful SIGTERM.

Work is held in flight by events, not by its length: the in-process server's worker thread parks at a
``StepGate`` (tests/helpers.py), the subprocess server's at a hold file (tests/reliability/gated_server.py).
Figures worth recording are printed as ``FIGURE name=value`` (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import signal
import time

import httpx
import pytest

from tests.helpers import StepGate, error_of, gather_queued, generate, step_until, wait_until
from tests.reliability.gated_server import ServerGate
from tests.reliability.helpers import adapter_archive, adapter_variant, inprocess_server, rss_bytes
from tests.service.conftest import ADAPTERS, CLS, LM
from tests.service.server import metric_samples, running_server

PROMPTS = ["hello world", "the cat", "gold", "delete file 3", "i love this", "a journey"]


def figure(name: str, value: float | int | str) -> None:
    print(f"FIGURE {name}={value}")


def waiting(url: str) -> float:
    """Requests queued in the server at ``url`` (all models)."""
    return sum(metric_samples(httpx.get(url + "/metrics").text, "tserve_num_requests_waiting").values())


async def refused_connection(url: str) -> BaseException | httpx.Response:
    """Open new connections to ``url`` until one is refused (a stopping server closes its listening socket);
    the last one's outcome (a response only if the socket never closed)."""

    async def attempt() -> BaseException | httpx.Response:
        try:
            async with httpx.AsyncClient(base_url=url, timeout=5) as fresh:
                return await fresh.get("/health")
        except httpx.TransportError as exc:
            return exc

    outcome = await attempt()
    deadline = time.monotonic() + 30
    while not isinstance(outcome, httpx.ConnectError) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        outcome = await attempt()
    return outcome


def strip_scores(outputs: list[dict]) -> list[dict]:
    """Outputs without their scores (batching reorders float sums: scores agree only to ~1e-6)."""
    return [{k: v for k, v in o.items() if k != "score"} for o in outputs]


# ---- backpressure ------------------------------------------------------------------------------------


def test_queue_full_is_429_at_once_and_accepted_requests_finish(models_dir, tmp_path):
    """With the queue full, new requests get 429 + Retry-After at once (not after a slot frees); the accepted
    ones finish with their correct results; hundreds of refusals leave the server's memory where it was.

    The server's worker is held in the first accepted request's model call, so no slot can free while the
    refusals are answered: each one came back without waiting for a slot."""
    body = {"inputs": ["a", "b", "c", "d"] * 2, "max_new_tokens": 100, "min_new_tokens": 100, "strategy": "beam",
            "num_beams": 4}  # fmt: skip
    env = dict(TSERVE_MAX_QUEUE="2", TSERVE_MAX_BATCH_SIZE="1", TSERVE_WARMUP="false")
    path = f"/v1/models/{LM}/generate"
    gate = ServerGate(tmp_path / "gate")
    with running_server(models_dir, None, module_args=gate.args(), **env) as s, s.client() as c:
        expected = strip_scores(generate(c, LM, **body)["outputs"])

        async def fill_then_probe() -> tuple[list[tuple[httpx.Response, float]], list[tuple[httpx.Response, float]]]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:

                async def timed(json: dict) -> tuple[httpx.Response, float]:
                    start = time.perf_counter()
                    r = await ac.post(path, json=json)
                    return r, time.perf_counter() - start

                gate.hold()
                accepted = [asyncio.create_task(timed(body))]
                # The first job leaves the queue for the batch (held there) before two more fill the queue.
                await wait_until(lambda: gate.parked(LM))
                accepted += [asyncio.create_task(timed(body)) for _ in range(2)]  # 1 running + 2 waiting
                await wait_until(lambda: waiting(s.url) == 2)
                probes = [await timed({"inputs": ["probe"], "max_new_tokens": 1}) for _ in range(10)]
                # All answered while the worker stayed held: no slot freed, none of them waited for one.
                assert gate.parked(LM) and not any(t.done() for t in accepted)
                gate.release()
                return list(await asyncio.gather(*accepted)), probes

        accepted, probes = asyncio.run(fill_then_probe())
        assert [r.status_code for r, _ in accepted] == [200] * 3
        assert all(strip_scores(r.json()["outputs"]) == expected for r, _ in accepted)
        assert len(probes) >= 3 and [r.status_code for r, _ in probes] == [429] * len(probes)
        for r, _ in probes:
            error = error_of(r, 429, "queue_full")
            assert "max_queue=2" in error["message"] and int(r.headers["retry-after"]) >= 1
        slowest_refusal, fastest_generation = max(t for _, t in probes), min(t for _, t in accepted)

        async def burst(n: int) -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60, limits=httpx.Limits(max_connections=n)) as ac:
                gate.hold()
                answers = [asyncio.create_task(ac.post(path, json=body)) for _ in range(n)]
                # One request is held in the batch and at most two wait: every other one is refused first.
                await wait_until(lambda: gate.parked(LM) and sum(a.done() for a in answers) >= n - 3)
                gate.release()
                return [r.status_code for r in await asyncio.gather(*answers)]

        asyncio.run(burst(30))  # warm-up: connections, allocator
        rss_start = rss_bytes(s.process.pid)
        statuses = [x for _ in range(8) for x in asyncio.run(burst(30))]
        rss_end = rss_bytes(s.process.pid)
        assert set(statuses) == {200, 429} and statuses.count(429) >= 150, statuses
        growth = rss_end - rss_start
        assert growth < 0.05 * rss_start, (rss_start, rss_end)
        assert c.get("/health").status_code == 200
        figure("backpressure_slowest_429_s", round(slowest_refusal, 4))
        figure("backpressure_fastest_200_s", round(fastest_generation, 3))
        figure("backpressure_probes_429", len(probes))
        figure("backpressure_burst_requests", len(statuses))
        figure("backpressure_burst_429", statuses.count(429))
        figure("backpressure_rss_start_mb", round(rss_start / 2**20, 1))
        figure("backpressure_rss_growth_mb", round(growth / 2**20, 2))


# ---- client disconnects ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_client_disconnect_stops_its_generation(models_dir, stream):
    """A client that hangs up mid-generation (real socket) frees its batch rows and KV cache at once."""
    body = {"inputs": ["hello"], "max_new_tokens": 120, "min_new_tokens": 120, "stream": stream}
    with inprocess_server(models_dir) as s:
        worker = s.engine.get(LM)
        gate = StepGate(worker.scheduler)  # the generation advances one model call at a time, when the test says
        tokens = lambda: s.metric("tserve_generation_tokens_total", model=LM)  # noqa: E731
        closed = lambda: s.metric("tserve_requests_total", model=LM, endpoint="generate", status="499")  # noqa: E731
        before = tokens()

        async def hang_up_mid_generation() -> float:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:

                async def request() -> None:
                    if stream:
                        async with c.stream("POST", f"/v1/models/{LM}/generate", json=body) as r:
                            async for _ in r.aiter_lines():
                                pass
                    else:
                        await c.post(f"/v1/models/{LM}/generate", json=body)

                task = asyncio.create_task(request())
                await step_until(gate, lambda: tokens() >= before + 10)
                task.cancel()  # httpx closes the connection
                await asyncio.gather(task, return_exceptions=True)
            # The response never completed (none sent, or a stream cut short): recorded as "client closed
            # request" once the server has cancelled the request, while the worker is still held.
            await wait_until(lambda: closed() == 1)
            gone_at = time.perf_counter()
            gate.step()  # the held model call ends; the next iteration drops the cancelled job
            await wait_until(lambda: worker.scheduler.batch is None and not worker.scheduler.busy)
            return time.perf_counter() - gone_at

        freed_after = asyncio.run(hang_up_mid_generation())
        assert worker.scheduler.num_rows == 0 and worker.scheduler.batch is None
        assert s.metric("tserve_num_requests_running", model=LM) == 0
        generated = tokens() - before
        # Nothing is left to decode (the worker is idle, and a model call would have to pass the gate): it stays.
        assert not gate.parked and not worker.scheduler.busy
        assert tokens() - before == generated < 120  # decoding stopped early and stays stopped
        assert closed() == 1
        assert s.metric("tserve_requests_total", model=LM, endpoint="generate", status="200") == 0
        gate.release()
        worker.scheduler.fault_hook = None
        with s.client() as c:
            assert generate(c, LM, inputs=["hello"], max_new_tokens=4)["outputs"]
        figure(f"disconnect_{'stream' if stream else 'json'}_rows_freed_s", round(freed_after, 3))
        figure(f"disconnect_{'stream' if stream else 'json'}_tokens_generated", int(generated))


# ---- a failing request in a batch --------------------------------------------------------------------


def test_a_failing_request_fails_alone_in_its_batch(models_dir, adapters_dir, tmp_path):
    """An injected fault and a poisoned (NaN) adapter fail only their own requests, each with a 500 naming
    its request id; the requests batched with them finish with the results they give alone."""
    adapters = tmp_path / "adapters"
    shutil.copytree(adapters_dir, adapters)
    shutil.copytree(adapters / LM / ADAPTERS[LM], adapters / LM / "poisoned")
    with inprocess_server(models_dir, adapters) as s, s.client() as c:
        good = [
            {"inputs": [p], "max_new_tokens": 12, "adapter": ADAPTERS[LM] if i % 2 else None}
            for i, p in enumerate(PROMPTS[:4])
        ]
        alone = [strip_scores(generate(c, LM, **b)["outputs"]) for b in good]
        worker = s.engine.get(LM)

        def poison() -> None:
            version = worker.registry.acquire("poisoned")
            worker.registry.ensure_resident(version)
            for module in worker.model.modules():
                if hasattr(module, "lora_B") and version.internal in module.lora_B:
                    module.lora_B[version.internal].weight.fill_(float("nan"))
            worker.registry.release(version)

        worker.scheduler.call(poison).result(10)

        def fault(ids: list[str]) -> None:
            if any(i.startswith("boom") for i in ids):
                raise RuntimeError("injected fault")

        worker.scheduler.fault_hook = fault
        batched_before = s.metric("tserve_batch_size_count", model=LM)
        alone_steps_before = s.metric("tserve_batch_size_bucket", model=LM, le="1.0")

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
                path = f"/v1/models/{LM}/generate"
                bad = [
                    ac.post(path, json={"inputs": ["hello"], "max_new_tokens": 12}, headers={"X-Request-ID": "boom-1"}),
                    ac.post(
                        path,
                        json={"inputs": ["the cat"], "max_new_tokens": 12, "adapter": "poisoned"},
                        headers={"X-Request-ID": "poisoned-1"},
                    ),
                ]
                # Queued while the worker is held, so that they all share its next model steps.
                return await gather_queued(worker, [*bad, *(ac.post(path, json=b) for b in good)])

        boom, poisoned, *fine = asyncio.run(together())
        worker.scheduler.fault_hook = None
        error = error_of(boom, 500, "engine_failure")
        assert error["request_id"] == "boom-1" == boom.headers["x-request-id"] and "injected fault" in error["message"]
        error = error_of(poisoned, 500, "engine_failure")
        assert error["request_id"] == "poisoned-1" and "non-finite" in error["message"]
        assert [strip_scores(r.json()["outputs"]) for r in fine] == alone
        steps = s.metric("tserve_batch_size_count", model=LM) - batched_before
        alone_steps = s.metric("tserve_batch_size_bucket", model=LM, le="1.0") - alone_steps_before
        assert steps > alone_steps, "the requests never shared a model step"
        assert s.engine.ready and generate(c, LM, inputs=["still serving"], max_new_tokens=4)["outputs"]


# ---- adapter swaps under load ------------------------------------------------------------------------


def test_adapter_swaps_under_sustained_load_lose_nothing(models_dir, adapters_dir, tmp_path):
    """Load, unload and replace-under-the-same-name (uploads) while clients keep generating and classifying:
    no request fails, and each result is the one its adapter (one of the two versions, never a mix) gives."""
    adapters = tmp_path / "adapters"
    shutil.copytree(adapters_dir, adapters)
    v1 = adapters_dir / LM / ADAPTERS[LM]
    v2 = adapter_variant(v1, tmp_path / "v2")
    shutil.copytree(v1, adapters / LM / "swap")
    shutil.copytree(v1, adapters / LM / "extra")
    archives = [adapter_archive(v2), adapter_archive(v1)]
    rounds, clients = 8, 4
    with running_server(models_dir, adapters, TSERVE_MAX_WAIT_MS="10") as s, s.client() as c:
        assert c.delete(f"/v1/models/{LM}/adapters/extra").status_code == 204  # "extra" is loaded and unloaded
        requests = [(p, a) for p in PROMPTS[:3] for a in (None, ADAPTERS[LM], "swap")]
        reference = {
            (p, a): strip_scores(generate(c, LM, inputs=[p], max_new_tokens=10, adapter=a)["outputs"])
            for p, a in requests
        }
        upload = {"Content-Type": "application/gzip"}
        assert c.put(f"/v1/models/{LM}/adapters/swap", content=archives[0], headers=upload).status_code == 200
        reference_v2 = {
            p: strip_scores(generate(c, LM, inputs=[p], max_new_tokens=10, adapter="swap")["outputs"])
            for p in PROMPTS[:3]
        }
        assert any(reference_v2[p] != reference[(p, "swap")] for p in PROMPTS[:3]), "v1 and v2 look alike"
        classify_ref = c.post(f"/v1/models/{CLS}/classify", json={"inputs": PROMPTS, "adapter": ADAPTERS[CLS]}).json()

        async def scenario() -> tuple[list[tuple[tuple, httpx.Response]], list[httpx.Response]]:
            # Clients load the server until the swapper is done; after each admin call the swapper waits until
            # a request sent after it has its answer (after an upload: one on "swap", so each version serves).
            admin_calls, finished = 0, False
            answered, answered_swap = collections.Counter(), collections.Counter()  # by admin_calls when sent
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:

                async def client(k: int) -> list[tuple[tuple, httpx.Response]]:
                    out, i = [], k
                    while not finished:
                        i += 1
                        sent_after = admin_calls
                        if i % 5 == 0:
                            body = {"inputs": PROMPTS, "adapter": ADAPTERS[CLS]}
                            out.append((("classify",), await ac.post(f"/v1/models/{CLS}/classify", json=body)))
                            answered[sent_after] += 1
                            continue
                        prompt, adapter = requests[i % len(requests)]
                        body = {"inputs": [prompt], "max_new_tokens": 10, "adapter": adapter}
                        out.append(((prompt, adapter), await ac.post(f"/v1/models/{LM}/generate", json=body)))
                        answered[sent_after] += 1
                        answered_swap[sent_after] += adapter == "swap"
                    return out

                async def admin(call: httpx.Response, served: collections.Counter) -> httpx.Response:
                    nonlocal admin_calls
                    admin_calls += 1
                    n = admin_calls
                    await wait_until(lambda: served[n] >= 1)
                    return call

                async def swapper() -> list[httpx.Response]:
                    nonlocal finished
                    out = []
                    for i in range(1, rounds + 1):
                        path = f"/v1/models/{LM}/adapters"
                        out.append(await admin(await ac.put(f"{path}/swap", content=archives[i % 2], headers=upload),
                                               answered_swap))
                        out.append(await admin(await ac.put(f"{path}/extra"), answered))
                        out.append(await admin(await ac.delete(f"{path}/extra"), answered))
                    finished = True
                    return out

                *loads, swaps = await asyncio.gather(*(client(k) for k in range(clients)), swapper())
                return [x for load in loads for x in load], swaps

        results, swaps = asyncio.run(scenario())
        assert [r.status_code for r in swaps] == [200, 200, 204] * (len(swaps) // 3)
        failed = [(key, r.status_code, r.text[:200]) for key, r in results if r.status_code != 200]
        assert not failed
        seen_versions = set()
        for key, r in results:
            if key == ("classify",):  # batched with other inputs: probabilities agree to float rounding
                outputs, ref = r.json()["outputs"], classify_ref["outputs"]
                assert [o["label"] for o in outputs] == [o["label"] for o in ref]
                for o, want in zip(outputs, ref, strict=True):
                    assert o["probabilities"] == pytest.approx(want["probabilities"], abs=1e-5)
                continue
            got = strip_scores(r.json()["outputs"])
            prompt, adapter = key
            if adapter == "swap":
                version = [v for v, ref in (("v1", reference[key]), ("v2", reference_v2[prompt])) if got == ref]
                assert version, (key, got)
                seen_versions.update(version)
            else:
                assert got == reference[key], key
        assert seen_versions == {"v1", "v2"}
        figure("swap_requests", len(results))
        figure("swap_admin_calls", len(swaps))


# ---- graceful shutdown -------------------------------------------------------------------------------


def test_sigterm_stops_accepting_finishes_in_flight_and_exits_0(models_dir, tmp_path):
    body = {"inputs": ["a", "b"], "max_new_tokens": 100, "min_new_tokens": 100, "strategy": "beam", "num_beams": 4}
    count = 3  # served one at a time: one held in its model call at SIGTERM, the others queued behind it
    gate = ServerGate(tmp_path / "gate")
    env = dict(TSERVE_MAX_BATCH_SIZE="1", TSERVE_WARMUP="false")
    with running_server(models_dir, None, module_args=gate.args(), **env) as s:
        with s.client() as c:
            expected = strip_scores(generate(c, LM, **body)["outputs"])

        async def scenario() -> tuple[list[httpx.Response], BaseException | httpx.Response, float]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
                gate.hold()
                tasks = [asyncio.create_task(ac.post(f"/v1/models/{LM}/generate", json=body)) for _ in range(count)]
                await wait_until(lambda: gate.parked(LM) and waiting(s.url) == count - 1)
                assert not all(t.done() for t in tasks), "the requests finished before SIGTERM"
                s.process.send_signal(signal.SIGTERM)
                signalled = time.perf_counter()
                late = await refused_connection(s.url)  # a new connection: refused (the listening socket is closed)
                gate.release()  # the requests in flight finish during the drain
                return list(await asyncio.gather(*tasks)), late, signalled

        responses, late, signalled = asyncio.run(scenario())
        assert isinstance(late, httpx.ConnectError), late
        assert [r.status_code for r in responses] == [200] * len(responses)
        assert all(strip_scores(r.json()["outputs"]) == expected for r in responses)
        assert s.process.wait(30) == 0
        figure("sigterm_exit_s", round(time.perf_counter() - signalled, 2))


def test_sigterm_drain_deadline_bounds_the_exit(models_dir, tmp_path):
    """Work that outlasts drain_timeout_s is cut at the deadline: the process still exits 0, promptly, and
    every client gets an answer or a closed connection, not a hang.

    The server's worker is held in the first request's model call and the test never lets it go, so the work
    outlasts any deadline: only the engine stopping at the drain deadline lets the held step end (into the
    stop), and the exit comes from the deadline, not from the work finishing or uvicorn's backstop (bare 500s)."""
    drain_s = 1.0
    body = {"inputs": ["a"] * 4, "max_new_tokens": 100, "min_new_tokens": 100, "strategy": "beam", "num_beams": 8}
    count = 3  # served one at a time: one held, two queued
    gate = ServerGate(tmp_path / "gate")
    env = dict(TSERVE_MAX_BATCH_SIZE="1", TSERVE_DRAIN_TIMEOUT_S=str(drain_s), TSERVE_WARMUP="false")
    with running_server(models_dir, None, module_args=gate.args(), **env) as s:

        async def scenario() -> tuple[list, float]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
                gate.hold()
                tasks = [asyncio.create_task(ac.post(f"/v1/models/{LM}/generate", json=body)) for _ in range(count)]
                await wait_until(lambda: gate.parked(LM) and waiting(s.url) == count - 1)
                s.process.send_signal(signal.SIGTERM)
                start = time.perf_counter()
                return list(await asyncio.gather(*tasks, return_exceptions=True)), start

        outcomes, signalled = asyncio.run(scenario())
        assert s.process.wait(30) == 0  # with the work still held: the drain deadline ended it
        exit_s = time.perf_counter() - signalled
        statuses = [o.status_code if isinstance(o, httpx.Response) else type(o).__name__ for o in outcomes]
        assert set(statuses) <= {200, 503}, statuses  # answers, in the one error shape: no cut connections
        for o in outcomes:
            if o.status_code == 503:
                assert "drain timeout" in error_of(o, 503, "not_ready")["message"]
        assert statuses.count(200) < len(statuses), "all finished before the deadline: nothing was cut"
        figure("sigterm_deadline_exit_s", round(exit_s, 2))
        counts = {str(x): statuses.count(x) for x in statuses}
        figure("sigterm_deadline_outcomes", ",".join(f"{k}:{v}" for k, v in sorted(counts.items())))
