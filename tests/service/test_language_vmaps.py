"""A multilingual translator with vocabulary maps per target language (vmaps/<code>.txt) served by a real uvicorn
server: one request translating into three languages (one batch) keeps each row to its own language's map, a row
whose language has no map gets the unrestricted output (the offline search with the same maps, token for token),
``use_vmap: false`` opts out, ``use_vmap: true`` for a language without a map is a 422 naming the row, and a model
whose vmaps/ names a code it does not know is listed as failed with the file."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from model.checkpoint import checkpoint_vocabulary_map, load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_seq2seq
from tests.model.test_language_vmaps import MAPPED, write_map
from tests.reliability.helpers import inprocess_server

pytest.importorskip("transformers")

TEXTS = ["the quick brown fox jumps", "hello world again", "good morning to you"]
CODES = ["fra_Latn", "deu_Latn", "zho_Hans"]  # zho_Hans has no map
NEW = 8


@pytest.fixture(scope="module")
def served(models_root):
    root = models_root
    with inprocess_server(root, request_timeout_s=300) as server, server.client(timeout=120) as client:
        yield root, client


@pytest.fixture(scope="module")
def models_root(tmp_path_factory) -> Path:
    """Models: ``nllb`` with maps for MAPPED (random thirds of the vocabulary), ``nllb-bad`` naming an unknown code."""
    from tests.hf_seq2seq_tokenizers import nllb
    from tests.service.test_seq2seq_languages import translator

    root = tmp_path_factory.mktemp("served-vmaps")
    directory = translator(root, "nllb", "nllb", nllb(root / "nllb-tok", "json"))
    ckpt = load_checkpoint(directory, device="cpu")
    size, spell = ckpt.tokenizer.vocab_size, ckpt.tokenizer.backend.id_to_token
    for seed, code in enumerate(MAPPED):
        write_map(directory, code, set(random.Random(seed).sample(range(size), size // 3)), spell)
    bad = root / "models" / "nllb-bad"
    shutil.copytree(directory, bad)
    (bad / "vmaps" / "xx_Latn.txt").write_text("\t</s>\n", encoding="utf-8")
    return directory.parent


def offline(directory: Path, use_maps: bool) -> list[list[int]]:
    ckpt = load_checkpoint(directory, device="cpu")
    maps = checkpoint_vocabulary_map(ckpt) if use_maps else None
    config = GenerationConfig(strategy="greedy", max_new_tokens=NEW, eos_token_id=ckpt.config.eos_id)
    forced = [ckpt.languages.target_id(c) for c in CODES]
    out = generate_seq2seq(ckpt.model, ckpt.encode_prompts(TEXTS), config, vocab_map=maps, forced_first=forced)
    return [h[0].tokens for h in out]


def _post(client, model: str, **body):
    return client.post(f"/v1/models/{model}/generate", json={"inputs": TEXTS, "target_lang": CODES,
                                                            "max_new_tokens": NEW, "strategy": "greedy", **body})


def test_each_row_of_a_request_keeps_to_its_target_languages_map(served):
    root, client = served
    directory = root / "nllb"
    ckpt = load_checkpoint(directory, device="cpu")
    maps = checkpoint_vocabulary_map(ckpt)
    mapped, plain = _post(client, "nllb"), _post(client, "nllb", use_vmap=False)
    assert mapped.status_code == plain.status_code == 200, (mapped.text, plain.text)
    got = [o["tokens"] for o in mapped.json()["outputs"]]
    unrestricted = [o["tokens"] for o in plain.json()["outputs"]]
    assert got == offline(directory, True) and unrestricted == offline(directory, False)
    sources = ckpt.encode_prompts(TEXTS)
    for i, code in enumerate(CODES):
        allowed = maps.candidates_in(sources[i], ckpt.languages.target_id(code))
        if code in MAPPED:
            assert set(got[i]) <= set(allowed)
        else:
            assert allowed is None and got[i] == unrestricted[i]
    assert got[:2] != unrestricted[:2]  # the maps did restrict


def test_use_vmap_for_a_language_without_a_map_is_invalid_and_a_bad_map_fails_its_model(served):
    _, client = served
    response = _post(client, "nllb", use_vmap=True)
    assert response.status_code == 422
    assert "target_lang[2]" in response.text and "no vocabulary map for target language 'zho_Hans'" in response.text
    assert _post(client, "nllb", use_vmap=True, inputs=TEXTS[:2], target_lang=CODES[:2]).status_code == 200
    (failed,) = client.get("/v1/models").json()["failed"]
    assert failed["name"] == "nllb-bad" and "xx_Latn.txt" in failed["error"]
    assert "'xx_Latn' is not a language code of this model" in failed["error"]
