"""Continuous batching: batched results equal each request alone; failures, deadlines and cancellation stay local."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from model.kv_cache import KVCache
from model.lora import adapter_names
from service.engine.errors import EngineFailure, NotReady, QueueFull, RequestTimeout
from service.engine.requests import GenerationRequest
from service.engine.scheduler import FaultHook, install_fault_hooks
from service.engine.types import QueueTag
from tests.helpers import StepGate, block_worker, gather_queued, on_stop, stepping, wait_until
from tests.service.conftest import ADAPTERS, LM, MT, ask, assert_same, histogram_count, offline, running_engine

PROMPTS = ["hello world", "the cat", "a", "numbers 1 2 3", "def main", "le chat", "to be or", "gold"]


def decoding(scheduler) -> bool:
    """Whether a batch is running: the model call about to happen is a decode step (prefill comes before)."""
    return scheduler.batch is not None


def first_job_step(scheduler) -> int:
    """Tokens the running batch's first job has generated (0 before it runs)."""
    batch = scheduler.batch
    return batch.jobs[0].search.step if batch is not None else 0


def batch_ids(scheduler) -> list[str]:
    batch = scheduler.batch
    return [job.id for job in batch.jobs] if batch is not None else []


async def join_later(worker, first: GenerationRequest, second: GenerationRequest, steps: int
                     ) -> tuple[StepGate, asyncio.Task, asyncio.Task]:
    """Request ``first`` ("first") decodes more than ``steps`` steps alone, then ``second`` ("second") waits to join
    it: the gate holding "first" there (release it to go on) and both requests' tasks."""
    sched = worker.scheduler
    running = StepGate(sched, when=lambda ids: ids == ["first"] and first_job_step(sched) > steps)
    first_task = asyncio.create_task(worker.generate(first, "first"))
    await running.until_parked()
    second_task = asyncio.create_task(worker.generate(second, "second"))
    await wait_until(lambda: sched.num_waiting == 1)
    return running, first_task, second_task


async def sleep_past(moment: float) -> None:
    """Return once time.monotonic() is past ``moment`` (a deadline that must have expired)."""
    while time.monotonic() <= moment:
        await asyncio.sleep(moment - time.monotonic() + 0.001)


@pytest.mark.parametrize("model", [LM, MT])
def test_concurrent_requests_batch_and_match_alone(models_dir, model):
    params = [dict(max_new_tokens=6 + 3 * i) for i in range(len(PROMPTS))]

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(model)
            together = await gather_queued(worker, [worker.generate(ask(p, **q), f"r{i}")
                                                    for i, (p, q) in enumerate(zip(PROMPTS, params, strict=True))])
            assert histogram_count(engine, "tserve_batch_size", {"model": model}, le="1.0") < \
                histogram_count(engine, "tserve_batch_size", {"model": model})  # some steps held > 1 row
            sequential = [await worker.generate(ask(p, **q), f"s{i}") for i, (p, q) in enumerate(zip(PROMPTS, params,
                                                                                              strict=True))]
            return together, sequential

    together, sequential = asyncio.run(main())
    for got, alone, prompt, p in zip(together, sequential, PROMPTS, params, strict=True):
        assert_same(got, alone)
        assert_same(got, offline(models_dir / model, [prompt], p))


def test_multi_input_request_matches_offline(models_dir):
    params = dict(max_new_tokens=12, stop=["e"])

    async def main():
        async with running_engine(models_dir, None) as engine:
            return await engine.get(LM).generate(ask(*PROMPTS[:4], **params), "multi")

    assert_same(asyncio.run(main()), offline(models_dir / LM, PROMPTS[:4], params))


def test_request_joining_mid_run_equals_alone(models_dir):
    long = dict(max_new_tokens=60, min_new_tokens=60)
    short = dict(strategy="beam", num_beams=3, max_new_tokens=8)

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(MT)
            sched = worker.scheduler
            running, first, second = await join_later(worker, ask("hello world", **long), ask("the cat", **short), 5)
            seen = set()

            def second_left(ids: list[str]) -> bool:
                seen.update(ids)
                return "second" in seen and ids == ["first"]

            left = StepGate(sched, when=second_left)  # holds "first" once "second" has joined and left
            running.release()
            second = await second
            assert not first.done()  # it really joined a running batch
            left.release()
            return await first, second

    first, second = asyncio.run(main())
    assert_same(first, offline(models_dir / MT, ["hello world"], long))
    assert_same(second, offline(models_dir / MT, ["the cat"], short))


