"""Llama-family tokenizer directories load as `transformers.AutoTokenizer` loads them (model/hf/tokenizer.py and
tokenizer_classes.py): byte-level BPE (SmolLM2, Qwen2.5/3, Llama 3), SentencePiece-converted BPE with byte fallback
(Llama 2's legacy and Metaspace files, Mistral, Phi-3, Gemma), Unigram and BERT's WordPiece, with added tokens
(special and not) and every add_bos_token / add_eos_token setting. Ids and decoded text (with and without special
tokens) equal transformers' on ~330 strings: accents, CJK, emoji, whitespace runs, characters outside the tiny
vocabularies (byte-fallback pieces) and special-token text typed by a user (which stays text for us, as
``split_special_tokens=True`` has it in transformers). The tokenizers are trained here; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, processors

from model.constraints import Constraint, ConstraintError
from model.constraints import compile as compile_constraint
from model.hf.common import HFImportError
from model.hf.tokenizer_classes import picked_class
from tests.hf_directories import CORPUS, SPM_CORPUS, bert_directory, strings
from tests.hf_tokenizers import byte_level_bpe, load, sentencepiece_bpe, unigram, with_tool, write_directory

transformers = pytest.importorskip("transformers")

TEXTS = [*strings(), *CORPUS[:4], *SPM_CORPUS[:7], "", " ", "\n", "  lead", "trail  ", "a\n\nb", " \n x",
         "multiple   spaces   here", "\t\ttab", "ĀĂ ǅ ﬁ Ω ẞ", "😀😀 é", "12345 apples, year 2026", "3.14159",
         "range(10) 10", "<s> hi </s>", "x<unk>y", "<|im_start|>user hi<|im_end|>", "a <|tool|> b", "x<|tool|>y",
         "<|endoftext|>"]
BOS = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
BOS_EOS = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B </s>",
                                        special_tokens=[("<s>", 1), ("</s>", 2)])


# name: (tokenizer.json, tokenizer_config.json, config.json's model_type)
LAYOUTS = {
    "llama2-legacy": (lambda: with_tool(sentencepiece_bpe(legacy=True), BOS),
                      {"tokenizer_class": "LlamaTokenizer", "legacy": False}, "llama"),
    "llama2-legacy-true": (lambda: sentencepiece_bpe(legacy=True), {"tokenizer_class": "LlamaTokenizer",
                                                                    "legacy": True}, "llama"),
    "llama-metaspace": (lambda: with_tool(sentencepiece_bpe(legacy=False), BOS_EOS),
                        {"tokenizer_class": "LlamaTokenizerFast"}, "llama"),
    "llama-no-prefix": (lambda: sentencepiece_bpe(legacy=False, prefix=False),
                        {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False}, "llama"),
    "mistral": (lambda: with_tool(sentencepiece_bpe(legacy=True), BOS), {"tokenizer_class": "LlamaTokenizer"},
                "mistral"),
    "phi3": (lambda: sentencepiece_bpe(legacy=True), {"tokenizer_class": "LlamaTokenizer"}, "phi3"),
    "gemma3": (lambda: with_tool(sentencepiece_bpe(legacy=True, prefix=False), BOS),
               {"tokenizer_class": "GemmaTokenizer"}, "gemma3_text"),
    "smollm2": (lambda: with_tool(byte_level_bpe(digits=True)), {"tokenizer_class": "GPT2Tokenizer"}, "llama"),
    "qwen2.5": (lambda: with_tool(byte_level_bpe(qwen=True)), {"tokenizer_class": "Qwen2Tokenizer"}, "qwen2"),
    "qwen2.5-declared-fast": (lambda: byte_level_bpe(qwen=True), {"tokenizer_class": "PreTrainedTokenizerFast"},
                              "qwen2"),
    "qwen3-undeclared": (lambda: byte_level_bpe(qwen=True), {}, "qwen3"),
    "llama3": (lambda: with_tool(byte_level_bpe(), processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 401)])),
        {"tokenizer_class": "PreTrainedTokenizerFast"}, "llama"),
    "llama3-declared-llama": (lambda: byte_level_bpe(), {"tokenizer_class": "LlamaTokenizer"}, "llama"),
    "unigram": (unigram, {"tokenizer_class": "PreTrainedTokenizerFast"}, "llama"),
}


def assert_equal_to_transformers(directory: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer = load(directory)
    hf, settings = (json.loads((directory / name).read_text()) for name in ("config.json", "tokenizer_config.json"))
    assert picked_class(hf, settings, json.loads((directory / "tokenizer.json").read_text())) == \
        type(theirs).__name__
    want = [theirs(t, split_special_tokens=True)["input_ids"] for t in TEXTS]
    assert tokenizer.encode_templated(TEXTS) == want
    for ids in [theirs(t)["input_ids"] for t in TEXTS]:  # special ids inside too
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ids_and_text_equal_transformers(tmp_path, layout):
    build, settings, model_type = LAYOUTS[layout]
    assert_equal_to_transformers(write_directory(tmp_path / layout, build(), settings, model_type))


@pytest.mark.parametrize("add_bos, add_eos", [(True, False), (False, True), (True, True), (False, False)])
@pytest.mark.parametrize("template", [None, BOS])
def test_add_bos_and_eos_settings_as_transformers(tmp_path, add_bos, add_eos, template):
    """transformers 5 drops tokenizer_config.json's add_bos_token / add_eos_token beside a tokenizer.json: the file's
    template decides, for the classes that keep the file's pipeline and for those that rebuild it."""
    for cls, model_type in (("LlamaTokenizer", "llama"), ("PreTrainedTokenizerFast", "mistral")):
        backend = sentencepiece_bpe(legacy=True)
        backend.post_processor = template
        directory = write_directory(tmp_path / f"{cls}-{model_type}", backend, {
            "tokenizer_class": cls, "add_bos_token": add_bos, "add_eos_token": add_eos}, model_type)
        assert_equal_to_transformers(directory)


