"""Hugging Face model directories served next to our checkpoints (issue 16), by a real `python -m service`.

The directories are what `transformers` writes (tests/hf_directories.py builds them). The GPT-2 directory: a
random GPT2LMHeadModel and a byte-level BPE in GPT-2's layout (<|endoftext|> last), both through save_pretrained;
its adapters are what `peft` writes (random non-zero A and B on c_attn / c_proj / c_fc, Conv1D's fan_in_fan_out,
one rank-stabilised). The service must answer what `tokenizer(text)` + `generate()` in `transformers` (and `peft`)
give, token for token, also with the adapters mixed in one batch. The BERT directories hold a WordPiece tokenizer
(lower-casing, accents stripped, the [CLS] a [SEP] b [SEP] template): a BertForSequenceClassification
whose probabilities must equal transformers', and a BertModel saved as sentence-transformers lays it out
(max pooling, Normalize) whose /embed vectors must equal transformers' hidden states pooled that way.
The OPUS-MT directory holds a random MarianMTModel, SentencePiece models and vocab.json, and a
generation_config.json that bans the pad token and forces EOS at the limit, as OPUS-MT's do. The other encoders
(tests/model/hf_encoders.py): a multi-label RoBERTa, a DistilBERT and a one-label XLM-RoBERTa (a cross-encoder)
classify as transformers' text-classification pipeline scores, and an XLM-RoBERTa in the sentence-transformers
layout embeds through /v1/embeddings. A BertForTokenClassification (tests/model/test_token_entities.py's, its head
scaled for varied labels) finds the entities transformers' token-classification pipeline finds.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.hf_compare import peft_adapter
from tests.hf_directories import (
    LABELS,
    MARIAN_PAD,
    PAIRS,
    TEXTS,
    bert_directory,
    gpt2_directory,
    opus_mt_directory,
    sentence_transformers_layout,
)
from tests.model.hf_encoders import encoder_directory
from tests.model.test_token_entities import token_classifier
from tests.service.fixtures import LM
from tests.service.server import running_server

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPTS = ["def add(", "the quick", "for i in"]
NEW_TOKENS = 8
ENCODERS = {"roberta-multi": ("roberta", "multi"), "distilbert-cls": ("distilbert", "single"),  # name -> kind, head
            "xlmr-score": ("xlm-roberta", "one-label"), "distilbert-regression": ("distilbert", "regression")}
NER = "bert-ner"  # a BertForTokenClassification
NER_TEXTS = ["  Élan vital, déjà vu à Köln!  ", "Grüße aus Köln, e\u0301 combining", "the quick brown fox (Tokyo)..."]
ENCODER_ADAPTERS = {"roberta-multi": ["query", "value", "dense"], "distilbert-cls": ["q_lin", "v_lin", "lin1"]}
ADAPTERS = {  # name -> PEFT LoraConfig fields
    "all-projections": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"]),
    "attention-rslora": dict(r=2, lora_alpha=4, target_modules=["c_attn"], use_rslora=True),
}


def hf_generate(directory: Path, adapter: Path | None, prompt: str, **kwargs) -> list[int]:
    """transformers' (and peft's) greedy or beam continuation of ``prompt``, cut at EOS."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.GPT2LMHeadModel.from_pretrained(directory)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # one prompt at a time: no padding involved
    with torch.no_grad():
        new = model.eval().generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    new = new[0, ids.shape[1]:].tolist()
    return new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new


@pytest.fixture(scope="module")
def served(models_dir, tmp_path_factory):
    """A server over our tiny-lm, a GPT-2 directory with two PEFT adapters and a broken HF directory; the
    GPT-2 directory and its adapters' directory."""
    root = tmp_path_factory.mktemp("hf-models")
    gpt2 = gpt2_directory(root / "models" / "gpt2-hf")
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        peft_adapter(transformers.GPT2LMHeadModel.from_pretrained(gpt2), root / "adapters" / "gpt2-hf" / name, seed,
                     fan_in_fan_out=True, **fields)
    os.symlink(models_dir / LM, root / "models" / LM)
    bert_cls = bert_directory(root / "models" / "bert-cls", head=True)
    peft_adapter(transformers.BertForSequenceClassification.from_pretrained(bert_cls),
                 root / "adapters" / "bert-cls" / "seq-cls", 3, r=2, lora_alpha=4, task_type="SEQ_CLS",
                 target_modules=["query", "value"])
    sentence_transformers_layout(bert_directory(root / "models" / "bert-embed", head=False))
    opus_mt_directory(root / "models" / "opus-mt")
    for name, (architecture, head) in ENCODERS.items():
        encoder_directory(root / "models" / name, architecture, head)
    for name, targets in ENCODER_ADAPTERS.items():
        peft_adapter(transformers.AutoModelForSequenceClassification.from_pretrained(root / "models" / name),
                     root / "adapters" / name / "lora", 5, r=2, lora_alpha=4, target_modules=targets)
    sentence_transformers_layout(encoder_directory(root / "models" / "xlmr-embed", "xlm-roberta", "model"))
    token_classifier(root / "models" / NER, "bert-cased")
    broken = root / "models" / "broken-hf"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}))
    with running_server(root / "models", root / "adapters") as server, server.client() as client:
        yield client, gpt2, root / "adapters" / "gpt2-hf"


