"""Imported tokenizer.json files encode as `transformers` does (model/hf/tokenizer.py): GPT-2's byte-level BPE
prompts, BERT's WordPiece texts and pairs (ids and token types), on 300 strings with accents, CJK, emoji and
whitespace runs (the directories come from tests/hf_directories.py's builders)."""

from __future__ import annotations

import pytest

from model.checkpoint import load_checkpoint
from tests.hf_directories import bert_directory, gpt2_directory, strings

transformers = pytest.importorskip("transformers")


def test_gpt2_prompts_equal_transformers(tmp_path):
    directory = gpt2_directory(tmp_path / "gpt2")
    ours, theirs = load_checkpoint(directory, device="cpu"), transformers.AutoTokenizer.from_pretrained(directory)
    texts = [*strings(), "<|endoftext|> is plain text here"]
    assert ours.encode_prompts(texts)[:-1] == [theirs(t)["input_ids"] for t in texts[:-1]]
    # A special token typed by a user stays text (the service's rule); transformers would insert the special id.
    assert theirs.eos_token_id not in ours.encode_prompts(texts)[-1]
    for ids in ours.encode_prompts(texts[:50]):
        assert ours.tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_bert_texts_and_pairs_equal_transformers(tmp_path):
    directory = bert_directory(tmp_path / "bert", head=True)
    ours, theirs = load_checkpoint(directory, device="cpu"), transformers.AutoTokenizer.from_pretrained(directory)
    texts = strings()
    for a, b in zip(texts, texts[1:] + texts[:1], strict=True):
        for pair in ((a,), (a, b)):
            want = theirs(*pair)
            assert ours.tokenizer.encode_pair(*pair) == (want["input_ids"], want["token_type_ids"]), pair
