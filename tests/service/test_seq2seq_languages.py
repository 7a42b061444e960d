"""The translators and summarizers of issue 39 served end to end by a real uvicorn server (in-process, so that a test
can hold the worker): NLLB-200 / M2M100 with target and source languages, BART with bart-large-cnn's
generation_config.json, T5, as `transformers` (and `peft`) compute them.

Random models of tests/model/hf_bart.py and tests/model/hf_t5.py, saved by `transformers`; the translators with
their own tokenizers (tests/hf_seq2seq_tokenizers.py: M2M100Tokenizer's files, NLLB's tokenizer.json), BART and T5
with a word-level tokenizer.json laid out as theirs (``<s> text </s>``, ``text </s>``). The M2M100 translates one
batch of three inputs into three target languages with a PEFT LoRA adapter on one row (held queued by an event so
the requests share the batch), each row token for token what generate() (PeftModel's for the adapter's row) gives
with forced_bos_token_id = that language; its text leaves the language token out. Also: NLLB's source_lang lays
the source out as NllbTokenizer with src_lang does; BART's forced <s>, min_length, no_repeat_ngram_size and beam
defaults; the 422s; GET /v1/models' languages; OpenAI completions with target_lang as an extra field; streaming.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from model.checkpoint import load_checkpoint, load_hf_checkpoint
from tests.helpers import block_worker
from tests.hf_compare import peft_adapter, strip
from tests.hf_directories import gpt2_directory
from tests.hf_seq2seq_tokenizers import NLLB_LANGUAGES, m2m100, nllb
from tests.model import hf_t5
from tests.model.hf_bart import BOS, EOS, PAD, hf_model, save_variant
from tests.reliability.helpers import inprocess_server, wait_until
from tests.service.server import metric_samples, sse_data
from training.import_cmd import import_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")

NEW = 10
TEXTS = ["the quick brown fox", "hello world again", "good morning to you"]
TARGETS = ["de", "zh", "ja"]  # one per row of the mixed batch (M2M100's wmt21 codes)
WMT21 = ["en", "ha", "is", "ja", "cs", "ru", "zh", "de"]
ADAPTER = "lora"
BART_RULES = {"num_beams": 4, "max_length": 14, "min_length": 6, "no_repeat_ngram_size": 3, "length_penalty": 2.0,
              "early_stopping": True, "forced_bos_token_id": BOS, "forced_eos_token_id": EOS}
WORDS = "w5 w17 w33 w9 w12 w40"  # the BART and T5 sources (word-level tokens)


def word_tokenizer(directory: Path, vocab: int, specials: dict[str, int], template: str) -> Path:
    """A word-level tokenizer.json over ``vocab`` ids ("w<i>", ``specials`` at their ids), split at whitespace and
    wrapped by ``template`` as BART's / T5's tokenizers wrap a text."""
    words = {**{f"w{i}": i for i in range(vocab) if i not in specials.values()}, **specials}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w3"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, specials[t]) for t in specials if t in template])
    tokenizer.add_special_tokens(list(specials))
    tokenizer.save(str(directory / "tokenizer.json"))
    names = {"<s>": "bos_token", "</s>": "eos_token", "<pad>": "pad_token"}
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **{names[t]: t for t in specials}}))
    return directory


def with_files_of(directory: Path, tokenizer_directory: Path) -> Path:
    """``directory`` (a saved model) with the tokenizer files of ``tokenizer_directory`` beside its own."""
    for path in tokenizer_directory.iterdir():
        if path.name != "config.json":
            shutil.copy(path, directory / path.name)
    return directory


def translator(root: Path, name: str, variant: str, tokenizer: Path) -> Path:
    """A random ``variant`` (tests/model/hf_bart.py) over ``tokenizer``'s whole vocabulary, its head untied (a tied
    random model mostly repeats its last token)."""
    size = len(transformers.AutoTokenizer.from_pretrained(tokenizer))
    return with_files_of(save_variant(root / "models" / name, variant, seed=1, eos_boost=2.0, vocab_size=size,
                                      max_position_embeddings=64, tie_word_embeddings=False), tokenizer)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One in-process server: an M2M100 (wmt21 codes) with a PEFT adapter, an NLLB-200, a BART, a T5 and a GPT-2."""
    root = tmp_path_factory.mktemp("languages")
    dirs = {"m2m100": translator(root, "m2m100", "m2m100", m2m100(root / "m2m100-tok", "wmt21")),
            "nllb": translator(root, "nllb", "nllb", nllb(root / "nllb-tok", "json"))}
    peft_adapter(hf_model(dirs["m2m100"], "m2m100"), root / "adapters" / "m2m100" / ADAPTER, seed=3, r=4,
                 lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"])
    bart = save_variant(root / "models" / "bart", "bart", seed=2, eos_boost=3.0)
    generation = json.loads((bart / "generation_config.json").read_text())
    (bart / "generation_config.json").write_text(json.dumps({**generation, **BART_RULES}))
    dirs["bart"] = word_tokenizer(bart, 64, {"<s>": BOS, "<pad>": PAD, "</s>": EOS}, "<s> $A </s>")
    dirs["t5"] = word_tokenizer(hf_t5.save_t5(root / "models" / "t5", "t5-v1.1", seed=3, eos_boost=2.5),
                                hf_t5.VOCAB, {"<pad>": hf_t5.PAD, "</s>": hf_t5.EOS}, "$A </s>")
    gpt2_directory(root / "models" / "gpt2")
    with inprocess_server(root / "models", root / "adapters", request_timeout_s=300) as server, \
            server.client(timeout=120) as client:
        yield server, client, dirs, root / "adapters" / "m2m100" / ADAPTER


def hf_generate(directory: Path, text: str, adapter: Path | None = None, tokenizer_fields: dict | None = None,
                **kwargs) -> list[int]:
    """generate()'s tokens for ``text`` (alone: no padding), after the decoder start, cut at EOS."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **(tokenizer_fields or {}))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        out = model.generate(input_ids=tokenizer(text, return_tensors="pt").input_ids, **kwargs)
    return strip(out[0].tolist(), 1, model.config.eos_token_id)


def post(client, model: str, **body):
    return client.post(f"/v1/models/{model}/generate", json=body)


def test_one_batch_into_three_languages_with_an_adapter_row_equals_generate(served):
    """Two requests held queued by the worker (an event), taken together: rows 0 and 2 on the base, row 1 with the
    adapter; each row generate()'s tokens with its language forced, and its text without the language token."""
    server, client, dirs, adapter = served
    directory = dirs["m2m100"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    wanted = [hf_generate(directory, text, adapter if i == 1 else None, max_new_tokens=NEW, num_beams=1,
                          do_sample=False, forced_bos_token_id=tokenizer.get_lang_id(lang))
              for i, (text, lang) in enumerate(zip(TEXTS, TARGETS, strict=True))]
    base = {"inputs": [TEXTS[0], TEXTS[2]], "target_lang": [TARGETS[0], TARGETS[2]], "max_new_tokens": NEW,
            "strategy": "greedy"}
    tuned = {"inputs": [TEXTS[1]], "target_lang": TARGETS[1], "max_new_tokens": NEW, "strategy": "greedy",
             "adapter": ADAPTER}
    worker = server.engine.get("m2m100")
    before = metric_samples(client.get("/metrics").text, "tserve_batch_size_bucket")
    release = block_worker(worker)
    with ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(post, client, "m2m100", **body) for body in (base, tuned)]
        assert wait_until(lambda: worker.scheduler.num_waiting == 2, timeout_s=60)
        release.set()
        responses = [f.result(timeout=120) for f in pending]
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    rows = [*responses[0].json()["outputs"], *responses[1].json()["outputs"]]
    got = [rows[0], rows[2], rows[1]]  # back in TEXTS' order
    assert [o["tokens"] for o in got] == wanted
    assert [o["tokens"][0] for o in got] == [tokenizer.get_lang_id(lang) for lang in TARGETS]
    for output in got:
        assert output["text"] == tokenizer.decode(output["tokens"], skip_special_tokens=True)
        assert "__" not in output["text"]
    assert wanted[1] != hf_generate(directory, TEXTS[1], max_new_tokens=NEW, num_beams=1, do_sample=False,
                                    forced_bos_token_id=tokenizer.get_lang_id(TARGETS[1]))  # the adapter matters
    after = metric_samples(client.get("/metrics").text, "tserve_batch_size_bucket")
    key_le2, key_inf = (("le", "2.0"), ("model", "m2m100")), (("le", "+Inf"), ("model", "m2m100"))
    three = (after[key_inf] - after[key_le2]) - (before.get(key_inf, 0) - before.get(key_le2, 0))
    assert three > 0, "no model step ran the three rows together"


def test_nllb_source_lang_lays_the_source_out_as_the_tokenizer_with_src_lang(served):
    """source_lang="deu_Latn" (the directory's src_lang is fra_Latn): the tokens generate() gives for
    NllbTokenizer(src_lang="deu_Latn")'s ids, which differ from the default layout's."""
    _, client, dirs, _ = served
    directory = dirs["nllb"]
    target = transformers.AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids("zho_Hans")
    answers = []
    for source in ("deu_Latn", None):
        fields = {"src_lang": source} if source else None
        wanted = [hf_generate(directory, text, tokenizer_fields=fields, max_new_tokens=NEW, num_beams=1,
                              do_sample=False, forced_bos_token_id=target) for text in TEXTS]
        body = {"inputs": TEXTS, "target_lang": "zho_Hans", "max_new_tokens": NEW, "strategy": "greedy"}
        response = post(client, "nllb", **body, **({"source_lang": source} if source else {}))
        assert response.status_code == 200, response.text
        assert [o["tokens"] for o in response.json()["outputs"]] == wanted, source
        answers.append(wanted)
    assert answers[0] != answers[1]  # the source language's token changes the translation


def test_a_target_prefix_follows_the_target_languages_token(served):
    """A row with a target prefix and a target language continues ``lang prefix`` as generate() continues those
    decoder inputs; a row without a prefix in the same request is forced as usual."""
    _, client, dirs, _ = served
    directory = dirs["m2m100"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    body = {"inputs": TEXTS[:2], "target_lang": ["zh", "ja"], "target_prefix": ["quick brown", ""],
            "max_new_tokens": NEW, "strategy": "greedy"}
    response = post(client, "m2m100", **body)
    assert response.status_code == 200, response.text
    prefixed, plain = response.json()["outputs"]
    start = [model.config.decoder_start_token_id, tokenizer.get_lang_id("zh"),
             *tokenizer.convert_tokens_to_ids(tokenizer.tokenize("quick brown"))]
    with torch.no_grad():
        out = model.generate(input_ids=tokenizer(TEXTS[0], return_tensors="pt").input_ids,
                             decoder_input_ids=torch.tensor([start]), max_new_tokens=NEW, num_beams=1, do_sample=False)
    assert prefixed["tokens"] == strip(out[0].tolist(), len(start), model.config.eos_token_id)
    assert plain["tokens"] == hf_generate(directory, TEXTS[1], max_new_tokens=NEW, num_beams=1, do_sample=False,
                                          forced_bos_token_id=tokenizer.get_lang_id("ja"))


@pytest.mark.parametrize(("model", "fields", "hf"), [
    ("bart", {}, {}),  # generation_config's defaults: beam 4, forced <s>, min_length, no_repeat_ngram_size
    ("bart", {"strategy": "greedy"}, {"num_beams": 1}),
    ("bart", {"max_new_tokens": 3}, {"max_new_tokens": 3}),  # min_length's default held to max_new_tokens
    ("t5", {"strategy": "greedy"}, {"num_beams": 1}),
    ("t5", {"strategy": "beam", "num_beams": 4}, {"num_beams": 4}),
], ids=["bart-defaults", "bart-greedy", "bart-short", "t5-greedy", "t5-beam"])
def test_bart_and_t5_equal_generate(served, model, fields, hf):
    _, client, dirs, _ = served
    body = {"inputs": [WORDS, "w7 w8", "w21"], "max_new_tokens": NEW, **fields}
    response = post(client, model, **body)
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    for text, output in zip(body["inputs"], outputs, strict=True):
        assert output["tokens"] == hf_generate(dirs[model], text, **{"max_new_tokens": NEW, "do_sample": False,
                                                                     **hf}), text
        assert "<s>" not in output["text"] and "</s>" not in output["text"]
    if model == "bart":
        assert all(o["tokens"][0] == BOS for o in outputs)


@pytest.mark.parametrize(("model", "fields", "field", "says"), [
    ("m2m100", {"target_lang": "xx"}, "target_lang", "target_lang='xx' is not a language code of this model "
     f"(codes: {', '.join(WMT21)})"),
    ("m2m100", {"source_lang": ["de", "xx", "en"]}, "source_lang[1]", "source_lang='xx' is not a language code"),
    ("m2m100", {"target_lang": ["de", "zh"]}, "target_lang", "needs one entry per input (3), got 2"),
    ("t5", {"target_lang": "de"}, "target_lang", "a seq2seq model without language codes; language codes are for "
     "NLLB-200, M2M100 and mBART-50 models"),
    ("gpt2", {"source_lang": "de"}, "source_lang", "is a causal_lm model; language codes are for NLLB-200"),
    ("bart", {"min_new_tokens": 5, "max_new_tokens": 3}, "min_new_tokens", "must be in [0, max_new_tokens=3]"),
], ids=["unknown-target", "unknown-source", "length", "t5", "causal", "explicit-min-new-tokens"])
def test_what_cannot_be_done_is_a_422_naming_the_field(served, model, fields, field, says):
    _, client, _, _ = served
    response = post(client, model, **{"inputs": TEXTS, **fields})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and says in error["message"], error


def test_the_model_list_names_the_language_codes(served):
    _, client, _, _ = served
    listed = {m["name"]: m for m in client.get("/v1/models").json()["data"]}
    assert (listed["m2m100"]["languages"], listed["m2m100"]["source_language"]) == (WMT21, "de")
    assert (listed["nllb"]["languages"], listed["nllb"]["source_language"]) == (NLLB_LANGUAGES, "fra_Latn")
    assert all(listed[name]["languages"] is None for name in ("bart", "t5", "gpt2"))


@pytest.mark.parametrize("name", ["m2m100", "nllb"])
def test_an_imported_checkpoint_keeps_the_language_codes(served, tmp_path, name):
    """python -m training import keeps the tokenizer files the codes come from (model.hf.companion_files)."""
    _, _, dirs, _ = served
    languages = load_hf_checkpoint(dirs[name], device="cpu").languages
    assert languages is not None and len(languages.ids) > 4
    assert load_checkpoint(import_hf(dirs[name], tmp_path / "ours"), device="cpu").languages == languages


def test_openai_completions_and_a_stream_take_target_lang(served):
    """The real openai client with target_lang as an extra field (a language per prompt), streamed or not: the
    generate route's texts, usage counting the language token as generate() does; a generate stream's text is the
    unstreamed one, without the language token."""
    server, client, _, _ = served
    body = {"inputs": TEXTS, "target_lang": TARGETS, "max_new_tokens": NEW, "strategy": "greedy"}
    outputs = post(client, "m2m100", **body).json()["outputs"]
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    completion = api.completions.create(model="m2m100", prompt=TEXTS, max_tokens=NEW, temperature=0,
                                        extra_body={"target_lang": TARGETS})
    assert [c.text for c in completion.choices] == [o["text"] for o in outputs]
    assert completion.usage.completion_tokens == sum(len(o["tokens"]) for o in outputs)
    streamed = api.completions.create(model="m2m100", prompt=TEXTS, max_tokens=NEW, temperature=0, stream=True,
                                      extra_body={"target_lang": TARGETS})
    texts = [""] * len(TEXTS)
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [o["text"] for o in outputs]
    with pytest.raises(openai.UnprocessableEntityError, match="not a language code"):
        api.completions.create(model="m2m100", prompt=TEXTS[0], max_tokens=NEW, extra_body={"target_lang": "xx"})
    stream = client.post("/v1/models/m2m100/generate", json={**body, "inputs": TEXTS[:1], "target_lang": "ja",
                                                             "stream": True})
    events = [e for e in sse_data(stream.iter_lines()) if e != "[DONE]"]
    whole = post(client, "m2m100", **{**body, "inputs": TEXTS[:1], "target_lang": "ja"}).json()["outputs"][0]
    assert "".join(e.get("text", "") for e in events) == whole["text"]
    assert [e["token"] for e in events if e.get("token") is not None] == whole["tokens"]