def test_an_hf_directory_is_listed_as_hf_beside_our_checkpoints(served):
    client, _, _ = served
    listing = client.get("/v1/models").json()
    formats = {m["name"]: (m["format"], m["family"]) for m in listing["data"]}
    assert {m["name"]: m["vocab_size"] for m in listing["data"]}["opus-mt"] == MARIAN_PAD + 1
    assert formats == {"gpt2-hf": ("hf", "causal_lm"), LM: ("tserve", "causal_lm"),
                       "bert-cls": ("hf", "classifier"), "bert-embed": ("hf", "classifier"),
                       "opus-mt": ("hf", "seq2seq"), "xlmr-embed": ("hf", "classifier"), NER: ("hf", "classifier"),
                       **{name: ("hf", "classifier") for name in ENCODERS}}
    (failed,) = listing["failed"]
    assert failed["name"] == "broken-hf" and "model_type='falcon' is not supported" in failed["error"]
    # A sentence-transformers save says its own embed defaults (its Pooling and Normalize modules).
    embedding = {m["name"]: m["embedding_defaults"] for m in listing["data"]}
    assert embedding["bert-embed"] == {"pooling": "max", "normalize": True}
    assert embedding["bert-cls"] == {"pooling": "mean", "normalize": False} and embedding["gpt2-hf"] is None


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_an_hf_gpt2_generates_what_transformers_generates(served, strategy):
    """Beam search with generate()'s defaults: length_penalty 1, early_stopping false (the model's default here)."""
    client, directory, _ = served
    body = {"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS, "strategy": strategy, "num_beams": 4}
    response = client.post("/v1/models/gpt2-hf/generate", json=body)
    assert response.status_code == 200, response.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    outputs = response.json()["outputs"]
    assert sum(len(o["tokens"]) for o in outputs) > len(PROMPTS)  # real continuations, not bare EOS
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        new = hf_generate(directory, None, prompt, num_beams=4 if strategy == "beam" else 1)
        assert output["tokens"] == new, prompt
        assert output["text"] == tokenizer.decode(new, skip_special_tokens=True)


def test_peft_adapters_of_an_hf_gpt2_give_peft_outputs_mixed_in_one_batch(served):
    """Each PEFT adapter, discovered at start-up, answers what PeftModel.generate answers; sent together with
    the base model they share batches, and each row still gets its own adapter's output."""
    client, directory, adapters = served
    listed = {a["name"]: a for a in client.get("/v1/models/gpt2-hf/adapters").json()["adapters"]}
    assert set(listed) == set(ADAPTERS)
    wanted = {name: [hf_generate(directory, adapters / name, p) for p in PROMPTS] for name in ADAPTERS}
    wanted[None] = [hf_generate(directory, None, p) for p in PROMPTS]
    assert len({json.dumps(w) for w in wanted.values()}) == 3  # the adapters change the outputs

    def generate(adapter: str | None) -> list[list[int]]:
        body = {"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS, "adapter": adapter}
        response = client.post("/v1/models/gpt2-hf/generate", json=body)
        assert response.status_code == 200, response.text
        return [o["tokens"] for o in response.json()["outputs"]]

    adapters_sent = [*wanted, *wanted]
    with ThreadPoolExecutor(len(adapters_sent)) as pool:
        got = list(pool.map(generate, adapters_sent))
    assert got == [wanted[a] for a in adapters_sent]


def test_an_hf_bert_classifier_gives_transformers_probabilities(served):
    client, gpt2, _ = served
    directory = gpt2.parent / "bert-cls"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertForSequenceClassification.from_pretrained(directory).eval()
    response = client.post("/v1/models/bert-cls/classify", json={"inputs": [*TEXTS, *PAIRS]})
    assert response.status_code == 200, response.text
    for item, output in zip([*TEXTS, *PAIRS], response.json()["outputs"], strict=True):
        batch = tokenizer(*([item] if isinstance(item, str) else item), return_tensors="pt")
        with torch.no_grad():
            probs = torch.softmax(model(**batch).logits[0], dim=-1)
        assert list(output["probabilities"]) == sorted(LABELS, key=lambda name: -probs[LABELS.index(name)])
        for name, p in output["probabilities"].items():
            assert abs(p - float(probs[LABELS.index(name)])) < 1e-5, (item, name)


def test_an_hf_sentence_transformers_embedder_pools_and_normalizes_as_configured(served):
    client, gpt2, _ = served
    directory = gpt2.parent / "bert-embed"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertModel.from_pretrained(directory).eval()
    response = client.post("/v1/models/bert-embed/embed", json={"inputs": TEXTS})
    assert response.status_code == 200, response.text
    for text, vector in zip(TEXTS, response.json()["embeddings"], strict=True):
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].double()
        want = torch.nn.functional.normalize(hidden.amax(0), dim=0)  # max pooling, then Normalize
        got = torch.tensor(vector, dtype=torch.float64)
        assert torch.dot(got, want) / got.norm() > 0.99999 and abs(float(got.norm()) - 1) < 1e-5
    refused = client.post("/v1/models/bert-embed/classify", json={"inputs": ["x"]})
    assert refused.status_code == 422 and "no classification head" in refused.json()["error"]["message"]


@pytest.mark.parametrize("name", ENCODERS)
def test_hf_encoder_classifiers_score_as_the_transformers_pipeline(served, name):
    """Softmax (single-label), each label's sigmoid (multi-label), the one label's sigmoid (a cross-encoder) or the
    raw values (regression, which never abstains: its values are no probabilities), on texts and pairs: what
    transformers' text-classification pipeline answers with top_k=None, ranked alike."""
    client, gpt2, _ = served
    directory = gpt2.parent / name
    pipe = transformers.pipeline("text-classification", model=str(directory), tokenizer=str(directory), top_k=None)
    response = client.post(f"/v1/models/{name}/classify", json={"inputs": [*TEXTS, *PAIRS], "min_confidence": 1.0})
    assert response.status_code == 200, response.text
    regression = ENCODERS[name][1] == "regression"
    for item, output in zip([*TEXTS, *PAIRS], response.json()["outputs"], strict=True):
        (want,) = pipe([item if isinstance(item, str) else {"text": item[0], "text_pair": item[1]}])
        assert list(output["probabilities"]) == [w["label"] for w in want], item
        wanted = (want[0]["label"], False) if regression else ("unknown", True)  # min_confidence 1: all abstain
        assert (output["label"], output["abstained"]) == wanted, item
        for w in want:
            assert abs(output["probabilities"][w["label"]] - w["score"]) < 1e-5, (item, w)


@pytest.mark.parametrize("strategy", ["simple", "first", "none"])
def test_an_hf_token_classifier_finds_the_entities_of_the_transformers_pipeline(served, strategy):
    client, gpt2, _ = served
    pipe = transformers.pipeline("token-classification", model=str(gpt2.parent / NER), aggregation_strategy=strategy)
    response = client.post(f"/v1/models/{NER}/entities", json={"inputs": NER_TEXTS, "aggregation_strategy": strategy})
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    assert sum(map(len, outputs)) >= len(NER_TEXTS)  # entities found, not all "O"
    for text, got in zip(NER_TEXTS, outputs, strict=True):
        want = pipe(text)
        assert [{**e, "score": None} for e in got] == [{**w, "score": None} for w in want], text
        assert all(abs(e["score"] - float(w["score"])) < 1e-5 for e, w in zip(got, want, strict=True)), text


def test_a_text_longer_than_the_model_runs_in_overlapping_windows_with_a_stride(served):
    """Windows of max_input_tokens (the model's 130 positions) overlapping by ``stride``: the pipeline's windows
    when its tokenizer's model_max_length is the same; without a stride the text is a 422."""
    client, gpt2, _ = served
    directory, text = gpt2.parent / NER, " ".join(NER_TEXTS * 12)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, model_max_length=130)
    pipe = transformers.pipeline("token-classification", model=str(directory), tokenizer=tokenizer,
                                 aggregation_strategy="first", stride=16)
    assert len(tokenizer(text)["input_ids"]) > 260  # three windows at least
    response = client.post(f"/v1/models/{NER}/entities", json={"inputs": text, "aggregation_strategy": "first",
                                                               "stride": 16})
    assert response.status_code == 200, response.text
    (got,) = response.json()["outputs"]
    want = pipe(text)
    assert len(got) > 10 and got[-1]["end"] > len(text) - 40  # entities from the last window too
    assert [{**e, "score": None} for e in got] == [{**w, "score": None} for w in want]
    assert all(abs(e["score"] - float(w["score"])) < 1e-5 for e, w in zip(got, want, strict=True))
    refused = client.post(f"/v1/models/{NER}/entities", json={"inputs": text, "aggregation_strategy": "first"})
    assert refused.status_code == 422 and "exceeds max_input_tokens=130" in refused.text, refused.text


