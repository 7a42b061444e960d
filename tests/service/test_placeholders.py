"""Placeholder-safe translation end to end: a tiny translator trained by the project's code on commands that
carry placeholders (protected pairs: its tokenizer keeps the sentinels), served by the engine. Every output
holds exactly its input's placeholders (repaired where the model lost one, and then flagged), streamed and not;
``protect_placeholders: false`` turns it off; a causal LM refuses it."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest

from model.checkpoint import load_checkpoint
from model.placeholders import check, find
from service.api.convert import generate_output
from service.engine.errors import InvalidRequest
from tests.service.conftest import LM, ask, running_engine
from tests.service.fixtures import OBJECTS, PLACEHOLDERS_SEEN, VERBS

UNSEEN = ["%(datestr)s", "{count}", "https://example.org/a", "${VAR}", "-n", "john@example.org"]
SEEN = PLACEHOLDERS_SEEN
MT_PH = "tiny-mt-ph"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, models_dir: Path, placeholder_translator: Path) -> Path:
    root = tmp_path_factory.mktemp("placeholder-models")
    (root / MT_PH).symlink_to(placeholder_translator)
    (root / LM).symlink_to(models_dir / LM)
    return root


def test_training_on_protected_pairs_gives_the_tokenizer_its_sentinels(models):
    checkpoint = load_checkpoint(models / MT_PH, device="cpu")
    assert checkpoint.tokenizer.sentinels >= 2  # pairs of one or two placeholders: sentinels 0 and 1
    assert 0 <= checkpoint.metrics["valid_placeholders_ok"] <= 1  # validation reports the share kept


def test_every_translation_keeps_its_inputs_placeholders_streamed_or_not(models):
    rng = random.Random(3)
    texts = [f"{rng.choice(list(VERBS))} {rng.choice(list(OBJECTS))} {' '.join(rng.sample(SEEN + UNSEEN, k))}"
             for k in (1, 2) for _ in range(6)]
    texts.append("Invalid date string %(datestr)s given format %(format)s")  # the example, unseen words

    async def main():
        async with running_engine(models, None) as engine:
            worker = engine.get(MT_PH)
            whole = await worker.generate(ask(*texts, max_new_tokens=24), "w")
            beams = await worker.generate(ask(*texts[:4], max_new_tokens=24, strategy="beam", num_beams=3,
                                              num_return_sequences=2), "b")
            streamed = []
            for i, text in enumerate(texts[:4]):
                events = [e async for e in await worker.stream(ask(text, max_new_tokens=24, stream=True), f"s{i}")]
                streamed.append(events)
            raw = await worker.generate(ask(*texts, max_new_tokens=24, protect_placeholders=False), "raw")
            return whole, beams, streamed, raw

    whole, beams, streamed, raw = asyncio.run(main())
    for text, out in zip(texts, whole, strict=True):
        assert Counter(find(out.text)) == Counter(find(text)) and check(text, out.text), (text, out.text)
        assert out.placeholders_ok in (True, False)
        assert "\uff5f" not in out.text  # no sentinel left over
    kept = sum(out.placeholders_ok for out in whole)
    assert kept >= len(texts) // 2, [(t, o.text) for t, o in zip(texts, whole, strict=True)]  # the model copies
    for text, out in zip(texts[:4], beams, strict=True):
        assert all(check(text, c.text) for c in out.candidates), out
    for events, out in zip(streamed, whole[:4], strict=True):
        assert "".join(e.text for e in events) == out.text  # the stream restores as it goes, repairs at the end
        assert events[-1].placeholders_ok == out.placeholders_ok
        assert all(e.placeholders_ok is None for e in events[:-1])
    for out in raw:
        assert out.placeholders_ok is None and "placeholders_ok" not in generate_output(out).model_fields_set


def test_a_target_prefix_holding_a_placeholder_is_not_given_it_again(models):
    """The continuation of a prefix that already holds one of the source's placeholders carries only the rest: the
    whole translation (prefix + output) holds each exactly as often as the source."""
    texts = ["copy the file {count} to https://example.org/a", "open the folder %(datestr)s -n"]
    prefixes = ["{count}", "-n"]

    async def main():
        async with running_engine(models, None) as engine:
            return await engine.get(MT_PH).generate(ask(*texts, target_prefix=prefixes, max_new_tokens=24), "p")

    for text, prefix, out in zip(texts, prefixes, asyncio.run(main()), strict=True):
        assert Counter(find(prefix + " " + out.text)) == Counter(find(text)), (prefix, out.text)


def test_protect_placeholders_is_for_translation_models_only(models):
    async def main():
        async with running_engine(models, None) as engine:
            with pytest.raises(InvalidRequest) as caught:
                await engine.get(LM).generate(ask("hello %s", protect_placeholders=True), "lm")
            default = await engine.get(LM).generate(ask("hello %s", max_new_tokens=4), "lm-default")
            return caught.value, default

    error, default = asyncio.run(main())
    assert error.field == "protect_placeholders" and "seq2seq" in str(error)
    assert default[0].placeholders_ok is None  # a causal LM's output is its own
