"""The engine's features on the encoder-decoder families of issue 39 (BART, mBART-50, M2M100, NLLB-200, T5 v1.1),
each a random model saved by `transformers` over its own tokenizer (tests/hf_seq2seq_tokenizers.py; BART's the
byte-level BPE of RoBERTa's layout, with bart-large-cnn's forced <s>), one served models folder for all:

- the C++ encoder and decoding step against the PyTorch path, float32 and int8, greedy and beam-4, forced first tokens;
- the source cache: a repeated source and a target prefix (T5's too: its relative bias never reads a shared prefix)
  hit it and give generate_seq2seq's uncached tokens, with beam search, a target language and placeholder checks;
- n-gram drafts verified in one step give the plain tokens;
- placeholders through each family's tokenizer (no sentinels: checked, and reported where the vocabulary lacks them);
- constraints: served on BART's byte-level BPE (refused by name on SentencePiece vocabularies), and the engine's
  masks keep a translation in its grammar after its forced first token (vocabulary maps per target language: tests
  of their own).
"""

from __future__ import annotations

import asyncio
import copy
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from model import int8_kernel, native
from model.checkpoint import load_hf_checkpoint
from model.constraints import Constraint
from model.constraints import compile as compile_constraint
from model.decoding import make_search
from model.fast_step import plan_for
from model.generation import generate_seq2seq
from model.generation_config import GenerationConfig
from model.placeholders import check, find, protect, sentinels_for
from model.prefix_cache import PrefixCache
from model.quantize import quantize
from model.search import force_first_tokens, run_search
from service.engine.languages import language_plan
from service.engine.runners import Seq2SeqRunner
from tests.helpers import block_worker
from tests.hf_compare import best_tokens, randomize
from tests.hf_seq2seq_tokenizers import m2m100, mbart50, nllb, t5
from tests.hf_tokenizers import roberta_bpe, write_directory
from tests.model import hf_t5
from tests.model.test_native_step import _Watched
from tests.reliability.helpers import inprocess_server, wait_until
from tests.service.conftest import ask, running_engine
from tests.service.server import metric_samples
from tests.service.test_seq2seq_languages import translator

transformers = pytest.importorskip("transformers")

BART_BOS = 0  # forced first by bart-large-cnn's generation_config.json
FAMILIES = ("bart", "mbart", "m2m100", "nllb", "t5")
TARGET = {"mbart": "fr_XX", "m2m100": "de", "nllb": "deu_Latn"}  # a target language per multilingual family
TEXTS = ["the quick brown fox jumps over the lazy dog", "print('hello')", "open {name} now, %s left"]
HITS, DRAFTED = "tserve_prefix_cache_hits_total", "tserve_spec_decode_draft_tokens_total"
NEW, MIN = 8, 3  # new tokens at most, at least (a random model may end at once)
# Placeholders a copying model must carry through each tokenizer's encode and decode (model.placeholders.PATTERN).
PLACEHOLDERS = ["{name}", "{0}", "{}", "%s", "%d", "%(count)d", "%1$s", "%%", "$HOME", "${VAR}", "--force", "-n", "<b>",
                "&amp;", "https://example.org/a?b=1", "john@example.org"]


def _t5_directory(directory: Path, tokenizer: Path) -> Path:
    """A random T5 v1.1 (Flan-T5's layout: gated GELU, RMSNorm, relative position bias, untied head) over
    ``tokenizer``'s vocabulary, with T5's q scaling folded in (tests/model/hf_t5.py's sizes)."""
    size = len(transformers.AutoTokenizer.from_pretrained(tokenizer))
    config = transformers.T5Config(**{**hf_t5.T5, "vocab_size": size, "feed_forward_proj": "gated-gelu",
                                      "tie_word_embeddings": False})
    model = transformers.T5ForConditionalGeneration(config)
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.shared.weight))
    randomize(model, seed=3, eos_id=hf_t5.EOS, eos_boost=2.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".q.weight"):
                p.mul_(config.d_kv**-0.5)
    model.save_pretrained(directory)
    for path in tokenizer.iterdir():
        if path.name != "config.json":
            (directory / path.name).write_bytes(path.read_bytes())
    return directory


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, Path]:
    """Each family's directory under one models folder (the served one)."""
    root = tmp_path_factory.mktemp("families")
    bart_tokenizer = write_directory(root / "bart-tok", roberta_bpe(), {
        "tokenizer_class": "BartTokenizer", "pad_token": "<pad>", "mask_token": "<mask>"}, "bart")
    bart = translator(root, "bart", "bart", bart_tokenizer)
    generation = json.loads((bart / "generation_config.json").read_text())
    (bart / "generation_config.json").write_text(json.dumps({**generation, "forced_bos_token_id": BART_BOS}))
    return {
        "bart": bart,
        "mbart": translator(root, "mbart", "mbart", mbart50(root / "mbart-tok", "json")),
        "m2m100": translator(root, "m2m100", "m2m100", m2m100(root / "m2m100-tok")),
        "nllb": translator(root, "nllb", "nllb", nllb(root / "nllb-tok", "json")),
        "t5": _t5_directory(root / "models" / "t5", t5(root / "t5-tok", "json")),
    }


