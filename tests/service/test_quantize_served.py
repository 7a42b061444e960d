"""The quantize setting over HTTP: a real server with bf16 weights (one model left float) reports each model's mode
in GET /v1/models and generates, with and without an adapter, what the offline bf16 model does; unknown modes are
refused at start-up with the list of modes."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.checkpoint import load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_seq2seq
from model.lora_io import load_adapter
from model.quantize import prepare_for_inference
from service.settings import Settings, SettingsError
from tests.helpers import generate
from tests.service.conftest import ADAPTERS, CLS, LM, MT, TEXTS
from tests.service.server import running_server


@pytest.fixture(scope="module")
def client(models_dir: Path, adapters_dir: Path):
    with running_server(models_dir, adapters_dir, TSERVE_QUANTIZE=f"bf16,{CLS}=none") as server, \
            server.client() as c:
        yield c


def test_models_report_their_quantize_mode(client):
    models = {m["name"]: m for m in client.get("/v1/models").json()["data"]}
    assert {name: m["quantize"] for name, m in models.items()} == {LM: "bf16", MT: "bf16", CLS: "none"}


def test_a_bf16_model_generates_what_the_offline_bf16_model_does(client, models_dir, adapters_dir):
    """The served bf16 translator, alone and with its adapter (loaded over the bf16 base), against the checkpoint
    quantised offline as the server does it (model.quantize.prepare_for_inference) with the adapter loaded after."""
    served = [generate(client, MT, inputs=TEXTS[:2], max_new_tokens=8, adapter=adapter)["outputs"]
              for adapter in (None, ADAPTERS[MT])]
    ckpt = load_checkpoint(models_dir / MT, device="cpu")
    prepare_for_inference(ckpt.model, "bf16")
    load_adapter(ckpt.model, adapters_dir / MT / ADAPTERS[MT], "ref")
    sources = [ckpt.src_tokenizer.encode(text, add_eos=True) for text in TEXTS[:2]]
    config = GenerationConfig(max_new_tokens=8, eos_token_id=ckpt.config.eos_id)
    for outputs, adapters in zip(served, (None, "ref"), strict=True):
        want = [hyps[0].tokens for hyps in generate_seq2seq(ckpt.model, sources, config, adapters=adapters)]
        assert [o["tokens"] for o in outputs] == want


def test_unknown_modes_are_refused_with_the_list():
    with pytest.raises(SettingsError, match=r"TSERVE_QUANTIZE.*'fp8'.*\['none', 'int8', 'bf16'\]"):
        Settings.from_env({"TSERVE_QUANTIZE": f"bf16,{MT}=fp8"})
