"""Speculative decoding in the running batch: speculating requests (asked for, or by the model's default) give
the outputs of plain offline decoding, mixed in one batch with requests that do not speculate, streamed or not;
the metrics count drafts and acceptances; what cannot speculate is refused (or, for a default, not drafted)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from model.causal_lm import CausalLM
from model.checkpoint import load_checkpoint, save_checkpoint
from model.tokenizer import Tokenizer
from service.api.routes.models import model_schema
from service.engine.errors import InvalidRequest
from tests.helpers import gather_queued
from tests.service.conftest import ADAPTERS, LM, MT, ask, assert_same, offline, running_engine

REPEATING = "the cat sat on the mat and the cat sat on the mat and the cat"
NGRAM = {"method": "ngram", "num_tokens": 4}
CASES = [
    (REPEATING, dict(max_new_tokens=24, speculative=NGRAM, logprobs=2)),
    (REPEATING, dict(strategy="sample", seed=5, temperature=0.8, max_new_tokens=24, speculative=NGRAM)),
    ("hello world, hello world, hello", dict(max_new_tokens=20, speculative={"method": "ngram", "num_tokens": 2})),
    (REPEATING, dict(max_new_tokens=16)),  # does not speculate, same batch
    ("numbers 0 1 2 3", dict(strategy="beam", num_beams=2, max_new_tokens=8)),
]


def counter(engine, name: str, model: str) -> float:
    return engine.metrics.registry.get_sample_value(name, {"model": model}) or 0.0


def without_speculation(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if k != "speculative"}


def test_speculating_requests_in_a_mixed_batch_equal_plain_decoding(models_dir, adapters_dir):
    tuned = dict(max_new_tokens=20, speculative=NGRAM, adapter=ADAPTERS[LM])  # its rows verify through the adapter

    async def main():
        async with running_engine(models_dir, adapters_dir) as engine:
            worker = engine.get(LM)
            requests = [worker.generate(ask(text, **fields), f"r{i}") for i, (text, fields) in enumerate(CASES)]
            requests.append(worker.generate(ask(REPEATING, **tuned), "tuned"))
            outputs = await gather_queued(worker, requests)
            drafted = counter(engine, "tserve_spec_decode_draft_tokens_total", LM)
            accepted = counter(engine, "tserve_spec_decode_accepted_tokens_total", LM)
            return outputs, drafted, accepted

    outputs, drafted, accepted = asyncio.run(main())
    for (text, fields), got in zip(CASES, outputs, strict=False):
        assert_same(got, offline(models_dir / LM, [text], without_speculation(fields)))
    adapter_fields = {k: v for k, v in without_speculation(tuned).items() if k != "adapter"}
    assert_same(outputs[-1], offline(models_dir / LM, [REPEATING], adapter_fields, adapters_dir / LM / ADAPTERS[LM]))
    assert drafted > 0 and 0 < accepted <= drafted


def test_a_streamed_speculating_request_sends_every_token(models_dir):
    fields = dict(max_new_tokens=24, logprobs=1)

    async def main():
        async with running_engine(models_dir, None) as engine:
            worker = engine.get(LM)
            events = [e async for e in await worker.stream(ask(REPEATING, stream=True, speculative=NGRAM, **fields),
                                                           "streamed")]
            return events, counter(engine, "tserve_spec_decode_accepted_tokens_total", LM)

    events, accepted = asyncio.run(main())
    want = offline(models_dir / LM, [REPEATING], fields)[0]
    assert accepted > 0  # some steps gave several tokens, each its own event
    assert [e.token for e in events if e.token is not None] == want.tokens
    assert "".join(e.text for e in events) == want.text
    assert [entry.logprob for e in events for entry in (e.logprobs or [])] == \
        pytest.approx([entry.logprob for entry in want.logprobs], abs=1e-4)


def test_the_models_default_speculates_where_it_can_and_a_request_can_turn_it_off(models_dir):
    fields = dict(max_new_tokens=20)

    async def main():
        async with running_engine(models_dir, None, speculative=f"none,{MT}=ngram:3,{LM}=ngram:3") as engine:
            worker = engine.get(LM)
            default = await worker.generate(ask(REPEATING, **fields), "default")
            drafted = counter(engine, "tserve_spec_decode_draft_tokens_total", LM)
            off = await worker.generate(ask(REPEATING, speculative={"method": "none"}, **fields), "off")
            two = await worker.generate(ask(REPEATING, REPEATING, **fields), "two-inputs")  # cannot: plain
            assert counter(engine, "tserve_spec_decode_draft_tokens_total", LM) == drafted
            translated = await engine.get(MT).generate(ask("delete the file", max_new_tokens=10), "mt")
            return default, drafted, off, two, translated

    default, drafted, off, two, translated = asyncio.run(main())
    want = offline(models_dir / LM, [REPEATING], fields)
    assert drafted > 0
    assert_same(default, want)
    assert_same(off, want)
    assert_same(two, offline(models_dir / LM, [REPEATING, REPEATING], fields))
    assert_same(translated, offline(models_dir / MT, ["delete the file"], dict(max_new_tokens=10)))


@pytest.mark.parametrize("fields", [dict(strategy="beam", num_beams=2),
                                    dict(strategy="sample", num_return_sequences=2)])
def test_a_request_that_cannot_speculate_is_refused(models_dir, fields):
    async def main():
        async with running_engine(models_dir, None) as engine:
            with pytest.raises(InvalidRequest, match="one input and one sequence") as caught:
                await engine.get(LM).generate(ask(REPEATING, speculative=NGRAM, **fields), "bad")
            assert caught.value.field == "speculative"

    asyncio.run(main())


@pytest.fixture(scope="module")
def draft_models_dir(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test's causal LM and translator, with two would-be draft models: "lm-draft" (the LM's tokenizer, a
    smaller random model) and "lm-alien" (another vocabulary)."""
    root = tmp_path_factory.mktemp("drafts")
    for name in (LM, MT):
        (root / name).symlink_to(models_dir / name)
    target = load_checkpoint(models_dir / LM, device="cpu")
    torch.manual_seed(1)
    small = dataclasses.replace(target.config, d_model=16, n_heads=2, d_ff=32, n_layers=1)
    save_checkpoint(root / "lm-draft", CausalLM(small).eval(), target.tokenizer)
    alien = Tokenizer.train(["a small corpus of other words, " * 20], vocab_size=270)
    save_checkpoint(root / "lm-alien", CausalLM(dataclasses.replace(small, vocab_size=alien.vocab_size)).eval(),
                    alien)
    return root