@pytest.mark.parametrize(("model", "body", "says"), [
    ("bert-cls", {"inputs": "x"}, "has no token classification head: it serves classify, embed, rerank"),
    (NER, {"inputs": "x", "aggregation_strategy": "longest"}, "aggregation_strategy"),
    (NER, {"inputs": "x", "stride": 2}, "stride splits a long text into windows"),
], ids=["sequence-classifier", "strategy", "stride-with-none"])
def test_entities_requests_a_model_cannot_answer_are_422s_naming_why(served, model, body, says):
    client, _, _ = served
    response = client.post(f"/v1/models/{model}/entities", json=body)
    assert response.status_code == 422 and says in response.text, response.text


def test_a_token_classifier_refuses_classify_naming_entities_and_lists_entities(served):
    client, _, _ = served
    response = client.post(f"/v1/models/{NER}/classify", json={"inputs": ["x"]})
    assert response.status_code == 422 and "use /entities" in response.text, response.text
    tasks = {m["name"]: m["tasks"] for m in client.get("/v1/models").json()["data"]}
    assert tasks[NER] == ["entities", "embed", "rerank"]


def test_an_hf_xlm_roberta_embedder_answers_openai_embeddings(served):
    """/v1/embeddings of an XLM-R saved in the sentence-transformers layout: max pooling then Normalize over
    transformers' hidden states (RoBERTa's offset positions, the Unigram tokenizer's ids)."""
    client, gpt2, _ = served
    directory = gpt2.parent / "xlmr-embed"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.XLMRobertaModel.from_pretrained(directory).eval()
    response = client.post("/v1/embeddings", json={"model": "xlmr-embed", "input": TEXTS})
    assert response.status_code == 200, response.text
    for text, item in zip(TEXTS, response.json()["data"], strict=True):
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].double()
        want = torch.nn.functional.normalize(hidden.amax(0), dim=0)
        assert (torch.tensor(item["embedding"], dtype=torch.float64) - want).abs().max() < 1e-5, text


