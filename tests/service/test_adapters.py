"""LoRA hot swapping: replace/unload under load, LRU eviction of idle adapters only, refusals."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from model.lora import adapter_names
from service.engine.errors import InvalidRequest, NotFound, QueueFull
from tests.helpers import StepGate, step_until, stepping, wait_until
from tests.service.conftest import ADAPTERS, LM, MT, ask, assert_same, make_adapter, offline, running_engine

# Long enough to stay in flight while the test steps the worker through the other requests (a dozen steps or so).
LONG = dict(max_new_tokens=40, min_new_tokens=40)


@pytest.fixture
def lm_adapters(tmp_path, models_dir):
    """An adapters root with three adapters a, b, c of tiny-lm (different seeds)."""
    for seed, name in enumerate("abc", start=1):
        make_adapter(models_dir / LM, tmp_path / LM / name, seed=seed)
    return tmp_path


def test_replace_and_unload_while_in_flight(models_dir, lm_adapters):
    v1, v2 = lm_adapters / LM / "a", lm_adapters / LM / "b"

    async def main():
        async with running_engine(models_dir, lm_adapters) as engine:
            worker = engine.get(LM)
            await worker.load_adapter("swap", v1)
            gate = StepGate(worker.scheduler)  # the worker makes each model call when the test lets it
            first = asyncio.create_task(worker.generate(ask("hello", **LONG, adapter="swap"), "on-v1"))
            await step_until(gate, lambda: worker.scheduler.num_rows == 1)
            await stepping(gate, worker.load_adapter("swap", v2))  # replaced while "on-v1" runs
            second = asyncio.create_task(worker.generate(ask("the cat", **LONG, adapter="swap"), "on-v2"))
            await step_until(gate, lambda: worker.scheduler.num_running == 2)
            assert {i.name: i.in_flight for i in worker.list_adapters()}["swap"] == 2
            await stepping(gate, worker.unload_adapter("swap"))  # while "on-v2" runs
            with pytest.raises(NotFound, match="swap"):
                await stepping(gate, worker.generate(ask("a", **LONG, adapter="swap"), "too-late"))
            gate.release()
            results = await asyncio.gather(first, second)
            await wait_until(lambda: not any(n.startswith("swap.") for n in adapter_names(worker.model)))
            return results

    first, second = asyncio.run(main())
    assert_same(first, offline(models_dir / LM, ["hello"], LONG, v1))
    assert_same(second, offline(models_dir / LM, ["the cat"], LONG, v2))
    assert first[0].tokens != offline(models_dir / LM, ["hello"], LONG, v2)[0].tokens  # the versions differ


def test_lru_evicts_only_idle_adapters(models_dir, lm_adapters):
    short = dict(max_new_tokens=6)

    async def main():
        async with running_engine(models_dir, lm_adapters, max_resident_adapters=2) as engine:
            worker = engine.get(LM)
            resident = lambda: {i.name for i in worker.list_adapters() if i.resident}  # noqa: E731
            assert resident() == {"a", "b"} and worker.info.adapters == ["a", "b", "c"]  # c: known, lazy
            gate = StepGate(worker.scheduler)  # the worker makes each model call when the test lets it
            busy_a = asyncio.create_task(worker.generate(ask("hello", **LONG, adapter="a"), "busy-a"))
            await step_until(gate, lambda: worker.scheduler.num_running == 1)
            # busy a is now least recently used
            await stepping(gate, worker.generate(ask("x", **short, adapter="b"), "touch-b"))
            # evicts idle b, not busy a
            on_c = await stepping(gate, worker.generate(ask("gold", **short, adapter="c"), "lazy-c"))
            assert not busy_a.done()
            assert resident() == {"a", "c"}
            evictions = engine.metrics.registry.get_sample_value("tserve_adapter_evictions_total", {"model": LM})
            assert evictions == 1
            busy_c = asyncio.create_task(worker.generate(ask("the cat", **LONG, adapter="c"), "busy-c"))
            await step_until(gate, lambda: worker.scheduler.num_running == 2)
            with pytest.raises(QueueFull, match="max_resident_adapters"):
                await stepping(gate, worker.generate(ask("gold", **short, adapter="b"), "no-room"))
            gate.release()
            await asyncio.gather(busy_a, busy_c)
            on_b = await worker.generate(ask("gold", **short, adapter="b"), "b-again")  # reloaded from disk
            return on_c, on_b

    on_c, on_b = asyncio.run(main())
    assert_same(on_c, offline(models_dir / LM, ["gold"], short, lm_adapters / LM / "c"))
    assert_same(on_b, offline(models_dir / LM, ["gold"], short, lm_adapters / LM / "b"))


def test_adapter_for_another_base_is_refused(models_dir, adapters_dir, tmp_path):
    wrong = tmp_path / LM / "wrong"
    shutil.copytree(adapters_dir / MT / ADAPTERS[MT], wrong)  # a seq2seq adapter under the causal model

    async def main():
        async with running_engine(models_dir, tmp_path) as engine:
            worker = engine.get(LM)
            assert worker.info.adapters == []  # refused at start-up, logged, forgotten
            with pytest.raises(InvalidRequest, match="wrong.*not a target"):
                await worker.load_adapter("wrong", wrong)
            assert worker.info.adapters == []
            return await worker.generate(ask("a", max_new_tokens=4), "still-serving")

    assert len(asyncio.run(main())) == 1


def test_only_the_adapters_directory_is_read(models_dir, adapters_dir, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(adapters_dir, root)
    outside = tmp_path / "outside"
    shutil.copytree(adapters_dir / LM / ADAPTERS[LM], outside)
    (root / LM / "link").symlink_to(outside, target_is_directory=True)

    async def main():
        async with running_engine(models_dir, root) as engine:
            worker = engine.get(LM)
            assert worker.info.adapters == [ADAPTERS[LM]]  # the symlinked directory is skipped
            with pytest.raises(InvalidRequest, match="outside the adapters directory"):
                await worker.load_adapter("x", outside)
            with pytest.raises(InvalidRequest, match="outside the adapters directory"):
                await worker.load_adapter("x", root / LM / "link")
            with pytest.raises(InvalidRequest, match="outside the adapters directory"):
                await worker.load_adapter("x", root / LM / ".." / ".." / "outside")
            with pytest.raises(InvalidRequest, match="adapter name"):
                await worker.load_adapter("../x", root / LM / ADAPTERS[LM])
            with pytest.raises(NotFound, match="nope"):
                await worker.unload_adapter("nope")
            with pytest.raises(NotFound, match="nope"):
                await worker.generate(ask("a", adapter="nope"), "r")
        async with running_engine(models_dir, None) as engine:
            with pytest.raises(InvalidRequest, match="no adapters directory"):
                await engine.get(LM).load_adapter("x", outside)

    asyncio.run(main())
