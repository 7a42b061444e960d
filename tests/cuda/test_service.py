"""The service end to end on each target: a real ``python -m service`` (uvicorn on 127.0.0.1) told TSERVE_DEVICE and
TSERVE_DTYPE: generate, beam, stream, classify, embed, and an adapter uploaded while it runs; beside our checkpoints,
a Hugging Face Llama directory (tests/hf_directories.llama_directory) and a PEFT adapter uploaded to it.

In float32 its greedy and beam outputs are the CPU's own (``offline``, float32 on the CPU); in lower precision
the outputs are checked for form and for agreeing with themselves (streamed and not, uploaded adapter and the
same files loaded from the adapter directory). The Llama's greedy tokens are those of our offline decoding on the
target, with and without the adapter (lower precision: parting only at a tie).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.generation import GenerationConfig, generate_causal
from model.lora import use_adapters
from model.lora_io import load_adapter
from service.local_server import adapter_archive
from tests.cuda.conftest import Target, assert_same_tokens, causal_logits_at, measured_tolerance, targets
from tests.helpers import archive, assert_same_outputs, generate
from tests.hf_compare import peft_adapter
from tests.hf_directories import llama_directory
from tests.service.conftest import ADAPTERS, CLS, LABELS, LM, MT, TEXTS, offline
from tests.service.fixtures import PROMPTS
from tests.service.server import running_server, sse_data

transformers = pytest.importorskip("transformers")

LLAMA, LLAMA_ADAPTER = "llama-hf", "peft-a"  # a Hugging Face directory served beside ours, a PEFT adapter on it


@pytest.fixture(scope="module", params=targets())
def target(request) -> Target:
    return request.param


@pytest.fixture(scope="module")
def served_models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our checkpoints and the Llama directory, the models of the servers of every target."""
    models = tmp_path_factory.mktemp("served") / "models"
    shutil.copytree(models_dir, models)
    llama_directory(models / LLAMA)
    return models


