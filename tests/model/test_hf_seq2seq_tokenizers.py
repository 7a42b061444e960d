"""The translators' and T5's tokenizers (model/hf/seq2seq_tokenizers.py, m2m100_tokenizer.py, languages.py) give the
ids and text `transformers` 5 gives, from tokenizer.json and from the SentencePiece files alone: NllbTokenizer (legacy
behaviour on and off), MBart50Tokenizer, M2M100Tokenizer and T5Tokenizer, with their source-language layouts and
target-language tokens (forced_bos_token_id), and the decoded text cleaned up where tokenizer_config.json asks; BART's
tokenizer.json as BartTokenizer (RobertaTokenizer) reads it; hf_companions picks them."""

from __future__ import annotations

import json
import re

import pytest

from model.config import Seq2SeqConfig
from model.hf import HFImportError, companion_files, hf_companions, load_hf_model
from model.hf.languages import LanguageError
from model.hf.seq2seq_tokenizers import load_languages, load_seq2seq_tokenizer
from tests.hf_seq2seq_tokenizers import (
    M2M100_LANGUAGES,
    MBART50_LANGUAGES,
    NLLB_LANGUAGES,
    cleaning_up,
    m2m100,
    mbart50,
    nllb,
    t5,
    texts,
    transformers,
)
from tests.hf_tokenizers import load, roberta_bpe, write_directory

TEXTS = texts()
LAYOUTS = {
    "nllb-json": lambda d: nllb(d, "json"), "nllb-legacy-json": lambda d: nllb(d, "json", legacy=True),
    "nllb-spm": lambda d: nllb(d, "spm"), "nllb-legacy-spm": lambda d: nllb(d, "spm", legacy=True),
    "nllb-spm-undeclared": lambda d: nllb(d, "spm", declared_ids=False),
    "mbart50-json": lambda d: mbart50(d, "json"), "mbart50-spm": lambda d: mbart50(d, "spm"),
    "t5-json": lambda d: t5(d, "json"), "t5-spm": lambda d: t5(d, "spm"), "t5-8-spm": lambda d: t5(d, "spm", 8),
    "m2m100": m2m100, "m2m100-wmt21": lambda d: m2m100(d, "wmt21"),
}
CASES = LAYOUTS | {f"{case}-cleanup": lambda d, case=case: cleaning_up(LAYOUTS[case](d))  # NLLB's: ignored (BPE)
                   for case in ("nllb-json", "mbart50-json", "mbart50-spm", "t5-json", "t5-spm", "m2m100")}
LANGUAGES = {"nllb": NLLB_LANGUAGES, "mbart50": MBART50_LANGUAGES, "m2m100": M2M100_LANGUAGES}


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tmp_path_factory):
    """(case, directory, transformers' tokenizer, ours, our Languages) for one directory layout."""
    directory = CASES[request.param](tmp_path_factory.mktemp(request.param) / "tokenizer")
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    config = Seq2SeqConfig(vocab_size=len(reference) + 8, pad_id=reference.pad_token_id,
                           eos_id=reference.eos_token_id, bos_id=reference.pad_token_id)
    tokenizer = load_seq2seq_tokenizer(directory, config)
    languages = load_languages(directory, tokenizer)
    return request.param, directory, reference, tokenizer, languages


def test_ids_and_text_equal_transformers(loaded):
    case, _, reference, tokenizer, _ = loaded
    expected = reference(TEXTS)["input_ids"]
    ours = tokenizer.encode_templated(TEXTS)
    mismatches = [(t, e, o) for t, e, o in zip(TEXTS, expected, ours, strict=True) if e != o]
    assert not mismatches, f"{case}: {len(mismatches)} of {len(TEXTS)} differ, first {mismatches[0]}"
    for skip in (True, False):
        want = [reference.decode(ids, skip_special_tokens=skip) for ids in expected]
        got = tokenizer.decode_batch(expected, skip_special_tokens=skip)
        wrong = [(w, g) for w, g in zip(want, got, strict=True) if w != g]
        assert not wrong, f"{case} skip_special_tokens={skip}: {len(wrong)} differ, first {wrong[0]}"