@pytest.mark.parametrize("model", [LM, MT])
def test_beam_requests_side_by_side_read_their_shared_positions_once(models_dir, model, monkeypatch):
    """A beam-2 request joins a running beam-4 one (rows of different lengths and steps, runs of 4 and 2): each beam
    reads the positions it shares with its request's first beam from there (and a translator's source memory from
    its first beam's copy), and both equal their offline results."""
    first_params = dict(strategy="beam", num_beams=4, max_new_tokens=24, min_new_tokens=24)
    second_params = dict(strategy="beam", num_beams=2, max_new_tokens=8, min_new_tokens=8)
    leads, cross_leads, most, real = set(), set(), 0, KVCache.share_beam_prefix

    def recorded(cache, shared, generated):
        nonlocal most
        real(cache, shared, generated)
        if cache.beam_lead is not None and cache.batch_size == 6:  # both requests' beams
            leads.add(tuple(cache.beam_lead.tolist()))
            if cache.cross is not None:  # the translator's source memory: runs of 4 and 2 rows
                cross_leads.add(tuple(cache.cross.leads.tolist()))
            led = cache.beam_lead != torch.arange(6)  # rows reading their first beam's positions
            most = max(most, int((cache.beam_shared - cache.lengths + generated - 1)[led].max()))

    monkeypatch.setattr(KVCache, "share_beam_prefix", recorded)

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(model)
            running, first, second = await join_later(worker, ask("hello world", **first_params),
                                                      ask("numbers 1 2 3", **second_params), 3)
            running.release()
            return await first, await second

    first, second = asyncio.run(main())
    assert (0, 0, 0, 0, 4, 4) in leads and most > 0  # beams read generated tokens' positions from their first
    assert cross_leads == ({(0, 0, 0, 0, 4, 4)} if model == MT else set())
    assert_same(first, offline(models_dir / model, ["hello world"], first_params))
    assert_same(second, offline(models_dir / model, ["numbers 1 2 3"], second_params))


def test_mixed_strategies_in_one_batch_equal_alone(models_dir):
    cases = [
        ("hello world", dict(max_new_tokens=20)),
        ("the cat", dict(strategy="beam", num_beams=4, num_return_sequences=2, max_new_tokens=12)),
        ("a", dict(strategy="sample", seed=7, num_return_sequences=3, max_new_tokens=15, top_k=20,
                             temperature=0.8)),
        ("gold", dict(strategy="sample", seed=3, top_p=0.9, max_new_tokens=25)),
        ("def main", dict(max_new_tokens=10, stop=["a"])),
        ("hello world", dict(max_new_tokens=20, repetition_penalty=1.5, no_repeat_ngram_size=2)),
        ("the cat", dict(strategy="beam", num_beams=3, max_new_tokens=12, repetition_penalty=2.0)),
        ("a", dict(strategy="sample", seed=5, max_new_tokens=15, repetition_penalty=1.3)),
    ]

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            return await gather_queued(worker, [worker.generate(ask(t, **p), f"m{i}")
                                                for i, (t, p) in enumerate(cases)])

    for got, (text, params) in zip(asyncio.run(main()), cases, strict=True):
        assert_same(got, offline(models_dir / LM, [text], params))


def test_mixed_adapters_in_one_batch_equal_alone(models_dir, adapters_dir):
    adapter = adapters_dir / LM / ADAPTERS[LM]
    cases = [(p, ADAPTERS[LM] if i % 2 else None) for i, p in enumerate(PROMPTS[:6])]
    params = dict(max_new_tokens=16)

    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(LM)
            return await gather_queued(worker, [worker.generate(ask(p, max_new_tokens=16, adapter=a), f"a{i}")
                                                for i, (p, a) in enumerate(cases)])

    results = asyncio.run(main())
    for got, (prompt, name) in zip(results, cases, strict=True):
        assert_same(got, offline(models_dir / LM, [prompt], params, adapter if name else None))
    base = offline(models_dir / LM, [PROMPTS[1]], params)[0]
    assert results[1][0].tokens != base.tokens  # the adapter changes the output


def test_stream_events_add_up_to_generate(models_dir):
    params = dict(max_new_tokens=20, stop=["e "])

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            events = [e async for e in await worker.stream(ask("hello world", **params), "st")]
            beam_params = dict(strategy="beam", max_new_tokens=6)
            beam = [e async for e in await worker.stream(ask("gold", **beam_params), "sb")]
            full = await worker.generate(ask("hello world", **params), "gen")
            return events, beam, full[0]

    events, beam, full = asyncio.run(main())
    assert "".join(e.text for e in events) == full.text
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + [full.finish_reason]
    assert [e.token for e in events if e.token is not None] == full.tokens
    assert len(beam) == 1 and beam[0].finish_reason == "length" and beam[0].text


