"""Vocabulary maps in the engine: a translator whose directory holds vmap.txt keeps each output to its source's
candidates by default (the offline search with the map, greedy and beam), ``use_vmap: false`` opts out, rows
with and without the map share a batch without changing each other's outputs, a map asked of a model without one
is a 422, and a map naming tokens the model does not have fails that model's load with the reason."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from model.checkpoint import checkpoint_vocabulary_map, load_checkpoint
from model.vocab_map import VMAP_FILE, VocabularyMap
from service.engine.errors import InvalidRequest
from tests.helpers import gather_queued
from tests.service.conftest import LM, MT, ask, assert_same, offline, running_engine
from tests.service.fixtures import write_translation
from training.cli import main as training_main

TEXTS = ["the file could not be opened", "cannot open the file", "the cat sat on the mat"]
GREEDY, BEAM = dict(max_new_tokens=10), dict(strategy="beam", num_beams=3, max_new_tokens=8)
PLAIN_MT, BROKEN_MT = "plain-mt", "broken-mt"


@pytest.fixture(scope="module")
def mapped_models(models_dir: Path, tmp_path_factory) -> Path:
    """The tiny translator with a map that leaves out every token its unrestricted outputs of TEXTS produce (but
    their sources'), a copy without a map, one with a broken map, and the causal LM."""
    root = tmp_path_factory.mktemp("vmap-models")
    for name, source in ((MT, MT), (PLAIN_MT, MT), (BROKEN_MT, MT), (LM, LM)):
        shutil.copytree(models_dir / source, root / name)
    ckpt = load_checkpoint(root / MT, device="cpu")
    tokenizer = ckpt.tokenizer
    produced = {t for out in offline(root / MT, TEXTS, GREEDY) for t in out.tokens}
    sources = {t for text in TEXTS for t in tokenizer.encode(text)}
    always = frozenset(range(7, tokenizer.vocab_size)) - (produced - sources)
    vmap = VocabularyMap(always, {}, copy_source=True)
    spell = tokenizer.backend.id_to_token
    (root / MT / VMAP_FILE).write_text(vmap.dump(spell, spell), encoding="utf-8")
    (root / BROKEN_MT / VMAP_FILE).write_text("\tno-such-token-in-this-vocabulary\n", encoding="utf-8")
    return root


def test_a_translator_keeps_to_its_map_by_default_and_opts_out_per_request(mapped_models):
    async def main():
        async with running_engine(mapped_models, None) as engine:
            worker = engine.get(MT)
            assert worker.runner.vocab_map is not None
            mapped = [await worker.generate(ask(t, **GREEDY), f"g{i}") for i, t in enumerate(TEXTS)]
            beamed = [await worker.generate(ask(t, **BEAM), f"b{i}") for i, t in enumerate(TEXTS)]
            # One batch: rows with and without the map.
            mixed = await gather_queued(worker, [worker.generate(ask(t, use_vmap=i % 2 == 0, **GREEDY), f"m{i}")
                                                 for i, t in enumerate(TEXTS)])
            plain = [await worker.generate(ask(t, use_vmap=False, **GREEDY), f"p{i}") for i, t in enumerate(TEXTS)]
            return mapped, beamed, mixed, plain

    mapped, beamed, mixed, plain = asyncio.run(main())
    vmap = checkpoint_vocabulary_map(load_checkpoint(mapped_models / MT, device="cpu"))
    tokenizer = load_checkpoint(mapped_models / MT, device="cpu").tokenizer
    for i, text in enumerate(TEXTS):
        assert_same(mapped[i], offline(mapped_models / MT, [text], GREEDY))
        assert_same(beamed[i], offline(mapped_models / MT, [text], BEAM))
        assert_same(plain[i], offline(mapped_models / MT, [text], {**GREEDY, "use_vmap": False}))
        assert_same(mixed[i], mapped[i] if i % 2 == 0 else plain[i])
        allowed = set(vmap.candidates(tokenizer.encode(text, add_eos=True)))
        assert set(mapped[i][0].tokens) <= allowed
    assert any(m[0].tokens != p[0].tokens for m, p in zip(mapped, plain, strict=True))  # the map did restrict


def test_a_map_asked_of_a_model_without_one_is_invalid_and_a_broken_map_fails_the_load(mapped_models):
    async def main():
        async with running_engine(mapped_models, None) as engine:
            assert set(engine.load_errors) == {BROKEN_MT}
            assert "no-such-token-in-this-vocabulary" in engine.load_errors[BROKEN_MT]
            for name, message in ((PLAIN_MT, "no vocabulary map (vmap.txt"), (LM, "causal_lm models take none")):
                with pytest.raises(InvalidRequest, match=re.escape(message)):
                    await engine.get(name).generate(ask("hello", use_vmap=True, max_new_tokens=3), "r")
            out = await engine.get(PLAIN_MT).generate(ask(TEXTS[0], **GREEDY), "ok")  # unset: no map, no error
            return out

    out = asyncio.run(main())
    assert_same(out, offline(mapped_models / PLAIN_MT, [TEXTS[0]], GREEDY))


def test_build_vmap_writes_a_map_the_model_loads_and_evaluate_scores_it(models_dir, tmp_path, capsys):
    """`python -m training build-vmap` counts the training pairs into the model's vmap.txt (read back by the
    loader, far fewer candidates than the vocabulary); `evaluate --vmap` decodes with it and merges its metrics
    under "vmap", beside the plain ones."""
    model = tmp_path / MT
    shutil.copytree(models_dir / MT, model)
    train = write_translation(tmp_path / "train.tsv", 64, 1)
    assert training_main(["build-vmap", "--model", str(model), "--train", str(train), "--per-token", "4",
                          "--always", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pairs"] == 64 and report["source_tokens"] > 0
    assert report["mean_candidates"] < report["vocab_size"] / 2
    vmap = checkpoint_vocabulary_map(load_checkpoint(model, device="cpu"))
    assert vmap is not None and len(vmap.entries) == report["source_tokens"]
    for flags in ([], ["--vmap"]):
        assert training_main(["evaluate", "--model", str(model), "--test", str(train), "--beams", "1",
                              "--max-examples", "16", *flags]) == 0
    metrics = json.loads((model / "metrics.json").read_text())
    assert "bleu" in metrics["vmap"] and metrics["vmap"]["test_examples"] == 16
    assert training_main(["evaluate", "--model", str(models_dir / MT), "--test", str(train), "--vmap"]) == 1
    assert "has no vmap.txt" in capsys.readouterr().err
