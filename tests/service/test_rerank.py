"""/v1/rerank (and /rerank, /v2/rerank) and /score (and /v1/score) on a real server, against `transformers` and `peft`.

The cross-encoders are random BertForSequenceClassification with one label, saved by `transformers` (one with
sentence-transformers' CrossEncoder activation Identity in config.json, one without: sigmoid). Their scores must be
transformers' logit of each (query, document) pair through that activation, and sentence-transformers'
``CrossEncoder.predict``; with a PEFT adapter, PeftModel's. The embedding model is a BertModel in
sentence-transformers' layout (max pooling): its scores are the cosine of transformers' pooled vectors, and of
``SentenceTransformer.encode``'s. GPT-2 stands for a model that cannot rerank. A one-label
ModernBertForSequenceClassification reranks as the BERT cross-encoder does, and a ModernBertForTokenClassification
serves /entities as transformers' token-classification pipeline finds them (tests/model/hf_modernbert.py), with a
TOKEN_CLS adapter as the pipeline over its PeftModel, also beside a base request.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from model.hf.common import HFImportError
from model.hf.sentence import score_activation
from service.engine.pooling import batch_order
from tests.helpers import error_of
from tests.hf_compare import peft_adapter, randomize
from tests.hf_directories import TEXTS, bert_directory, gpt2_directory, sentence_transformers_layout
from tests.model.hf_modernbert import modernbert_directory
from tests.service.server import running_server

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
sentence_transformers = pytest.importorskip("sentence_transformers")

MAX_DOCUMENTS = 8
MAX_TOKENS = 64  # the BERT directories' max_position_embeddings
IDENTITY = "torch.nn.modules.linear.Identity"
QUERY = "the quick brown fox"
DOCUMENTS = ["jumps over the lazy dog", "print('hello')", "the fox", "for i in range(10):\n    total += i",
             "Élan vital, déjà vu"]
LONG = "the quick brown fox jumps over the lazy dog " * 12  # over MAX_TOKENS tokens
ADAPTER = "seq-cls"
NER_ADAPTER = "token-cls"


def cross_encoder_directory(directory: Path, activation: str | None) -> Path:
    """A random one-label BertForSequenceClassification (bert_directory's tokenizer), with ``activation`` as
    sentence-transformers' CrossEncoder saves it in config.json."""
    bert_directory(directory, head=True)
    config = transformers.BertConfig.from_pretrained(directory)
    config.num_labels = 1
    if activation is not None:
        config.sentence_transformers = {"activation_fn": activation}
    randomize(transformers.BertForSequenceClassification(config), seed=11).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerank")
    models = root / "models"
    cross = cross_encoder_directory(models / "ce", None)
    cross_encoder_directory(models / "ce-identity", IDENTITY)
    peft_adapter(transformers.BertForSequenceClassification.from_pretrained(cross), root / "adapters" / "ce" / ADAPTER,
                 3, r=2, lora_alpha=4, task_type="SEQ_CLS", target_modules=["query", "value"])
    embed = sentence_transformers_layout(bert_directory(models / "embed", head=False))
    peft_adapter(transformers.BertModel.from_pretrained(embed), root / "adapters" / "embed" / ADAPTER, 4, r=2,
                 lora_alpha=4, target_modules=["query", "value"])
    gpt2_directory(models / "gpt2")
    modernbert_directory(models / "ce-modernbert", "one-label", seed=3)
    ner = modernbert_directory(models / "ner-modernbert", "token", seed=4)
    peft_adapter(transformers.AutoModelForTokenClassification.from_pretrained(ner),
                 root / "adapters" / "ner-modernbert" / NER_ADAPTER, 5, r=2, lora_alpha=4, task_type="TOKEN_CLS",
                 target_modules=["Wqkv", "Wo", "dense"])
    env = dict(TSERVE_MAX_RERANK_DOCUMENTS=str(MAX_DOCUMENTS), TSERVE_WARMUP="false")
    with running_server(models, root / "adapters", **env) as server, server.client() as client:
        yield client, models, root / "adapters"


def cross_scores(directory: Path, queries: list[str], documents: list[str], adapter: Path | None = None,
                 identity: bool = False) -> list[float]:
    """transformers' (peft's) logit of each (query, document) pair, truncated as the server truncates, through
    CrossEncoder's activation (one query for all documents, or one per document)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    pairs = [(queries[i if len(queries) > 1 else 0], d) for i, d in enumerate(documents)]
    batch = tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True, truncation="only_second",
                      max_length=MAX_TOKENS, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits[:, 0]
    return (logits if identity else torch.sigmoid(logits)).tolist()


def rerank(client, body: dict, path: str = "/v1/rerank") -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("model", ["ce", "ce-identity", "ce-modernbert"])
def test_a_cross_encoder_ranks_by_transformers_scores_through_its_activation(served, model):
    client, models, _ = served
    out = rerank(client, {"model": model, "query": QUERY, "documents": DOCUMENTS})
    want = cross_scores(models / model, [QUERY], DOCUMENTS, identity=model == "ce-identity")
    predicted = sentence_transformers.CrossEncoder(str(models / model), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS])
    assert want == pytest.approx(predicted.tolist(), abs=1e-5)  # CrossEncoder reads the activation as we do
    assert out["scored_by"] == "cross-encoder" and out["model"] == model and out["id"]
    assert [r["index"] for r in out["results"]] == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    for result in out["results"]:
        assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    tokenizer = transformers.AutoTokenizer.from_pretrained(models / model)
    assert out["usage"]["total_tokens"] == sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    if model == "ce-identity":
        assert min(want) < 0 or max(want) > 1  # raw logits: not squashed into (0, 1)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_cohere_shaped_requests_with_top_n_and_without_documents(served, path):
    client, _, _ = served
    full = rerank(client, {"model": "ce", "query": QUERY, "documents": DOCUMENTS})
    body = {"model": "ce", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2,
            "return_documents": False}
    out = rerank(client, body, path)
    assert out["results"] == [{k: v for k, v in r.items() if k != "document"} for r in full["results"][:2]]


def test_ties_keep_the_request_order(served):
    client, _, _ = served
    documents = ["the fox", "print('hello')", "the fox", "print('hello')", "the fox"]
    results = rerank(client, {"model": "ce", "query": QUERY, "documents": documents})["results"]
    scores = [r["relevance_score"] for r in results]
    assert len(set(scores)) == 2 and scores == sorted(scores, reverse=True)
    for score in set(scores):
        indexes = [r["index"] for r in results if r["relevance_score"] == score]
        assert indexes == sorted(indexes)


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
@pytest.mark.parametrize("text_1, text_2", [(QUERY, DOCUMENTS), ([QUERY], DOCUMENTS), (QUERY, DOCUMENTS[0]),
                                            (DOCUMENTS[::-1], DOCUMENTS)])
def test_score_one_to_many_and_one_to_one_as_vllm(served, path, text_1, text_2):
    client, models, _ = served
    response = client.post(path, json={"model": "ce", "text_1": text_1, "text_2": text_2})
    assert response.status_code == 200, response.text
    out = response.json()
    queries = [text_1] if isinstance(text_1, str) else text_1
    documents = [text_2] if isinstance(text_2, str) else text_2
    want = cross_scores(models / "ce", queries, documents)
    assert out["object"] == "list" and out["model"] == "ce" and out["scored_by"] == "cross-encoder"
    assert [(d["index"], d["object"]) for d in out["data"]] == [(i, "score") for i in range(len(documents))]
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=1e-5)
    usage = out["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0 and usage["completion_tokens"] == 0


def embedding_cosines(directory: Path, texts: list[str], adapter: Path | None = None) -> list[float]:
    """The cosine of texts[0]'s vector with each other text's: transformers' (peft's) hidden states max-pooled (the
    directory's pooling), one text at a time (no padding)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertModel.from_pretrained(directory).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        vectors = [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0].amax(0).double() for t in texts]
    return [float(torch.nn.functional.cosine_similarity(vectors[0], v, dim=0)) for v in vectors[1:]]


@pytest.mark.parametrize("adapter", [None, ADAPTER])
def test_an_embedding_model_ranks_by_the_cosine_of_its_vectors(served, adapter):
    client, models, adapters = served
    model = "embed" if adapter is None else f"embed:{adapter}"
    out = rerank(client, {"model": model, "query": QUERY, "documents": DOCUMENTS})
    want = embedding_cosines(models / "embed", [QUERY, *DOCUMENTS], adapter and adapters / "embed" / adapter)
    assert out["scored_by"] == "embedding-cosine"
    assert [r["index"] for r in out["results"]] == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    for result in out["results"]:
        assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-5)
    if adapter is None:  # sentence-transformers' own pooling of the saved layout gives the same cosines
        vectors = sentence_transformers.SentenceTransformer(str(models / "embed"), device="cpu").encode(
            [QUERY, *DOCUMENTS], convert_to_tensor=True)
        assert [float(torch.nn.functional.cosine_similarity(vectors[0], v, dim=0)) for v in vectors[1:]] == (
            pytest.approx(want, abs=1e-5))
    else:
        assert want != pytest.approx(embedding_cosines(models / "embed", [QUERY, *DOCUMENTS]), abs=1e-4)
    # one-to-one: each text_1 entry against the text_2 entry at its position
    pairs = client.post("/score", json={"model": model, "text_1": DOCUMENTS[::-1], "text_2": DOCUMENTS}).json()
    want = [embedding_cosines(models / "embed", [q, d], adapter and adapters / "embed" / adapter)[0]
            for q, d in zip(DOCUMENTS[::-1], DOCUMENTS, strict=True)]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(want, abs=1e-5)