@pytest.fixture(scope="module")
def server(target: Target, served_models: Path, adapters_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    adapters = tmp_path_factory.mktemp(f"service-{target}") / "adapters"
    shutil.copytree(adapters_dir, adapters)  # uploads land here, not in the shared fixture
    with running_server(served_models, adapters, TSERVE_DEVICE=target.device, TSERVE_DTYPE=target.dtype_name) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def _candidates(outputs: list[dict]) -> list[list[dict]]:
    """Each output's candidates as the API gives several, and as one for a single sequence (the fields the offline
    reference has: a translation's placeholders_ok is the service's)."""
    fields = ("text", "tokens", "score", "finish_reason")
    return [[{k: c[k] for k in fields} for c in o.get("candidates") or [o]] for o in outputs]


def _offline(models_dir: Path, model: str, texts: list[str], **fields) -> list[list[dict]]:
    """The CPU's outputs (float32, each text alone) for a generate request with ``fields``, as candidates."""
    return [[{"text": c.text, "tokens": c.tokens, "score": c.score, "finish_reason": c.finish_reason}
             for c in out.candidates] for out in offline(models_dir / model, texts, fields)]


def test_models_run_on_the_target(client, target):
    for m in client.get("/v1/models").json()["data"]:
        assert m["device"].split(":")[0] == target.device and m["dtype"] == target.dtype_name, m


@pytest.mark.parametrize("model", [LM, MT])
def test_generate_greedy_and_beam(client, target, models_dir, model):
    texts = PROMPTS[:4]
    greedy = generate(client, model, inputs=texts, max_new_tokens=8)["outputs"]
    beam = generate(client, model, inputs=texts, max_new_tokens=8, strategy="beam", num_beams=3,
                    num_return_sequences=2)["outputs"]
    assert all(o["finish_reason"] in ("eos", "length") and len(o["tokens"]) <= 8 for o in greedy)
    for out in beam:
        first, second = out["candidates"]
        assert out["text"] == first["text"] and first["score"] >= second["score"]
    if target.exact:  # the CPU's own tokens
        assert_same_outputs(_candidates(greedy), _offline(models_dir, model, texts, max_new_tokens=8))
        assert_same_outputs(_candidates(beam), _offline(models_dir, model, texts, strategy="beam", max_new_tokens=8,
                                                        num_beams=3, num_return_sequences=2))


@pytest.mark.parametrize("model", [LM, MT, LLAMA])
def test_stream_equals_non_stream(client, model):
    body = dict(inputs=[PROMPTS[1]], max_new_tokens=10)
    whole = generate(client, model, **body)["outputs"][0]
    with client.stream("POST", f"/v1/models/{model}/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert "".join(e["text"] for e in events[:-1]) == whole["text"]
    assert [e["token"] for e in events[:-1] if e["token"] is not None] == whole["tokens"]


def test_a_hugging_face_llama_is_served_with_offline_greedy_tokens(client, target, served_models, tmp_path):
    """Each prompt's greedy tokens (and text) with and without a PEFT adapter uploaded while the server runs: those
    of our offline decoding of it alone on the target, the adapter loaded into the model there."""
    pytest.importorskip("peft")
    directory = served_models / LLAMA
    # seed 2: at every greedy step here the two best logits are at least 0.9% of the largest apart (float32, CPU),
    # far beyond float32's differences between devices and batch shapes: a float32 parting is a fault, not a tie
    files = peft_adapter(transformers.AutoModelForCausalLM.from_pretrained(directory), tmp_path / "adapter", seed=2,
                         r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"])
    r = client.put(f"/v1/models/{LLAMA}/adapters/{LLAMA_ADAPTER}", content=adapter_archive(files),
                   headers={"Content-Type": "application/gzip"})
    assert r.status_code == 200, r.text
    ckpt = load_checkpoint(directory, device=target.device, dtype=target.dtype)
    load_adapter(ckpt.model, files, LLAMA_ADAPTER, layout=ckpt.adapter_layout)
    exact = load_checkpoint(directory, device="cpu", dtype=torch.float32).model
    load_adapter(exact, files, LLAMA_ADAPTER, layout=ckpt.adapter_layout)
    texts = PROMPTS[:4]
    prompts = ckpt.encode_prompts(texts)
    row = target.tensor([sum(prompts, [])])
    config = GenerationConfig(max_new_tokens=8, eos_token_id=ckpt.config.eos_id)
    served_tokens = {}
    for adapter in (None, LLAMA_ADAPTER):
        with torch.inference_mode(), use_adapters(ckpt.model, adapter), use_adapters(exact, adapter):
            tol = measured_tolerance(target, ckpt.model(row), exact(row.cpu()))  # this model's own rounding
        body = {"adapter": adapter} if adapter else {}
        outputs = generate(client, LLAMA, inputs=texts, max_new_tokens=8, **body)["outputs"]
        for prompt, out in zip(prompts, outputs, strict=True):
            want = generate_causal(ckpt.model, [prompt], config, adapters=adapter)[0][0].tokens
            with use_adapters(ckpt.model, adapter):
                logits_at = causal_logits_at(ckpt.model, prompt)
                assert_same_tokens(target, out["tokens"], want, ckpt.config.eos_id, logits_at, tol)
            if target.exact:
                assert out["text"] == ckpt.tokenizer.decode(want)
        served_tokens[adapter] = [o["tokens"] for o in outputs]
    assert any(served_tokens[None]) and served_tokens[None] != served_tokens[LLAMA_ADAPTER]  # real continuations


def test_classify_and_embed(client, target):
    r = client.post(f"/v1/models/{CLS}/classify", json={"inputs": [TEXTS[0], [TEXTS[1], TEXTS[2]]]})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        assert set(out["probabilities"]) == set(LABELS)
        assert sum(out["probabilities"].values()) == pytest.approx(1.0, abs=max(1e-5, target.tol))
        assert out["label"] == max(out["probabilities"], key=out["probabilities"].get)
    for pooling in ("cls", "mean"):
        r = client.post(f"/v1/models/{CLS}/embed", json={"inputs": TEXTS[:3], "pooling": pooling})
        assert r.status_code == 200, r.text
        assert [len(v) for v in r.json()["embeddings"]] == [32] * 3


def test_adapter_uploaded_at_run_time(client, adapters_dir):
    texts, name = PROMPTS[:4], ADAPTERS[LM]
    base = generate(client, LM, inputs=texts, max_new_tokens=8)["outputs"]
    tuned = generate(client, LM, inputs=texts, max_new_tokens=8, adapter=name)["outputs"]
    assert tuned != base
    r = client.put(f"/v1/models/{LM}/adapters/uploaded", content=archive(adapters_dir / LM / name, "tar.gz"),
                   headers={"Content-Type": "application/gzip"})
    assert r.status_code == 200, r.text
    uploaded = generate(client, LM, inputs=texts, max_new_tokens=8, adapter="uploaded")["outputs"]
    assert_same_outputs([uploaded], [tuned])
    again = generate(client, LM, inputs=texts, max_new_tokens=8)["outputs"]  # the base is served as before
    assert_same_outputs([again], [base])  # (the same batch: GPU kernels may sum in another order at other sizes)


SYSTEM = "the quick brown fox jumps over the lazy dog and then the cat sat on the mat near the door, "
REPEATING = "hello world, hello world, hello world, hello"


def _metric(client, name: str, model: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'{name}{{') and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_prefix_cache_and_speculative_decoding_leave_outputs_as_they_were(client, target, models_dir):
    """A prompt prefix reused from the cache and drafts verified in one step give the plain path's tokens (float32:
    the CPU's own; lower precision: the same request's first answer)."""
    prompts = [SYSTEM + s for s in ("hello world", "numbers 0 1 2 3")]
    first = generate(client, LM, inputs=prompts, max_new_tokens=8)["outputs"]
    hits = _metric(client, "tserve_prefix_cache_hits_total", LM)
    again = generate(client, LM, inputs=prompts, max_new_tokens=8)["outputs"]
    assert _metric(client, "tserve_prefix_cache_hits_total", LM) > hits  # the second round reused the prefix
    assert_same_outputs(_candidates(again), _candidates(first))
    plain = generate(client, LM, inputs=[REPEATING], max_new_tokens=24)["outputs"]
    drafted = generate(client, LM, inputs=[REPEATING], max_new_tokens=24,
                       speculative={"method": "ngram", "num_tokens": 4})["outputs"]
    assert len(drafted[0]["tokens"]) == len(plain[0]["tokens"])
    if target.exact:
        assert_same_outputs(_candidates(first), _offline(models_dir, LM, prompts, max_new_tokens=8))
        assert_same_outputs(_candidates(drafted), _candidates(plain))


def test_constraints_logprobs_and_anti_repetition_on_the_target(client):
    """Constrained outputs parse and match; logprobs are log-probabilities, greedy's token its position's best;
    no_repeat_ngram_size leaves no repeated bigram."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 130}},
              "required": ["name", "age"], "additionalProperties": False}
    texts = PROMPTS[:3]
    for out in generate(client, LM, inputs=texts, max_new_tokens=60, constraint={"json_schema": schema})["outputs"]:
        value = json.loads(out["text"])
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 6, value
    regex = r"\d{3}-[a-z]{2,4}"
    for out in generate(client, LM, inputs=texts, max_new_tokens=20, constraint={"regex": regex},
                        strategy="beam", num_beams=3)["outputs"]:
        assert re.fullmatch(regex, out["text"]), out["text"]
    choices = ["yes", "no", "not sure"]
    for out in generate(client, LM, inputs=texts, max_new_tokens=10, constraint={"choice": choices},
                        strategy="sample", seed=3)["outputs"]:
        assert out["text"] in choices
    for model in (LM, MT):
        for out in generate(client, model, inputs=texts, max_new_tokens=8, logprobs=3)["outputs"]:
            assert 0 < len(out["logprobs"]) <= len(out["tokens"])
            for token, entry in zip(out["tokens"], out["logprobs"], strict=False):
                alternatives = entry["top_logprobs"]
                assert entry["token"] == token and entry["logprob"] <= 1e-6
                assert [a["logprob"] for a in alternatives] == sorted((a["logprob"] for a in alternatives),
                                                                      reverse=True)
                assert alternatives[0]["token"] == token  # greedy: the position's best
    out = generate(client, LM, inputs=[REPEATING], max_new_tokens=24, no_repeat_ngram_size=2)["outputs"][0]
    tokens = out["tokens"]
    bigrams = list(zip(tokens, tokens[1:], strict=False))
    assert len(bigrams) > 0 and len(set(bigrams)) == len(bigrams), tokens
