"""The running batch through the static decoding step (TSERVE_CUDA_GRAPHS, issue 41; service/engine/
static_decoding.py): on the CPU the step a GPU captures runs eagerly, and continuous batching over it (rows joining,
leaving, beams reordered, adapters per row, batches too big for the buffers falling back to eager steps and coming
back) serves the tokens each request gets alone offline. GET /v1/models reports the buffers; the metrics count each
step's path."""

from __future__ import annotations

import asyncio

import pytest

from model import native
from service.settings import Settings, SettingsError
from tests.helpers import StepGate, gather_queued, wait_until
from tests.reliability.helpers import inprocess_server
from tests.service.conftest import ADAPTERS, CLS, LM, MT, ask, assert_same, offline, running_engine
from tests.service.test_prefix_cache import DECODINGS, SUFFIXES, SYSTEM
from tests.service.test_speculative import CASES as SPECULATIVE
from tests.service.test_speculative import NGRAM, REPEATING, without_speculation

SIZES = "1,2,4"  # a batch of more than 4 rows decodes eagerly until rows leave
CASES = [
    ("hello world", dict(max_new_tokens=14)),
    ("the cat", dict(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=9)),
    ("a", dict(strategy="sample", seed=7, top_k=20, temperature=0.8, max_new_tokens=12)),
    ("gold", dict(max_new_tokens=5, adapter="{adapter}")),
    ("to be or", dict(max_new_tokens=10, repetition_penalty=1.3, adapter="{adapter}")),
]


@pytest.fixture(autouse=True)
def pytorch_path():
    """Eager steps and the offline reference on PyTorch ops too, as on a GPU (the static step has no C++ path)."""
    with native.using_options(decode_kernels=False):
        yield


def static_steps(engine, model: str, path: str) -> float:
    return engine.metrics.registry.get_sample_value("tserve_static_steps_total", {"model": model, "path": path}) or 0


def static_paths(engine, model: str) -> dict[str, float]:
    """Steps by path (static, or a fallback's reason), as many as the metrics counted."""
    return {sample.labels["path"]: sample.value for family in engine.metrics.registry.collect()
            if family.name == "tserve_static_steps" for sample in family.samples
            if sample.name.endswith("_total") and sample.labels["model"] == model}


def fields_for(params: dict, model: str) -> dict:
    """A case's request fields for ``model`` (its adapter named)."""
    return {k: v.format(adapter=ADAPTERS[model]) if k == "adapter" else v for k, v in params.items()}


@pytest.mark.parametrize("model", [LM, MT])
def test_a_running_batch_on_the_static_step_serves_what_each_request_gets_alone(models_dir, adapters_dir, model):
    async def main():
        async with running_engine(models_dir, adapters_dir, cuda_graphs="lazy", cuda_graph_sizes=SIZES,
                                  prefix_cache_mb=0) as engine:
            worker = engine.get(model)
            results = await gather_queued(worker, [worker.generate(ask(text, **fields_for(params, model)), f"r{i}")
                                                   for i, (text, params) in enumerate(CASES)])
            steps = {path: static_steps(engine, model, path) for path in ("static", "rows")}
            return results, steps, worker.info.static_step, worker.scheduler.static.decoder.routed_adapters

    results, steps, info, routed = asyncio.run(main())
    for got, (text, params) in zip(results, CASES, strict=True):
        fields = fields_for(params, model)
        adapter = adapters_dir / model / fields.pop("adapter") if "adapter" in fields else None
        assert_same(got, offline(models_dir / model, [text], fields, adapter))
    assert steps["rows"] > 0 and steps["static"] > 0  # 7 rows ran eagerly, then fewer on the static step
    assert len(routed) == 1  # the adapter loaded after the decoder was built is routed by the static step itself
    assert info["sizes"] == [1, 2, 4] and info["built"] and set(info["built"]) <= {1, 2, 4}
    assert info["rows"] == 4 and info["bytes"] > 0 and info["graphs"] is False


def test_rows_joining_and_leaving_a_static_batch_equal_alone(models_dir):
    first_fields = dict(strategy="beam", num_beams=2, max_new_tokens=14, min_new_tokens=14)
    second_fields = dict(max_new_tokens=40, min_new_tokens=40)

    async def main():
        async with running_engine(models_dir, None, cuda_graphs="lazy", prefix_cache_mb=0) as engine:
            worker = engine.get(MT)
            sched = worker.scheduler
            running = StepGate(sched, when=lambda ids: ids == ["first"] and sched.batch is not None
                               and sched.batch.jobs[0].search.step > 3)
            first = asyncio.create_task(worker.generate(ask("hello world", **first_fields), "first"))
            await running.until_parked()  # "first" decoded a few static steps alone
            decoder = sched.static.decoder
            adopted, kept = decoder.adopted, decoder.kept
            second = asyncio.create_task(worker.generate(ask("the cat", **second_fields), "second"))
            await wait_until(lambda: sched.num_waiting == 1)
            running.release()
            first = await first
            assert not second.done()  # it joined a running batch and outlived the rows ahead of it
            second = await second
            changes = (decoder.adopted - adopted, decoder.kept - kept)
            return first, second, changes, {k: v for k, v in static_paths(engine, MT).items() if v}

    first, second, changes, paths = asyncio.run(main())
    assert_same(first, offline(models_dir / MT, ["hello world"], first_fields))
    assert_same(second, offline(models_dir / MT, ["the cat"], second_fields))
    assert changes == (1, 1)  # the rows moved into the buffers once, when "second" joined; "first" left in place
    assert list(paths) == ["static"] and paths["static"] >= 40 - 1  # every decode step static


