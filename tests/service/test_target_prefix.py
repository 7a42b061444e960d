"""Interactive translation through the engine: "target_prefix" continues each translation from the start a user
typed, batched with other requests (with and without prefixes, adapters, beams), streamed or not, as the offline
search continues it alone; what cannot be continued is a 422 before any decoding."""

from __future__ import annotations

import asyncio

import pytest

from service.engine.errors import InvalidRequest
from tests.helpers import gather_queued
from tests.service.conftest import ADAPTERS, LM, MT, ask, assert_same, offline, running_engine

SOURCE = "delete the file and open the folder"
CASES = [
    dict(target_prefix=["borrar el"], max_new_tokens=8, logprobs=3),
    dict(target_prefix=["abrir"], strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=8),
    dict(max_new_tokens=8),  # no prefix, same batch
    dict(target_prefix=[""], max_new_tokens=8),  # an empty prefix is no prefix
]


def test_prefixed_rows_in_a_mixed_batch_equal_each_alone(models_dir, adapters_dir):
    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(MT)
            requests = [worker.generate(ask(SOURCE, **fields), f"r{i}") for i, fields in enumerate(CASES)]
            requests.append(worker.generate(ask(SOURCE, adapter=ADAPTERS[MT], **CASES[0]), "tuned"))
            return await gather_queued(worker, requests)

    outputs = asyncio.run(main())
    for fields, got in zip(CASES, outputs, strict=False):
        assert_same(got, offline(models_dir / MT, [SOURCE], fields))
    assert_same(outputs[-1], offline(models_dir / MT, [SOURCE], CASES[0], adapters_dir / MT / ADAPTERS[MT]))
    assert outputs[0][0].tokens != outputs[2][0].tokens  # the premise: the prefix changes what comes next
    assert outputs[3][0].tokens == outputs[2][0].tokens


def test_a_streamed_continuation_is_the_unstreamed_one(models_dir):
    fields = dict(target_prefix=["borrar el"], max_new_tokens=8)

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(MT)
            whole = await worker.generate(ask(SOURCE, **fields), "whole")
            events = [e async for e in await worker.stream(ask(SOURCE, stream=True, **fields), "streamed")]
            return whole[0], events

    whole, events = asyncio.run(main())
    assert "".join(e.text for e in events) == whole.text
    assert [e.token for e in events if e.token is not None] == whole.tokens


@pytest.mark.parametrize(("model", "fields", "message"), [
    (LM, dict(target_prefix=["x"]), "causal_lm"),
    (MT, dict(target_prefix=["a", "b"]), "one entry per input"),
    (MT, dict(target_prefix=["borrar " * 40], max_new_tokens=8), "max_len"),
])
def test_what_cannot_be_continued_is_refused(models_dir, model, fields, message):
    async def main():
        async with running_engine(models_dir, None) as engine:
            with pytest.raises(InvalidRequest, match=message) as caught:
                await engine.get(model).generate(ask(SOURCE, **fields), "bad")
            assert caught.value.field.startswith("target_prefix")

    asyncio.run(main())
