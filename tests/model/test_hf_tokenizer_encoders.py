"""The encoders' tokenizer classes load as `transformers.AutoTokenizer` loads them (model/hf/tokenizer_classes.py):
RobertaTokenizer (byte-level BPE, its RobertaProcessing template), XLMRobertaTokenizer (a Unigram with only the file's
Precompiled normalizer, whitespace split then Metaspace, unk_id 3, its own template) and DistilBertTokenizer /
BertTokenizer (WordPiece, [CLS] a [SEP] b [SEP]), named in tokenizer_config.json or picked by config.json's model type
alone. Ids, pairs (with segment ids), character offsets and decoded text equal transformers' on ~330 strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors

from model.hf.common import HFImportError
from model.hf.tokenizer_classes import picked_class
from tests.hf_directories import CORPUS, SPM_CORPUS, strings
from tests.hf_tokenizers import load, roberta_bpe, sentencepiece_unigram, wordpiece, write_directory
from tests.model.hf_encoders import xlmr_unigram

transformers = pytest.importorskip("transformers")

TEXTS = [*strings(), *CORPUS[:4], *SPM_CORPUS[:7], "", " ", "\n", "  lead", "trail  ", "a\n\nb", " \n x",
         "multiple   spaces   here", "\t\ttab", "ĀĂ ǅ ﬁ Ω ẞ ＡＢＣ ①", "😀😀 é", "12345 apples, year 2026",
         "<s> hi </s>", "x<unk>y", "[CLS] a [SEP]", "<mask>"]
PAIRS = list(zip(TEXTS[::7], TEXTS[3::7], strict=False))
ROBERTA = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "unk_token": "<unk>",
           "pad_token": "<pad>", "mask_token": "<mask>"}
BERT = {"bos_token": None, "eos_token": None, "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]",
        "pad_token": "[PAD]", "mask_token": "[MASK]"}


def _bert_template(backend: Tokenizer) -> Tokenizer:
    """``backend`` with a template other than BertTokenizer's (b's tokens in segment 0), which the class replaces."""
    ids = [("[CLS]", backend.token_to_id("[CLS]")), ("[SEP]", backend.token_to_id("[SEP]"))]
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                           special_tokens=ids)
    return backend


# name: (tokenizer.json, tokenizer_config.json, config.json's model_type)
LAYOUTS = {
    "roberta-declared": (roberta_bpe, {**ROBERTA, "tokenizer_class": "RobertaTokenizer"}, "roberta"),
    "roberta-fast-prefix-space": (roberta_bpe, {**ROBERTA, "tokenizer_class": "RobertaTokenizerFast",
                                                "add_prefix_space": True}, "roberta"),
    "roberta-untrimmed": (roberta_bpe, {**ROBERTA, "trim_offsets": False}, "roberta"),
    "xlm-roberta-declared": (sentencepiece_unigram, {**ROBERTA, "tokenizer_class": "XLMRobertaTokenizer"},
                             "xlm-roberta"),
    "xlm-roberta-fast": (sentencepiece_unigram, {**ROBERTA, "tokenizer_class": "XLMRobertaTokenizerFast"},
                         "xlm-roberta"),
    "xlm-roberta-undeclared": (sentencepiece_unigram, ROBERTA, "xlm-roberta"),
    "xlm-roberta-no-prefix": (sentencepiece_unigram, {**ROBERTA, "add_prefix_space": False}, "xlm-roberta"),
    "xlm-roberta-nfkc": (xlmr_unigram, ROBERTA, "xlm-roberta"),  # no Precompiled: the class keeps no normalizer
    "xlm-roberta-xl-declared": (sentencepiece_unigram, {**ROBERTA, "tokenizer_class": "XLMRobertaTokenizer"},
                                "xlm-roberta-xl"),  # registered as TokenizersBackend: the file as written
    "modernbert-declared": (roberta_bpe, {**ROBERTA, "tokenizer_class": "RobertaTokenizer", "add_prefix_space": True},
                            "modernbert"),  # the registered TokenizersBackend overrides the hub's class
    "distilbert-declared": (lambda: _bert_template(wordpiece(lowercase=True, strip_accents=None)),
                            {**BERT, "tokenizer_class": "DistilBertTokenizer"}, "distilbert"),
    "distilbert-fast-cased": (lambda: wordpiece(lowercase=False, strip_accents=None),
                              {**BERT, "tokenizer_class": "DistilBertTokenizerFast", "do_lower_case": False},
                              "distilbert"),
    "distilbert-undeclared": (lambda: _bert_template(wordpiece(lowercase=False, strip_accents=False)),
                              {**BERT, "do_lower_case": True}, "distilbert"),
}


def assert_equal_to_transformers(directory: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer = load(directory)
    hf, written = (json.loads((directory / name).read_text()) for name in ("config.json", "tokenizer_config.json"))
    assert picked_class(hf, written, json.loads((directory / "tokenizer.json").read_text())) == \
        type(theirs).__name__
    encoded = [theirs(t, split_special_tokens=True, return_offsets_mapping=True) for t in TEXTS]
    assert tokenizer.encode_templated(TEXTS) == [e["input_ids"] for e in encoded]
    assert [tokenizer.encode_windows(t)[0].offsets for t in TEXTS] == [e["offset_mapping"] for e in encoded]
    # rerankers' (query, document), batched as CrossEncoder does (one pair alone with an empty b is a single text)
    pairs = theirs([a for a, _ in PAIRS], [b for _, b in PAIRS], split_special_tokens=True, return_token_type_ids=True)
    assert [tokenizer.encode_pair(a, b) for a, b in PAIRS] == list(zip(pairs["input_ids"], pairs["token_type_ids"],
                                                                       strict=True))
    for ids in [theirs(t)["input_ids"] for t in TEXTS]:  # special ids inside too
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_encoder_classes_equal_transformers(tmp_path, layout):
    build, settings, model_type = LAYOUTS[layout]
    assert_equal_to_transformers(write_directory(tmp_path / layout, build(), settings, model_type))


def test_model_section_without_its_type_as_distilbert_base_ships_it(tmp_path):
    build, settings, model_type = LAYOUTS["distilbert-undeclared"]
    directory = write_directory(tmp_path / "untyped", build(), settings, model_type)
    data = json.loads((directory / "tokenizer.json").read_text())
    del data["model"]["type"]
    (directory / "tokenizer.json").write_text(json.dumps(data))
    assert_equal_to_transformers(directory)


def test_file_truncation_and_padding_are_not_applied(tmp_path):
    """A tokenizer.json with truncation and padding sections: transformers sets both per call (none by default),
    so every text keeps all its tokens and no padding, as ours."""
    backend = roberta_bpe()
    backend.enable_truncation(max_length=4)
    backend.enable_padding(length=64, pad_id=1, pad_token="<pad>")
    directory = write_directory(tmp_path / "bounded", backend, ROBERTA, "roberta")
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    texts = TEXTS[:40]
    want = [theirs(t, split_special_tokens=True)["input_ids"] for t in texts]
    assert any(len(ids) > 4 for ids in want) and not any(len(ids) == 64 for ids in want)
    tokenizer = load(directory)
    assert tokenizer.encode_templated(texts) == want
    assert [tokenizer.encode(t) for t in texts] == [ids[1:-1] for ids in want]
    assert tokenizer.encode_pair(texts[0], texts[1])[0] == theirs(texts[0], texts[1], split_special_tokens=True)[
        "input_ids"]


def test_template_token_missing_from_the_file_is_refused(tmp_path):
    directory = write_directory(tmp_path / "missing", roberta_bpe(), {**ROBERTA, "sep_token": "<sep>"}, "roberta")
    with pytest.raises(HFImportError, match="sep_token='<sep>' is not in tokenizer.json"):
        load(directory)