def test_queue_full_is_immediate(models_dir):
    async def main():
        async with running_engine(models_dir, None, max_queue=2) as engine:
            worker = engine.get(LM)
            release = block_worker(worker)
            queued = [asyncio.create_task(worker.generate(ask("a", max_new_tokens=2), f"q{i}"))
                      for i in range(2)]
            await wait_until(lambda: worker.scheduler.num_waiting == 2)
            with pytest.raises(QueueFull) as info:  # while the worker is parked: refused without waiting for room
                await worker.generate(ask("a", max_new_tokens=2), "overflow")
            assert info.value.retry_after > 0 and "max_queue=2" in str(info.value)
            assert not release.is_set() and worker.scheduler.num_waiting == 2
            release.set()
            assert len(await asyncio.gather(*queued)) == 2

    asyncio.run(main())


def test_api_keys_take_turns_within_a_priority(models_dir):
    """Within a priority the worker takes waiting jobs round-robin across API keys (the key holding the fewest rows
    first, ties to the older job, FIFO within a key); a lower priority value still goes first, and the per-key cap
    counts a key's running jobs with its waiting ones."""
    sends = [("a1", "a", 0), ("a2", "a", 0), ("a3", "a", 0), ("b1", "b", 0), ("b2", "b", 0), ("c1", "c", 0),
             ("p", "a", -1)]

    async def main():
        async with running_engine(models_dir, None, max_batch_size=4, max_queue_per_key=4) as engine:
            worker = engine.get(LM)
            release = block_worker(worker)
            tasks = []
            for n, (rid, key, priority) in enumerate(sends, 1):  # queued one by one: arrival order is the list's
                tasks.append(asyncio.create_task(worker.generate(ask("a", max_new_tokens=3), rid,
                                                                 QueueTag(priority, key))))
                await wait_until(lambda n=n: worker.scheduler.num_waiting == n)
            gate = StepGate(worker.scheduler)
            release.set()
            await gate.until_parked()  # the first batch's prefill
            first = list(gate.ids)
            with pytest.raises(QueueFull, match="waiting or running"):  # a: p and a1 running, a2 and a3 waiting
                await worker.generate(ask("a", max_new_tokens=3), "a4", QueueTag(0, "a"))
            gate.release()
            await asyncio.gather(*tasks)
            return first

    assert asyncio.run(main()) == ["p", "b1", "c1", "a1"]


def test_deadline_fails_the_request_and_frees_its_rows(models_dir):
    """A request whose deadline passes while it decodes, or while it waits, fails with RequestTimeout and frees its
    rows. The deadline is moved to "now" once the request is held where the test wants it (an event), so how long
    admission takes on a busy machine does not matter."""

    def expire(job) -> None:
        job.deadline = time.monotonic()

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            gate = StepGate(worker.scheduler, when=lambda ids: decoding(worker.scheduler))
            slow = asyncio.create_task(worker.generate(ask("hello", max_new_tokens=120, min_new_tokens=120), "slow"))
            await wait_until(lambda: gate.parked or slow.done())
            assert gate.parked and worker.scheduler.num_rows == 1, "not admitted"
            (job,) = worker.scheduler.running_jobs()
            expire(job)  # held in its first decode step, now past its deadline
            await sleep_past(job.deadline)
            gate.release()
            with pytest.raises(RequestTimeout, match="slow"):
                await slow
            assert worker.scheduler.num_rows == 0 and worker.scheduler.num_running == 0
            release = block_worker(worker)  # a queued request times out while waiting too
            task = asyncio.create_task(worker.generate(ask("a", max_new_tokens=2), "queued"))
            await wait_until(lambda: worker.scheduler.num_waiting == 1)
            (queued,) = worker.scheduler.waiting_jobs()
            expire(queued)
            await sleep_past(queued.deadline)
            release.set()
            with pytest.raises(RequestTimeout, match="queued"):
                await task

    asyncio.run(main())


def test_cancelled_requests_free_their_rows(models_dir):
    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            gate = StepGate(worker.scheduler, when=lambda ids: decoding(worker.scheduler))  # each decode step waits
            long = dict(max_new_tokens=120, min_new_tokens=120)
            task = asyncio.create_task(worker.generate(ask("hello", **long), "gone"))
            await gate.until_parked()
            assert worker.scheduler.num_rows == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # the job is marked cancelled
            gate.step()  # the held step ends; the next iteration drops the job
            await wait_until(lambda: worker.scheduler.num_rows == 0)
            stream = await worker.stream(ask("hello", **long), "gone-stream")
            await stepping(gate, anext(stream))
            await gate.until_parked()
            await stream.aclose()  # the client disconnected
            gate.step()
            await wait_until(lambda: worker.scheduler.num_rows == 0)
            gate.release()
            out = await worker.generate(ask("a", max_new_tokens=3), "after")
            assert len(out) == 1

    asyncio.run(main())