@pytest.fixture(scope="module")
def checkpoints(directories):
    return {name: load_hf_checkpoint(directory, device="cpu") for name, directory in directories.items()}


@pytest.fixture(scope="module")
def served(directories):
    with inprocess_server(directories["bart"].parent, request_timeout_s=300) as server, \
            server.client(timeout=120) as client:
        yield server, client


def _forced(checkpoint, family: str, count: int) -> list[int | None]:
    """Each input's forced first token as the service computes it (a target language's, BART's <s>, or None)."""
    return language_plan(family, checkpoint, TARGET.get(family), None, count).forced


def _config(strategy: str, eos: int) -> GenerationConfig:
    return GenerationConfig(strategy=strategy, num_beams=4 if strategy == "beam" else 1, max_new_tokens=NEW,
                            min_new_tokens=MIN, eos_token_id=eos)


def _generate(model, prompts, forced, strategy: str, eos: int) -> list[list[int]]:
    return best_tokens(generate_seq2seq(model, prompts, _config(strategy, eos), forced_first=forced))


def _from_the_source_cache(model, prompts, forced, strategy: str, eos: int) -> list[list[int]]:
    """The tokens of a search the engine's runner (service/engine/runners.py) prefills from a source cache that
    already holds every prompt's encoding (each row a hit)."""
    runner = Seq2SeqRunner(model, PrefixCache(budget_bytes=1 << 24))
    adapters, targets = [None] * len(prompts), [[] for _ in prompts]
    runner.prefill(prompts, adapters, targets)
    first, cache = runner.prefill(prompts, adapters, targets)
    assert runner.prefix_cache.stats.hit_tokens == sum(map(len, prompts))
    search = make_search(_config(strategy, eos), len(prompts), prefixes=runner.prefixes(prompts, targets))
    first = force_first_tokens(first, forced)
    return best_tokens(run_search(search, first, lambda t: runner.decode(t, cache), cache.select))


@pytest.mark.skipif(native.kernels() is None, reason="the C++ decode kernels do not run here")
@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_c_step_gives_the_pytorch_paths_tokens(checkpoints, family, dtype):
    """Greedy and beam-4 with each row's forced first token: the C++ encoder and decoding step (their calls counted)
    give the tokens of LayerStack.forward (the PyTorch path, itself equal to transformers), int8 against the PyTorch
    path over the same int8 layers; and so do sources read from the source cache (model.prefix_cache)."""
    if dtype == "int8" and int8_kernel.kernel() is None:
        pytest.skip("our int8 kernel does not run here")
    checkpoint = checkpoints[family]
    model = checkpoint.model if dtype == "float32" else quantize(copy.deepcopy(checkpoint.model), "int8")
    assert model.decoder.native and model.encoder.native  # pre-LN, relative bias, gated GELU, RMSNorm: all bound
    prompts = checkpoint.encode_prompts(TEXTS)
    forced = _forced(checkpoint, family, len(TEXTS))
    plan = plan_for(model.decoder)
    counted = plan.native = _Watched(plan.native)
    for strategy in ("greedy", "beam"):
        fast = _generate(model, prompts, forced, strategy, checkpoint.config.eos_id)
        assert _from_the_source_cache(model, prompts, forced, strategy, checkpoint.config.eos_id) == fast, strategy
        model.decoder.native = model.encoder.native = False
        try:
            slow = _generate(model, prompts, forced, strategy, checkpoint.config.eos_id)
        finally:
            model.decoder.native = model.encoder.native = True
        assert fast == slow, strategy
        if forced[0] is not None:
            assert [tokens[0] for tokens in fast] == forced
    assert counted.calls >= 2 * (NEW - 2)