def test_drafts_of_a_draft_model_in_a_mixed_batch_equal_plain_decoding(draft_models_dir, adapters_dir):
    draft = {"method": "draft_model", "num_tokens": 3}
    cases = [(REPEATING, dict(max_new_tokens=24, speculative=draft, logprobs=1)),
             (REPEATING, dict(strategy="sample", seed=7, temperature=0.9, max_new_tokens=20, speculative=draft)),
             ("hello world, hello world, hello", dict(max_new_tokens=20, speculative=NGRAM)),
             ("numbers 0 1 2 3", dict(max_new_tokens=12, speculative=draft, adapter=ADAPTERS[LM]))]

    async def main():
        async with running_engine(draft_models_dir, adapters_dir, draft_model=f"{LM}=lm-draft") as engine:
            worker = engine.get(LM)
            assert worker.info.draft_model == "lm-draft" and engine.get("lm-draft").info.draft_model is None
            assert model_schema(worker.info, 0).draft_model == "lm-draft"  # what GET /v1/models answers
            requests = [worker.generate(ask(text, **fields), f"d{i}") for i, (text, fields) in enumerate(cases)]
            return await gather_queued(worker, requests), counter(engine, "tserve_spec_decode_draft_tokens_total", LM)

    outputs, drafted = asyncio.run(main())
    for (text, fields), got in zip(cases, outputs, strict=True):
        plain = {k: v for k, v in without_speculation(fields).items() if k != "adapter"}
        adapter = adapters_dir / LM / fields["adapter"] if "adapter" in fields else None
        assert_same(got, offline(draft_models_dir / LM, [text], plain, adapter))
    assert drafted > 0


def test_a_draft_model_that_cannot_draft_fails_its_targets_load_with_the_reason(draft_models_dir):
    async def main():
        async with running_engine(draft_models_dir, None, draft_model=f"{LM}=lm-alien,{MT}=lm-draft") as engine:
            return engine.load_errors, sorted(m.name for m in engine.models())

    errors, loaded = asyncio.run(main())
    assert "vocabularies" in errors[LM] and "causal LM" in errors[MT]
    assert loaded == ["lm-alien", "lm-draft"]


def test_asking_for_a_draft_model_where_none_is_configured_is_a_clear_error(models_dir):
    async def main():
        async with running_engine(models_dir, None) as engine:
            with pytest.raises(InvalidRequest, match="no draft model") as caught:
                await engine.get(LM).generate(ask(REPEATING, speculative={"method": "draft_model"}), "no-draft")
            assert caught.value.field == "speculative.method"

    asyncio.run(main())