def test_poisoned_adapter_fails_only_its_request(models_dir, adapters_dir):
    params = dict(max_new_tokens=12)

    def poison(worker):
        version = worker.registry.acquire("poisoned")
        worker.registry.ensure_resident(version)
        for module in worker.model.modules():
            if hasattr(module, "lora_B") and version.internal in module.lora_B:
                module.lora_B[version.internal].weight.fill_(float("nan"))
        worker.registry.release(version)

    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(LM)
            await worker.load_adapter("poisoned", adapters_dir / LM / ADAPTERS[LM])
            await asyncio.wrap_future(worker.scheduler.call(lambda: poison(worker)))
            return await gather_queued(worker, [
                worker.generate(ask("hello world", **params), "good-1"),
                worker.generate(ask("the cat", max_new_tokens=12, adapter="poisoned"), "bad"),
                worker.generate(ask("gold", max_new_tokens=12, adapter=ADAPTERS[LM]), "good-2"),
            ], return_exceptions=True)

    good1, bad, good2 = asyncio.run(main())
    assert isinstance(bad, EngineFailure) and bad.request_id == "bad" and "'bad'" in str(bad)
    assert "non-finite" in str(bad)
    assert_same(good1, offline(models_dir / LM, ["hello world"], params))
    assert_same(good2, offline(models_dir / LM, ["gold"], params, adapters_dir / LM / ADAPTERS[LM]))


def test_exception_in_a_batched_step_fails_only_the_culprit(models_dir):
    params = dict(max_new_tokens=15)
    calls = {"boom": 0}

    def hook(ids):
        if "boom" in ids:
            calls["boom"] += 1
            if calls["boom"] >= 4:  # a decode step, once the batch has formed
                raise RuntimeError("injected fault")

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(MT)
            worker.scheduler.fault_hook = hook
            results = await gather_queued(worker, [worker.generate(ask(p, **params), rid) for p, rid in
                                                   (("hello", "ok-1"), ("the cat", "boom"), ("gold", "ok-2"))],
                                          return_exceptions=True)
            after = await worker.generate(ask("a", **params), "after")  # the engine keeps running
            return results, after

    (ok1, boom, ok2), after = asyncio.run(main())
    assert isinstance(boom, EngineFailure) and boom.request_id == "boom" and "injected fault" in str(boom)
    assert_same(ok1, offline(models_dir / MT, ["hello"], params))
    assert_same(ok2, offline(models_dir / MT, ["gold"], params))
    assert_same(after, offline(models_dir / MT, ["a"], params))


def test_stop_drains_in_flight_requests(models_dir):
    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            gate = StepGate(worker.scheduler, when=lambda ids: decoding(worker.scheduler))
            tasks = [asyncio.create_task(worker.generate(ask(p, max_new_tokens=30), f"d{i}"))
                     for i, p in enumerate(PROMPTS[:4])]
            await gate.until_parked()
            # All four submitted (queued, or taken by the worker) before the drain closes the queue: on a loaded
            # machine some are still being tokenized when the first batch starts. The worker is parked, so jobs only
            # join the queue meanwhile.
            sched = worker.scheduler
            await wait_until(lambda: len(sched.waiting_jobs()) + len(sched.running_jobs()) == len(tasks)
                             or any(t.done() for t in tasks))
            assert sched.num_running > 0
            stop = asyncio.create_task(engine.stop(drain_timeout_s=10.0))
            await wait_until(lambda: not engine.ready)  # the drain has begun with the requests in flight
            gate.release()
            await stop
            results = await asyncio.gather(*tasks)
            with pytest.raises(NotReady):
                await worker.generate(ask("a", max_new_tokens=2), "late")
            return results

    assert all(len(r) == 1 for r in asyncio.run(main()))


def test_old_adapter_version_leaves_the_model_once_idle(models_dir, adapters_dir):
    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(LM)
            before = set(adapter_names(worker.model))
            await worker.load_adapter(ADAPTERS[LM], adapters_dir / LM / ADAPTERS[LM])
            await worker.generate(ask("a", max_new_tokens=2, adapter=ADAPTERS[LM]), "x")
            after = set(adapter_names(worker.model))
            assert len(after) == 1 and after != before

    torch.manual_seed(0)
    asyncio.run(main())