def _post(client, family: str, **body):
    response = client.post(f"/v1/models/{family}/generate", json={"max_new_tokens": NEW} | body)
    assert response.status_code == 200, response.text
    return response.json()["outputs"]


def _counted(client, family: str, metric: str) -> float:
    return metric_samples(client.get("/metrics").text, metric).get((("model", family),), 0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_repeated_source_reuses_its_encoding_and_gives_the_uncached_tokens(served, checkpoints, family):
    """A served request (beam-4, the target language where the model has them, placeholders checked), then the same
    request and a greedy one with a target prefix: the later ones read the cached source encodings (the hits count
    every source token) and all give the tokens of generate_seq2seq without a cache (model.start), alone and both in
    one running batch (the greedy rows leave it first). T5's decoder has a relative position bias: its target prefix
    is computed in the rows' own cache, never read as a shared prefix."""
    server, client = served
    checkpoint = checkpoints[family]
    fields = {"target_lang": TARGET[family]} if family in TARGET else {}
    beam = {"strategy": "beam", "num_beams": 4, "max_new_tokens": NEW, "min_new_tokens": MIN, **fields}
    first = _post(client, family, inputs=TEXTS, **beam)
    before = _counted(client, family, HITS)
    again = _post(client, family, inputs=TEXTS, **beam)
    prefix = ["the quick", "", "open"]
    greedy = {"strategy": "greedy", "target_prefix": prefix, **fields}
    prefixed = _post(client, family, inputs=TEXTS, **greedy)
    prompts = checkpoint.encode_prompts(TEXTS)
    assert _counted(client, family, HITS) - before == 2 * sum(map(len, prompts))
    worker = server.engine.get(family)
    release = block_worker(worker)  # both requests queue, then share the batch: the greedy rows leave first
    with ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(_post, client, family, inputs=TEXTS, **body) for body in (beam, greedy)]
        assert wait_until(lambda: worker.scheduler.num_waiting == 2, timeout_s=60)
        release.set()
        together = [f.result(timeout=120) for f in pending]
    assert [[o["tokens"] for o in outputs] for outputs in together] == [[o["tokens"] for o in outputs]
                                                                       for outputs in (again, prefixed)]
    planner = worker.planner
    forced = _forced(checkpoint, family, len(TEXTS))
    want = best_tokens(generate_seq2seq(checkpoint.model, prompts, planner.generation_config(ask(*TEXTS, **beam)),
                                        forced_first=forced))
    assert [o["tokens"] for o in first] == [o["tokens"] for o in again] == want
    assert all(isinstance(o["placeholders_ok"], bool) for o in first)  # protected by default: checked only
    if forced[0] is not None:
        assert [o["tokens"][0] for o in first] == forced  # the target language's token stays first
    targets = [[f, *checkpoint.tokenizer.encode(p)] if p and f is not None else checkpoint.tokenizer.encode(p)
               for p, f in zip(prefix, forced, strict=True)]
    rows = [f if not t else None for t, f in zip(targets, forced, strict=True)]
    config = planner.generation_config(ask(*TEXTS, strategy="greedy", max_new_tokens=NEW))
    want = best_tokens(generate_seq2seq(checkpoint.model, prompts, config, targets=targets, forced_first=rows))
    assert [o["tokens"] for o in prefixed] == want