def test_an_adapter_scores_as_peft_does(served):
    client, models, adapters = served
    out = client.post("/v1/score", json={"model": f"ce:{ADAPTER}", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    want = cross_scores(models / "ce", [QUERY], DOCUMENTS, adapters / "ce" / ADAPTER)
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=1e-5)
    assert want != pytest.approx(cross_scores(models / "ce", [QUERY], DOCUMENTS), abs=1e-3)  # the adapter matters


@pytest.mark.parametrize("model", ["ce", "embed"])
def test_truncate_cuts_a_long_document_and_only_the_document(served, model):
    client, models, _ = served
    body = {"model": model, "query": QUERY, "documents": ["the fox", LONG, LONG * 40]}  # the last: cut before encoding
    assert error_of(client.post("/v1/rerank", json=body), 422, "invalid_request")["field"] == "documents[1]"
    out = rerank(client, {**body, "truncate": True})
    if model == "ce":
        want = cross_scores(models / "ce", [QUERY], body["documents"])
        assert {r["index"]: r["relevance_score"] for r in out["results"]} == pytest.approx(dict(enumerate(want)),
                                                                                           abs=1e-5)
    assert out["usage"]["total_tokens"] <= 4 * MAX_TOKENS
    refused = client.post("/v1/rerank", json={**body, "query": LONG, "truncate": True})
    assert error_of(refused, 422, "invalid_request")["field"] == "query"


@pytest.mark.parametrize("body, status, field", [
    ({"model": "ce", "query": QUERY, "documents": []}, 422, "documents"),
    ({"model": "ce", "query": QUERY, "documents": ["d"] * (MAX_DOCUMENTS + 1)}, 422, "documents"),
    ({"model": "ce", "query": "", "documents": ["d"]}, 422, "query"),
    ({"model": "ce", "query": QUERY, "documents": [{"txt": "d"}]}, 422, "documents[0].text"),
    ({"model": "gpt2", "query": QUERY, "documents": ["d"]}, 422, None),
    ({"model": "ce:missing", "query": QUERY, "documents": ["d"]}, 404, None),
    ({"model": "nope", "query": QUERY, "documents": ["d"]}, 404, None),
])
def test_bad_requests_are_4xx_and_the_server_keeps_serving(served, body, status, field):
    client, _, _ = served
    error = error_of(client.post("/v1/rerank", json=body), status)
    assert field is None or error["field"] == field, error
    if body["model"] == "gpt2":
        assert "rerank needs a classifier" in error["message"]
    rerank(client, {"model": "ce", "query": QUERY, "documents": DOCUMENTS[:2]})


def test_score_lists_of_different_lengths_are_refused(served):
    client, _, _ = served
    body = {"model": "ce", "text_1": [QUERY, QUERY], "text_2": DOCUMENTS}
    assert error_of(client.post("/v1/score", json=body), 422)["field"] == "text_2"


def test_the_model_list_says_which_tasks_each_model_serves(served):
    client, _, _ = served
    tasks = {m["name"]: m["tasks"] for m in client.get("/v1/models").json()["data"]}
    assert tasks == {"ce": ["classify", "embed", "rerank"], "ce-identity": ["classify", "embed", "rerank"],
                     "embed": ["embed", "rerank"], "gpt2": ["generate"],
                     "ce-modernbert": ["classify", "embed", "rerank"],
                     "ner-modernbert": ["entities", "embed", "rerank"]}


def test_a_modernbert_token_classifier_finds_the_entities_of_the_transformers_pipeline(served):
    client, models, _ = served
    pipe = transformers.pipeline("token-classification", model=str(models / "ner-modernbert"),
                                 aggregation_strategy="simple")
    body = {"inputs": TEXTS, "aggregation_strategy": "simple"}
    response = client.post("/v1/models/ner-modernbert/entities", json=body)
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    assert sum(map(len, outputs)) >= len(TEXTS)  # entities found, not all "O"
    for text, got in zip(TEXTS, outputs, strict=True):
        want = pipe(text)
        assert [{**e, "score": None} for e in got] == [{**w, "score": None} for w in want], text
        assert all(abs(e["score"] - float(w["score"])) < 1e-5 for e, w in zip(got, want, strict=True)), text


def test_a_modernbert_token_classifier_adapter_finds_the_entities_of_its_peft_model(served):
    """``adapter``: the pipeline's entities over the PeftModel (LoRAs and the adapter's own classifier); sent at
    once with a base request, each gets its own."""
    client, models, adapters = served
    directory = models / "ner-modernbert"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    base = transformers.AutoModelForTokenClassification.from_pretrained(directory).eval()
    peft_model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForTokenClassification.from_pretrained(directory), adapters / "ner-modernbert" /
        NER_ADAPTER).eval()
    pipes = {adapter: transformers.pipeline("token-classification", model=model, tokenizer=tokenizer,
                                            aggregation_strategy="simple")
             for adapter, model in ((None, base), (NER_ADAPTER, peft_model))}
    wanted = {adapter: [pipe(text) for text in TEXTS] for adapter, pipe in pipes.items()}
    assert wanted[None] != wanted[NER_ADAPTER]  # the adapter changes the entities
    assert all(sum(map(len, w)) >= len(TEXTS) for w in wanted.values())  # entities found, not all "O"

    def entities(adapter: str | None) -> list[list[dict]]:
        body = {"inputs": TEXTS, "aggregation_strategy": "simple", "adapter": adapter}
        response = client.post("/v1/models/ner-modernbert/entities", json=body)
        assert response.status_code == 200, response.text
        return response.json()["outputs"]

    sent = [NER_ADAPTER, None, NER_ADAPTER]
    with ThreadPoolExecutor(len(sent)) as pool:
        answers = list(pool.map(entities, sent))
    for adapter, outputs in zip(sent, answers, strict=True):
        for text, got, want in zip(TEXTS, outputs, wanted[adapter], strict=True):
            assert [{**e, "score": None} for e in got] == [{**w, "score": None} for w in want], (adapter, text)
            assert all(abs(e["score"] - float(w["score"])) < 1e-5 for e, w in zip(got, want, strict=True)), text