@pytest.mark.parametrize("defaults", [False, True])
def test_an_hf_opus_mt_translates_as_transformers_does(served, defaults):
    """Sources get </s>, the decoder starts from the pad id, the pad token is never produced and EOS is forced
    at the limit: token for token what MarianTokenizer + generate() give with the directory's generation config.
    A request that names only its inputs gets generate()'s defaults from that config: beam 4, max_length 64,
    length_penalty 1, early_stopping false."""
    client, gpt2, _ = served
    directory = gpt2.parent / "opus-mt"
    body = {"inputs": TEXTS} if defaults else {"inputs": TEXTS, "max_new_tokens": NEW_TOKENS, "strategy": "greedy"}
    hf_kwargs = {} if defaults else dict(max_new_tokens=NEW_TOKENS, num_beams=1)
    response = client.post("/v1/models/opus-mt/generate", json=body)
    assert response.status_code == 200, response.text
    tokenizer = transformers.MarianTokenizer(*(str(directory / f) for f in ("source.spm", "target.spm", "vocab.json")))
    model = transformers.MarianMTModel.from_pretrained(directory).eval()
    outputs = response.json()["outputs"]
    for text, output in zip(TEXTS, outputs, strict=True):
        with torch.no_grad():
            new = model.generate(**tokenizer(text, return_tensors="pt"), **hf_kwargs)[0, 1:].tolist()
        new = new[: new.index(0)] if 0 in new else new  # after the decoder start, cut at EOS
        assert output["tokens"] == new, text
        assert output["text"] == tokenizer.decode(new, skip_special_tokens=True)
    assert all(o["finish_reason"] == "eos" for o in outputs)  # EOS at the latest (forced at the limit)
    assert all(MARIAN_PAD not in o["tokens"] for o in outputs)
    listed = {m["name"]: m for m in client.get("/v1/models").json()["data"]}["opus-mt"]
    assert listed["generation_defaults"] == {"strategy": "beam", "num_beams": 4, "max_new_tokens": 63,
                                             "early_stopping": False}