@pytest.mark.parametrize("family", FAMILIES)
def test_drafted_tokens_verified_in_one_step_give_the_plain_tokens(served, family):
    """One input, greedy, n-gram drafts (from the source and the output; a random model repeats itself, so most are
    accepted): the verification steps (T5's relative bias over several new positions) give the tokens of plain
    decoding, the forced token first."""
    _, client = served
    fields = {"inputs": TEXTS[:1], "strategy": "greedy", "max_new_tokens": 2 * NEW, "min_new_tokens": NEW}
    fields |= {"target_lang": TARGET[family]} if family in TARGET else {}
    before = _counted(client, family, DRAFTED)
    drafted = _post(client, family, speculative={"method": "ngram", "num_tokens": 3}, **fields)
    assert _counted(client, family, DRAFTED) > before
    plain = _post(client, family, speculative={"method": "none"}, **fields)
    assert [o["tokens"] for o in drafted] == [o["tokens"] for o in plain], (drafted, plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholders_survive_each_familys_tokenizer(checkpoints, directories, family):
    """A copying model keeps a placeholder exactly when its tokenizer represents it: encode then decode gives the
    text back with the placeholder (restored as it is: these tokenizers have no sentinels, so placeholders are
    checked, and placeholders_ok says true), while one with a character outside the vocabulary (<unk>) is reported
    (placeholders_ok false), never passed as intact. Our decode is transformers' decode."""
    checkpoint = checkpoints[family]
    tokenizer, source_tokenizer = checkpoint.tokenizer, checkpoint.prompt_tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(directories[family])
    assert sentinels_for(tokenizer, source_tokenizer) == 0
    kept = []
    for placeholder in PLACEHOLDERS:
        text = f"open {placeholder} now"
        ids = source_tokenizer.encode(text)
        decoded = tokenizer.decode(ids)
        assert decoded == theirs.decode(ids, skip_special_tokens=True)
        restored = protect(text, 0).restore(decoded)
        assert restored.ok == check(text, decoded)
        if theirs.unk_token_id not in ids:
            assert find(restored.text) == [placeholder] and restored.ok, (placeholder, decoded)
            kept.append(placeholder)
        else:
            assert not restored.ok, (placeholder, decoded)
    assert {"{name}", "{0}"} <= set(kept), kept  # every tiny vocabulary here has braces


@pytest.mark.parametrize("family", FAMILIES)
def test_a_constraint_on_a_translator_is_served_or_refused_by_name(served, family):
    """Constrained decoding needs a byte-level BPE tokenizer (model/constraints.py): BART's output keeps to the
    grammar after its forced <s>; the SentencePiece families get a 422 naming the field, never a 500."""
    _, client = served
    response = client.post(f"/v1/models/{family}/generate",
                           json={"inputs": TEXTS[:1], "constraint": {"choice": ["yes", "no thanks"]},
                                 "max_new_tokens": 2 * NEW})  # room for "no thanks" before bart's forced </s>
    if family == "bart":
        assert response.status_code == 200, response.text
        output = response.json()["outputs"][0]
        assert output["text"] in ("yes", "no thanks") and output["constraint_satisfied"] is True, output
    else:
        assert response.status_code == 422, response.text
        assert "constraint.choice" in response.text and "byte-level" in response.text


def test_the_engine_keeps_a_translation_in_its_grammar_after_its_forced_token(directories):
    """The engine's part of constrained translation: BART (byte-level BPE) with
    bart-large-cnn's forced <s> and a compiled constraint on its job. The forced token stays first and is no text of
    the grammar's; choices give an output in the grammar, greedy and beam-4; a grammar that allows any text gives the
    unconstrained tokens."""
    async def generate(worker, constraint: Constraint | None, **fields):
        job = await worker.planner.job(ask(*TEXTS, max_new_tokens=2 * NEW, **fields), "constrained", False)
        job.constraint = None if constraint is None else compile_constraint(constraint, worker.checkpoint.tokenizer)
        worker._submit(job)
        return await worker._result(job)

    async def main():
        async with running_engine(directories["bart"].parent, None) as engine:
            worker = engine.get("bart")
            choices = Constraint("choice", ["yes", "no thanks", "maybe later"])
            found = {s: await generate(worker, choices, strategy=s) for s in ("greedy", "beam")}
            anything = await generate(worker, Constraint("regex", "(?s:.*)"), strategy="greedy")
            return found, anything, await generate(worker, None, strategy="greedy")

    found, anything, free = asyncio.run(main())
    for outputs in found.values():
        assert [o.tokens[0] for o in outputs] == [BART_BOS] * len(TEXTS)
        assert {o.text for o in outputs} <= {"yes", "no thanks", "maybe later"}, [o.text for o in outputs]
        assert {o.finish_reason for o in outputs} == {"eos"}
    assert [o.tokens for o in anything] == [o.tokens for o in free]
    assert all(o.constraint_satisfied for outputs in found.values() for o in outputs)