def test_installed_fault_hooks_reach_the_schedulers_built_after(models_dir):
    """``install_fault_hooks`` (how gated_server.py and deploy/podman/gated_service.py hold model calls of a server
    they start): every scheduler built later calls its factory's hook; ``None`` stops it."""
    calls: list[tuple[str, list[str]]] = []

    def factory(scheduler) -> FaultHook:
        return lambda ids: calls.append((scheduler.name, ids))

    async def main(hooked: bool) -> None:
        install_fault_hooks(factory if hooked else None)
        async with running_engine(models_dir, None) as engine:
            await engine.get(LM).generate(ask("a", max_new_tokens=2), "hooked" if hooked else "plain")

    try:
        asyncio.run(main(True))
    finally:
        install_fault_hooks(None)
    asyncio.run(main(False))
    assert (LM, ["hooked"]) in calls and not any("plain" in ids for _, ids in calls)


def test_stop_fails_what_the_drain_deadline_leaves(models_dir):
    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            gate = StepGate(worker.scheduler, when=lambda ids: decoding(worker.scheduler))
            on_stop(worker.scheduler, gate.release)  # held until the drain deadline has passed and the engine stops
            task = asyncio.create_task(worker.generate(ask("a", max_new_tokens=120, min_new_tokens=120),
                                                       "cut"))
            await gate.until_parked()
            assert worker.scheduler.num_running > 0
            await engine.stop(drain_timeout_s=0.05)
            with pytest.raises(NotReady, match="drain"):
                await task

    asyncio.run(main())


def test_compact_forgets_positions_no_row_can_see(models_dir):
    from model.checkpoint import load_checkpoint
    from model.kv_cache import KVCache
    from service.engine.batch import compact

    model = load_checkpoint(models_dir / LM, device="cpu").model
    with torch.inference_mode():
        caches, tokens = [], []
        for length, capacity in ((3, 3), (120, 300)):
            cache = model.new_cache(1, capacity)
            ids = torch.arange(7, 7 + length)[None] % 250 + 7
            tokens.append(model.prefill(ids, torch.tensor([length]), cache).argmax(-1))
            caches.append(cache)
        joined = KVCache.concat(caches)
        joined.select(torch.tensor([0]))  # the long row leaves
        assert joined.max_length == 120 and joined.capacity == 300
        compact(joined)
        assert joined.max_length == 3 and joined.capacity == 3 + 64
        alone = caches[0]
        assert torch.allclose(model.decode_step(tokens[0], joined), model.decode_step(tokens[0], alone), atol=1e-5)


def test_rows_per_step_are_capped_and_a_bigger_request_runs_alone(models_dir):
    cases = [("hello", dict(strategy="beam", num_beams=4, max_new_tokens=8)),  # 4 rows > cap 2
             ("the cat", dict(max_new_tokens=8)), ("gold", dict(max_new_tokens=8)),
             ("a", dict(max_new_tokens=8))]

    async def main():
        async with running_engine(models_dir, None, max_batch_size=2) as engine:
            worker = engine.get(LM)
            results = await gather_queued(worker, [worker.generate(ask(t, **p), f"c{i}")
                                                   for i, (t, p) in enumerate(cases)])
            steps = histogram_count(engine, "tserve_batch_size", {"model": LM})
            assert histogram_count(engine, "tserve_batch_size", {"model": LM}, le="4.0") == steps  # never > 4
            return results

    for got, (text, params) in zip(asyncio.run(main()), cases, strict=True):
        assert_same(got, offline(models_dir / LM, [text], params))


def test_rows_leaving_shrink_the_visible_span(models_dir):
    """When the longest request leaves, the others stop attending over its positions (no growth under load)."""
    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            sched = worker.scheduler
            late = StepGate(sched, when=lambda ids: ids == ["long"] and first_job_step(sched) > 30)
            first = asyncio.create_task(worker.generate(ask("hello world", max_new_tokens=40,
                                                                                       min_new_tokens=40), "long"))
            await late.until_parked()  # "long" is past 30 of its 40 tokens
            second = asyncio.create_task(worker.generate(ask("a", max_new_tokens=60, min_new_tokens=60),
                                                         "joins"))
            await wait_until(lambda: sched.num_waiting == 1)
            alone = StepGate(sched, when=lambda ids: batch_ids(sched) == ["joins"])  # held once "long" has left
            late.release()
            await first
            assert not second.done()
            await alone.until_parked()

            def span():
                cache = worker.scheduler.batch.cache
                return cache.max_length, int(cache.lengths.max())

            visible, longest = span()  # read while the worker is held between steps
            assert visible == longest
            alone.release()
            await second

    asyncio.run(main())