@pytest.mark.parametrize("declared, lower", [("BertTokenizer", False), ("BertTokenizerFast", True), (None, True)])
def test_bert_class_rebuilds_as_transformers(tmp_path, declared, lower):
    """BertTokenizer builds its normalizer from tokenizer_config.json's do_lower_case, not from the file."""
    directory = bert_directory(tmp_path / "bert", head=False)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings.pop("tokenizer_class", None)
    settings |= {"do_lower_case": lower} | ({"tokenizer_class": declared} if declared else {})
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    assert_equal_to_transformers(directory)


@pytest.mark.parametrize("build, settings, named", [
    (unigram, {"tokenizer_class": "LlamaTokenizer"}, "LlamaTokenizer rebuilds a BPE tokenizer"),
    (lambda: sentencepiece_bpe(legacy=True), {"tokenizer_class": "PegasusTokenizer"},
     "tokenizer_class='PegasusTokenizer'"),
    (lambda: Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0")), {},
     "model type 'Tiktoken' is not one"),
    (byte_level_bpe, {"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}, "auto_map names"),
])
def test_what_transformers_would_load_differently_is_refused_by_name(tmp_path, build, settings, named):
    directory = write_directory(tmp_path / "refused", build(), settings, "llama")
    if "Tiktoken" in named:  # a model the tokenizers library does not have
        data = json.loads((directory / "tokenizer.json").read_text())
        (directory / "tokenizer.json").write_text(json.dumps({**data, "model": {"type": "Tiktoken"}}))
    with pytest.raises(HFImportError, match=named):
        load(directory)


@pytest.mark.parametrize("layout", ["qwen2.5", "llama3", "smollm2", "llama2-legacy"])
def test_byte_level_layouts_take_grammar_constraints(tmp_path, layout):
    """Byte-level BPE with any pre-tokenizer (Qwen2's split and NFC, Llama 3's) is what llguidance reads; a
    SentencePiece-BPE is refused by name."""
    build, settings, model_type = LAYOUTS[layout]
    tokenizer = load(write_directory(tmp_path / layout, build(), settings, model_type))
    choice = Constraint("choice", ["déjà vu 日本語", "print('hello')"])
    if layout == "llama2-legacy":
        with pytest.raises(ConstraintError, match="needs a byte-level BPE tokenizer"):
            compile_constraint(choice, tokenizer)
        return
    compiled = compile_constraint(choice, tokenizer)
    assert compiled.accepts(tokenizer.encode("déjà vu 日本語")) and compiled.accepts(tokenizer.encode("print('hello')"))
    assert not compiled.accepts(tokenizer.encode("déjà vu"))