def test_languages_equal_transformers(loaded):
    """source_lang lays a text out as the tokenizer with src_lang does; target_lang is the forced first token."""
    case, directory, reference, tokenizer, languages = loaded
    family = case.split("-")[0]
    if family not in LANGUAGES:
        assert languages is None
        return
    codes = LANGUAGES[family]
    forced = reference.get_lang_id if family == "m2m100" else reference.convert_tokens_to_ids
    assert {code: languages.target_id(code) for code in languages.ids} == {code: forced(code) for code in languages.ids}
    if family != "nllb":  # the classes' own lists
        assert set(languages.ids) == set(reference.lang_code_to_id)
    assert set(codes) <= set(languages.ids)
    plain = [tokenizer.encode(text) for text in TEXTS[:40]]
    assert [languages.source_ids(ids) for ids in plain] == reference(TEXTS[:40])["input_ids"]  # the directory's own
    for code in codes:
        source = transformers.AutoTokenizer.from_pretrained(directory, src_lang=code)
        assert [languages.source_ids(ids, code) for ids in plain] == source(TEXTS[:40])["input_ids"], (case, code)
    with pytest.raises(LanguageError, match="target_lang='xx_YY' is not a language code") as error:
        languages.target_id("xx_YY")
    listed = str(error.value).rsplit("(codes: ", 1)[1].removesuffix(")").split(", ")
    assert listed == list(languages.ids)
    with pytest.raises(LanguageError, match="source_lang='qq'"):
        languages.source_ids([5], "qq")


@pytest.mark.parametrize("declared", ["BartTokenizer", "BartTokenizerFast", None])
def test_bart_tokenizer_is_robertas(declared, tmp_path):
    """BART's tokenizer.json loads as transformers 5's BartTokenizer (RobertaTokenizer) reads it."""
    settings = {"tokenizer_class": declared} if declared else {}
    directory = write_directory(tmp_path / "bart", roberta_bpe(), settings, "bart")
    reference, ours = transformers.AutoTokenizer.from_pretrained(directory), load(directory)
    expected = reference(TEXTS)["input_ids"]
    assert ours.encode_templated(TEXTS) == expected
    assert ours.decode_batch(expected) == reference.batch_decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("build, settings, named", [
    (lambda d: t5(d, "spm"), {"extra_ids": "100"}, "extra_ids='100' must be an integer"),
    (lambda d: t5(d, "spm"), {"extra_ids": 10**9}, "extra_ids=1000000000 must be an integer from 0 to"),
    (m2m100, {"sp_model_kwargs": {"enable_sampling": True}}, "sp_model_kwargs="),
    (lambda d: nllb(d, "spm"), {}, "sentencepiece.bpe.model: not a SentencePiece model"),
])
def test_what_transformers_would_load_differently_is_refused_by_name(tmp_path, build, settings, named):
    directory = build(tmp_path / "refused")
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    if not settings:
        (directory / "sentencepiece.bpe.model").write_bytes(b"\x0a\x05not a model")
    with pytest.raises(HFImportError, match=re.escape(named)):
        load_seq2seq_tokenizer(directory, Seq2SeqConfig(vocab_size=512))


@pytest.mark.parametrize("case, kind", [("nllb-spm", "Tokenizer"), ("m2m100", "M2M100SpmTokenizer"),
                                        ("mbart50-spm", "Tokenizer"), ("t5-json", "Tokenizer")])
def test_hf_companions_picks_the_class_tokenizer(tmp_path, case, kind):
    """A random model's directory loads the tokenizer its tokenizer_config.json names, and keeps its files."""
    directory = CASES[case](tmp_path / case)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    size = len(reference)
    shape = {"d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
             "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 64}
    if case.startswith("t5"):
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=size, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0))
    elif case.startswith("mbart50"):
        model = transformers.MBartForConditionalGeneration(transformers.MBartConfig(vocab_size=size, **shape))
    else:
        model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(vocab_size=size, **shape))
    model.save_pretrained(directory)
    _, config = load_hf_model(directory)
    tokenizer = hf_companions(directory, config)["tokenizer"]
    assert type(tokenizer).__name__ == kind
    assert tokenizer.encode_templated(TEXTS[:20]) == reference(TEXTS[:20])["input_ids"]
    kept = companion_files(directory)
    assert {name for name in ("sentencepiece.bpe.model", "vocab.json", "spiece.model", "tokenizer.json")
            if (directory / name).is_file()} <= set(kept)