def test_a_peft_adapter_uploaded_at_run_time_serves_at_once(served, tmp_path):
    """A PEFT adapter directory of the HF GPT-2, packed and uploaded while the server runs (PUT), is used by
    the next request: PeftModel's tokens."""
    client, directory, _ = served
    adapter = peft_adapter(transformers.GPT2LMHeadModel.from_pretrained(directory), tmp_path / "late", 9,
                           fan_in_fan_out=True, r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"])
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(adapter / name, arcname=name)
    put = client.put("/v1/models/gpt2-hf/adapters/late", content=archive.getvalue(),
                     headers={"Content-Type": "application/gzip"})
    assert put.status_code == 200, put.text
    body = {"inputs": PROMPTS, "max_new_tokens": NEW_TOKENS, "adapter": "late"}
    outputs = client.post("/v1/models/gpt2-hf/generate", json=body).json()["outputs"]
    assert [o["tokens"] for o in outputs] == [hf_generate(directory, adapter, p) for p in PROMPTS]
    assert client.delete("/v1/models/gpt2-hf/adapters/late").status_code == 204


def test_a_peft_seq_cls_adapter_classifies_with_its_own_head(served):
    """A SEQ_CLS adapter saves its own classifier (modules_to_save): requests naming it get PeftModel's
    probabilities, requests without it the base's, also sent together."""
    client, gpt2, adapters = served
    directory, adapter = gpt2.parent / "bert-cls", adapters.parent / "bert-cls" / "seq-cls"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    wanted = {}
    for name in (None, "seq-cls"):
        model = transformers.BertForSequenceClassification.from_pretrained(directory)
        model = (peft.PeftModel.from_pretrained(model, adapter) if name else model).eval()
        with torch.no_grad():
            wanted[name] = [torch.softmax(model(**tokenizer(t, return_tensors="pt")).logits[0], -1) for t in TEXTS]

    def classify(name: str | None) -> list[dict[str, float]]:
        response = client.post("/v1/models/bert-cls/classify", json={"inputs": TEXTS, "adapter": name})
        assert response.status_code == 200, response.text
        return [o["probabilities"] for o in response.json()["outputs"]]

    with ThreadPoolExecutor(4) as pool:
        sent = [None, "seq-cls", None, "seq-cls"]
        for name, got in zip(sent, pool.map(classify, sent), strict=True):
            for probs, want in zip(got, wanted[name], strict=True):
                assert all(abs(p - float(want[LABELS.index(label)])) < 1e-5 for label, p in probs.items()), name
    assert max(float((a - b).abs().max()) for a, b in zip(wanted[None], wanted["seq-cls"], strict=True)) > 1e-2



@pytest.mark.parametrize("name", ENCODER_ADAPTERS)
def test_peft_adapters_of_hf_encoders_classify_per_request(served, name):
    """A LoRA adapter of a RoBERTa (multi-label: each label's sigmoid) and of a DistilBERT (softmax) classifier,
    placed beside the model: requests naming it get PeftModel's scores, requests without it the base's, also sent
    together."""
    client, gpt2, adapters = served
    directory, adapter = gpt2.parent / name, adapters.parent / name / "lora"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    labels = transformers.AutoConfig.from_pretrained(directory).id2label
    wanted = {}
    for chosen in (None, "lora"):
        model = transformers.AutoModelForSequenceClassification.from_pretrained(directory)
        model = (peft.PeftModel.from_pretrained(model, adapter) if chosen else model).eval()
        with torch.no_grad():
            logits = [model(**tokenizer(t, return_tensors="pt")).logits[0] for t in TEXTS]
        scores = [torch.sigmoid(x) if ENCODERS[name][1] == "multi" else torch.softmax(x, -1) for x in logits]
        wanted[chosen] = [{labels[i]: float(p) for i, p in enumerate(row)} for row in scores]

    def classify(chosen: str | None) -> list[dict[str, float]]:
        response = client.post(f"/v1/models/{name}/classify", json={"inputs": TEXTS, "adapter": chosen})
        assert response.status_code == 200, response.text
        return [o["probabilities"] for o in response.json()["outputs"]]

    sent = [None, "lora", None, "lora"]
    with ThreadPoolExecutor(len(sent)) as pool:
        for chosen, got in zip(sent, pool.map(classify, sent), strict=True):
            for probs, want in zip(got, wanted[chosen], strict=True):
                assert probs.keys() == want.keys() and all(abs(probs[k] - want[k]) < 1e-5 for k in want), chosen
    assert max(abs(a[k] - b[k]) for a, b in zip(wanted[None], wanted["lora"], strict=True) for k in a) > 1e-2
