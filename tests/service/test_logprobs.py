"""Log-probabilities through the engine: batched with other requests, streamed or not, every strategy and family,
equal to model.generation's offline search of the request alone."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from pydantic import ValidationError

from service.api.convert import generate_output
from service.api.schemas import GenerateRequest
from tests.helpers import gather_queued
from tests.service.conftest import ADAPTERS, LM, MT, ask, assert_same, assert_same_logprobs, offline, running_engine

CASES = [
    (LM, "the quick brown", dict(max_new_tokens=8, logprobs=3)),
    (LM, "hello world", dict(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=6, logprobs=2)),
    (LM, "to be or", dict(strategy="sample", seed=3, temperature=0.8, max_new_tokens=8, logprobs=0)),
    (LM, "numbers 0 1", dict(max_new_tokens=8)),  # no logprobs in the same batch
    (MT, "delete the file", dict(strategy="beam", num_beams=3, max_new_tokens=8, logprobs=4)),
    (MT, "open the folder", dict(max_new_tokens=8, logprobs=1)),
]


def test_logprobs_in_a_mixed_batch_equal_each_request_alone(models_dir):
    async def main():
        async with running_engine(models_dir, None) as engine:
            results = {}
            for model in (LM, MT):
                worker = engine.get(model)
                cases = [(i, text, fields) for i, (m, text, fields) in enumerate(CASES) if m == model]
                outputs = await gather_queued(worker, [worker.generate(ask(text, **fields), f"r{i}")
                                                       for i, text, fields in cases])
                results |= {i: out for (i, _, _), out in zip(cases, outputs, strict=True)}
            return results

    results = asyncio.run(main())
    for i, (model, text, fields) in enumerate(CASES):
        assert_same(results[i], offline(models_dir / model, [text], fields))
        assert (results[i][0].logprobs is None) == ("logprobs" not in fields)


@pytest.mark.parametrize("fields", [dict(max_new_tokens=10, logprobs=2),
                                    dict(strategy="beam", num_beams=2, max_new_tokens=6, logprobs=2)])
def test_streamed_logprobs_equal_the_unstreamed_ones(models_dir, adapters_dir, fields):
    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(LM)
            request = ask("the quick brown", adapter=ADAPTERS[LM], **fields)
            whole = await worker.generate(request, "whole")
            events = [e async for e in await worker.stream(request, "streamed")]
            return whole[0], events

    whole, events = asyncio.run(main())
    streamed = [entry for e in events for entry in (e.logprobs or [])]
    if fields.get("strategy") != "beam":  # beam search streams its best sequence whole, at the end
        assert [e.token for e in events if e.token is not None] == whole.tokens
    assert_same_logprobs(streamed, whole.logprobs)


def test_logprobs_outside_zero_to_twenty_are_refused_by_the_schema():
    for value in (-1, 21):
        with pytest.raises(ValidationError, match="logprobs"):
            GenerateRequest(inputs=["hello"], logprobs=value)


def test_alternatives_leave_out_the_tokens_a_constraint_rules_out(models_dir):
    """Asked for more alternatives than a constraint allows tokens, the ruled-out ones (log-prob -inf) are not
    listed: every alternative has a finite log-prob, and the output is strict JSON."""
    async def main():
        async with running_engine(models_dir, None) as engine:
            return await engine.get(LM).generate(
                ask("answer:", logprobs=5, max_new_tokens=4, constraint={"choice": ["yes", "no"]}), "lp")

    out = asyncio.run(main())[0]
    assert out.text in ("yes", "no")
    first = out.logprobs[0].top_logprobs
    assert 1 <= len(first) < 5  # at most the two choices' first tokens
    assert all(math.isfinite(a.logprob) for e in out.logprobs for a in e.top_logprobs)
    json.dumps(generate_output(out).model_dump(), allow_nan=False)
