"""Vocabulary maps in the engine's running batch (issue 39): where every row is restricted, a decode step computes
the union of the rows' candidates alone and each job's search reads those compact logits (model.search.logit_space);
a row without a map, log-probs or a history rule keep the full width. Either way the served tokens are the offline
search's with the same maps, token for token, for greedy and beam search, with several requests running at once (the
worker held on the first request's first model call until the others wait, so they join its running batch)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from model.checkpoint import checkpoint_vocabulary_map, load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_seq2seq
from tests.helpers import StepGate
from tests.reliability.helpers import inprocess_server, wait_until
from tests.service.test_language_vmaps import TEXTS, models_root  # noqa: F401 (a fixture)

pytest.importorskip("transformers")

NEW = 8
MAPPED_ONLY = ["fra_Latn", "deu_Latn", "fra_Latn"]
WITH_UNMAPPED = ["fra_Latn", "zho_Hans", "deu_Latn"]  # zho_Hans has no map: the batch keeps the full width
CASES = {  # name: (strategy options, target languages, extra request fields)
    "greedy": (dict(strategy="greedy"), MAPPED_ONLY, {}),
    "beam4": (dict(strategy="beam", num_beams=4), MAPPED_ONLY, {}),
    "beam4-one-row-unmapped": (dict(strategy="beam", num_beams=4), WITH_UNMAPPED, {}),
    "greedy-logprobs": (dict(strategy="greedy"), MAPPED_ONLY, dict(logprobs=1)),
    "beam4-no-repeat": (dict(strategy="beam", num_beams=4), MAPPED_ONLY, dict(no_repeat_ngram_size=2)),
    "greedy-drafted": (dict(strategy="greedy"), MAPPED_ONLY, dict(speculative={"method": "ngram"})),  # one input each
}


@pytest.fixture(scope="module")
def served(models_root):  # noqa: F811
    with inprocess_server(models_root, request_timeout_s=300) as server, server.client(timeout=120) as client:
        yield server, client


def offline(directory, options: dict, codes: list[str], extra: dict) -> list[list[int]]:
    ckpt = load_checkpoint(directory, device="cpu")
    config = GenerationConfig(max_new_tokens=NEW, eos_token_id=ckpt.config.eos_id,
                              **options, **{k: v for k, v in extra.items() if k not in ("logprobs", "speculative")})
    forced = [ckpt.languages.target_id(c) for c in codes]
    out = generate_seq2seq(ckpt.model, ckpt.encode_prompts(TEXTS), config,
                           vocab_map=checkpoint_vocabulary_map(ckpt), forced_first=forced)
    return [h[0].tokens for h in out]


@pytest.mark.parametrize("case", list(CASES))
def test_served_tokens_under_maps_are_the_offline_searchs(served, models_root, case):  # noqa: F811
    server, client = served
    options, codes, extra = CASES[case]
    expected = offline(models_root / "nllb", options, codes, extra)
    scheduler = server.engine.get("nllb").scheduler
    calls: list[list[str]] = []  # the job ids of every model call, the first one held until every request waits
    gate = StepGate(scheduler, when=lambda ids: calls.append(list(ids)) or len(calls) == 1)

    def post(row: int):  # one request per row
        body = dict(inputs=[TEXTS[row]], target_lang=[codes[row]], max_new_tokens=NEW, **options, **extra)
        return client.post("/v1/models/nllb/generate", json=body)

    with ThreadPoolExecutor(len(TEXTS)) as pool:
        pending = [pool.submit(post, row) for row in range(len(TEXTS))]
        assert wait_until(lambda: gate.parked and len(gate.ids) + scheduler.num_waiting == len(TEXTS), 60)
        gate.step()  # the held call goes; no later one is held
        responses = [future.result() for future in pending]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    got = [r.json()["outputs"][0]["tokens"] for r in responses]
    assert got == expected
    assert max(len(set(ids)) for ids in calls) == len(TEXTS)  # the three requests shared model calls
    if "speculative" in extra:
        return
    whole = client.post("/v1/models/nllb/generate", json=dict(inputs=TEXTS, target_lang=codes, max_new_tokens=NEW,
                                                              **options, **extra))
    assert whole.status_code == 200, whole.text
    assert [o["tokens"] for o in whole.json()["outputs"]] == expected