def test_rows_over_one_forward_go_longest_first_and_rows_that_fit_as_they_came():
    assert batch_order([3, 9, 5, 9, 1], 5) == [0, 1, 2, 3, 4]  # one forward: nothing to gain
    assert batch_order([3, 9, 5, 9, 1], 2) == [1, 3, 2, 0, 4]  # longest first, ties as they came
    assert batch_order([], 2) == []


def test_more_rows_than_a_forward_takes_are_answered_in_the_request_order(served):
    """TSERVE_MAX_BATCH_SIZE 2: five documents in three forwards of different widths (longest first), each score
    still transformers' for its own pair; the token classifier's per-token outputs of chunks of different widths give
    the pipeline's entities per text."""
    _, models, adapters = served
    assert len({len(d) for d in DOCUMENTS}) == len(DOCUMENTS) and len(TEXTS) > 2  # distinct lengths, > 1 forward
    env = dict(TSERVE_MAX_BATCH_SIZE="2", TSERVE_MAX_RERANK_DOCUMENTS=str(MAX_DOCUMENTS), TSERVE_WARMUP="false")
    with running_server(models, adapters, **env) as server, server.client() as client:
        out = rerank(client, {"model": "ce", "query": QUERY, "documents": DOCUMENTS})
        response = client.post("/v1/models/ner-modernbert/entities",
                               json={"inputs": TEXTS, "aggregation_strategy": "simple"})
    want = cross_scores(models / "ce", [QUERY], DOCUMENTS)
    assert {r["index"]: r["relevance_score"] for r in out["results"]} == {
        i: pytest.approx(score, abs=1e-5) for i, score in enumerate(want)}
    assert response.status_code == 200, response.text
    pipe = transformers.pipeline("token-classification", model=str(models / "ner-modernbert"),
                                 aggregation_strategy="simple")
    for text, got in zip(TEXTS, response.json()["outputs"], strict=True):
        assert [{**e, "score": None} for e in got] == [{**w, "score": None} for w in pipe(text)], text


@pytest.mark.parametrize("config, want", [
    ({}, None),
    ({"sentence_transformers": {"activation_fn": IDENTITY, "version": "5.0.0"}}, "identity"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}, "sigmoid"),  # before v4
    ({"sentence_transformers": {"activation_fn": "my_package.Custom"}}, None),  # CrossEncoder ignores it too
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Softmax"}}, HFImportError),
])
def test_the_cross_encoder_activation_is_read_as_sentence_transformers_reads_it(config, want):
    if want is HFImportError:
        with pytest.raises(HFImportError, match="Softmax"):
            score_activation(config)
    else:
        assert score_activation(config) == want