def test_rows_reading_cached_prefix_blocks_take_static_steps_with_the_prefix_copied_in(models_dir):
    prompts = [SYSTEM + suffix for suffix in SUFFIXES]  # one system prompt spanning blocks, four endings

    async def main():
        async with running_engine(models_dir, None, cuda_graphs="lazy") as engine:
            worker = engine.get(LM)
            results = await gather_queued(worker, [worker.generate(ask(p, **d), f"p{i}")
                                                   for i, (p, d) in enumerate(zip(prompts, DECODINGS, strict=True))])
            hits = engine.metrics.registry.get_sample_value("tserve_prefix_cache_hits_total", {"model": LM})
            paths = {path: static_steps(engine, LM, path) for path in ("static", "length")}
            return results, hits, paths

    results, hits, paths = asyncio.run(main())
    for got, prompt, decoding in zip(results, prompts, DECODINGS, strict=True):
        assert_same(got, offline(models_dir / LM, [prompt], decoding))
    assert hits > 0 and paths == {"static": max(d["max_new_tokens"] for d in DECODINGS) - 1, "length": 0}


@pytest.mark.parametrize("model", [LM, MT])
def test_verification_steps_of_drafts_run_static_at_padded_widths(models_dir, adapters_dir, model):
    tuned = dict(max_new_tokens=20, speculative=NGRAM, adapter=ADAPTERS[model])
    cases = [*SPECULATIVE, (REPEATING, tuned)]

    async def main():
        async with running_engine(models_dir, adapters_dir, cuda_graphs="lazy", prefix_cache_mb=0) as engine:
            worker = engine.get(model)
            outputs = await gather_queued(worker, [worker.generate(ask(text, **fields), f"s{i}")
                                                   for i, (text, fields) in enumerate(cases)])
            paths = {key: value for key, value in static_paths(engine, model).items() if value}
            drafted = engine.metrics.registry.get_sample_value("tserve_spec_decode_draft_tokens_total",
                                                               {"model": model})
            return outputs, paths, drafted, worker.scheduler.static.decoder.built

    outputs, paths, drafted, built = asyncio.run(main())
    for (text, fields), got in zip(cases, outputs, strict=True):
        fields = without_speculation(fields)
        adapter = adapters_dir / model / fields.pop("adapter") if "adapter" in fields else None
        assert_same(got, offline(models_dir / model, [text], fields, adapter))
    assert drafted > 0 and list(paths) == ["static"]  # every step, verification steps too, on the static step
    assert {width for _, _, width in built} >= {1, 4}  # drafts of up to 4 tokens: 5 fed tokens padded to 8, or 4


def test_startup_builds_every_size_and_get_models_reports_the_buffers(models_dir):
    with inprocess_server(models_dir, cuda_graphs="startup", cuda_graph_sizes="1,2,8", max_batch_size=4) as server, \
            server.client() as client:
        listed = {m["name"]: m for m in client.get("/v1/models").json()["data"]}
    built = listed[LM]["static_step"]
    assert built["mode"] == "startup" and built["built"] == built["sizes"] == [1, 2, 8]  # 4 rows pad up to 8
    assert built["rows"] == 8 and built["bytes"] > 0 and listed[MT]["static_step"]["built"] == [1, 2, 8]
    assert listed[CLS]["static_step"] is None


def test_off_by_default(models_dir):
    async def main():
        async with running_engine(models_dir, None) as engine:
            return engine.get(LM).info.static_step, engine.get(LM).scheduler.static

    assert asyncio.run(main()) == (None, None)


@pytest.mark.parametrize("field, value, message", [
    ("cuda_graphs", "always", "'always' is not one of off, lazy, startup"),
    ("cuda_graph_sizes", "1,two", "comma-separated integers"),
    ("cuda_graph_sizes", "0,4", "must be 1 to 1024"),
])
def test_bad_static_step_settings_are_refused_by_name(field, value, message):
    with pytest.raises(SettingsError, match=f"{field} .*{message}"):
        Settings(**{field: value})
