"""Constrained decoding in the engine: every output of the tiny random-ish LM parses and validates against its
JSON schema, matches its regex or is one of its choices, for greedy, sampling and beam search, in a batch with
unconstrained rows and adapters (which decode as alone), and the translator's outputs keep to theirs; a constraint that
cannot be used is a 422 first."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from service.engine.errors import InvalidRequest
from tests.helpers import gather_queued
from tests.service.conftest import ADAPTERS, LM, MT, ask, assert_same, offline, running_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-[a-z]{2,4}( [A-Z])?"
CHOICES = ["yes", "no", "not sure"]
# Room for the longest output SCHEMA allows (~70 characters: about a token each with the tiny models' 300-token
# BPE), so that every output ends with its grammar, not at the length limit.
LONGEST = 100
PROMPTS = ["the quick brown", "hello world", "numbers 0 1", "user record: "]
STRATEGIES = [dict(), dict(strategy="sample", temperature=1.5, seed=4, num_return_sequences=3),
              dict(strategy="beam", num_beams=3, num_return_sequences=2)]


def sequences(output) -> list:
    return output.candidates or [output]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["greedy", "sample", "beam"])
def test_every_output_matches_its_constraint(models_dir, strategy):
    constraints = [{"json_schema": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}]

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            requests = [worker.generate(ask(*PROMPTS, max_new_tokens=LONGEST, constraint=c, **strategy), f"c{i}")
                        for i, c in enumerate(constraints)]
            return await gather_queued(worker, requests)

    schema_out, regex_out, choice_out = asyncio.run(main())
    checked = 0
    for output in schema_out:
        for seq in sequences(output):
            assert seq.finish_reason == "eos", seq
            jsonschema.validate(json.loads(seq.text), SCHEMA)
            checked += 1
    for output in regex_out:
        for seq in sequences(output):
            assert re.fullmatch(REGEX, seq.text), seq.text
            checked += 1
    for output in choice_out:
        for seq in sequences(output):
            assert seq.text in CHOICES and seq.finish_reason == "eos"
            checked += 1
    per_input = {"sample": 3, "beam": 2}.get(strategy.get("strategy"), 1)
    assert checked == 3 * len(PROMPTS) * per_input
    assert all(seq.constraint_satisfied is True for out in (*schema_out, *regex_out, *choice_out)
               for seq in sequences(out))


@pytest.mark.parametrize("strategy", [STRATEGIES[0], STRATEGIES[2]], ids=["greedy", "beam"])
def test_a_translators_outputs_keep_to_its_constraint(models_dir, strategy):
    """Our own translator (byte-level BPE) decodes within the grammar too: each output one of the choices."""
    async def main():
        async with running_engine(models_dir, None) as engine:
            return await engine.get(MT).generate(ask(*PROMPTS, constraint={"choice": CHOICES}, **strategy), "mt")

    for output in asyncio.run(main()):
        for seq in sequences(output):
            assert seq.text in CHOICES and seq.finish_reason == "eos" and seq.constraint_satisfied is True, seq


def test_an_output_cut_short_says_it_does_not_satisfy_its_constraint(models_dir):
    """max_new_tokens ends a JSON object before it closes: the answer says constraint_satisfied false (the README's
    example parsed half a JSON by surprise), streamed too; an unconstrained output has no such field."""
    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            cut = await worker.generate(ask("config = ", max_new_tokens=3, constraint={"json_schema": SCHEMA}), "cut")
            events = [e async for e in await worker.stream(
                ask("config = ", max_new_tokens=3, constraint={"json_schema": SCHEMA}), "cut-stream")]
            free = await worker.generate(ask("config = ", max_new_tokens=3), "free")
            return cut[0], events, free[0]

    cut, events, free = asyncio.run(main())
    assert cut.finish_reason == "length" and cut.constraint_satisfied is False
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    assert events[-1].constraint_satisfied is False and all(e.constraint_satisfied is None for e in events[:-1])
    assert free.constraint_satisfied is None


def test_constrained_rows_leave_the_other_rows_of_their_batch_alone(models_dir, adapters_dir):
    free = dict(max_new_tokens=12)

    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(LM)
            return await gather_queued(worker, [
                worker.generate(ask(PROMPTS[0], **free), "free"),
                worker.generate(ask(PROMPTS[1], max_new_tokens=LONGEST, constraint={"json_schema": SCHEMA},
                                    adapter=ADAPTERS[LM]), "tuned-json"),
                worker.generate(ask(PROMPTS[2], adapter=ADAPTERS[LM], **free), "tuned-free"),
            ])

    free_out, json_out, tuned_out = asyncio.run(main())
    assert_same(free_out, offline(models_dir / LM, [PROMPTS[0]], free))
    assert_same(tuned_out, offline(models_dir / LM, [PROMPTS[2]], free, adapters_dir / LM / ADAPTERS[LM]))
    jsonschema.validate(json.loads(json_out[0].text), SCHEMA)


@pytest.mark.parametrize(("model", "fields", "field", "message"), [
    (LM, dict(constraint={"regex": "[a-z"}), "constraint.regex", "regex"),
    (LM, dict(constraint={"json_schema": {"type": "nonsense"}}), "constraint.json_schema", "nonsense"),
    (LM, dict(constraint={"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}}),
     "constraint.json_schema", "Unsatisfiable"),
    (LM, dict(constraint={"json_schema": {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                                          for i in range(4000)}}}),
     "constraint.json_schema", "allowed"),
    (LM, dict(constraint={"choice": CHOICES}, speculative={"method": "ngram"}), "speculative", "constraint"),
])
def test_a_constraint_that_cannot_be_used_is_refused_before_decoding(models_dir, model, fields, field, message):
    async def main():
        async with running_engine(models_dir, None) as engine:
            with pytest.raises(InvalidRequest, match=message) as caught:
                await engine.get(model).generate(ask("hello", **fields), "bad")
            assert caught.value.field == field
            assert engine.get(model).scheduler.num_running == 0

    asyncio.run(main())
