"""OPUS-MT tokenizer files read as `transformers`' MarianTokenizer reads them (model/hf/marian_tokenizer.py).

SentencePiece models trained by tests/hf_directories.py (one per side), vocab.json laid out as OPUS-MT's (</s> 0,
<unk> 1, the pieces, <pad> last, a language code), then ids and decoded texts compared with MarianTokenizer on a few
hundred strings: accents, CJK, emoji, whitespace runs, pieces the vocabulary lacks.
"""

from __future__ import annotations

import itertools
import random

import pytest

from model.hf.common import HFImportError
from model.hf.marian_tokenizer import load_marian_tokenizers
from tests.hf_directories import opus_mt_tokenizer, strings

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("separate_vocabs", [False, True], ids=["shared", "separate"])
def test_ids_and_texts_equal_marian_tokenizers(tmp_path, separate_vocabs):
    directory = opus_mt_tokenizer(tmp_path / "opus", separate_vocabs)
    files = {"source_spm": directory / "source.spm", "target_spm": directory / "target.spm",
             "vocab": directory / "vocab.json"}
    if separate_vocabs:
        files["target_vocab_file"] = directory / "target_vocab.json"
    theirs = transformers.MarianTokenizer(**{k: str(v) for k, v in files.items()}, separate_vocabs=separate_vocabs)
    source, target = load_marian_tokenizers(directory)
    texts = [*strings(), ">>es<< hello world", ">>xx<< not a code we know", ""]
    assert [theirs(t)["input_ids"] for t in texts] == source.encode_templated(texts)
    unknown = source.unk_id
    assert any(unknown in ids for ids in source.encode_templated(texts))  # the vocabulary lacks some pieces
    known = sorted(target._pieces)
    for ids in itertools.islice((random.Random(seed).choices(known, k=12) for seed in range(200)), 200):
        assert target.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids
        assert target.decode(ids, skip_special_tokens=False) == theirs.decode(ids), ids


def test_missing_or_broken_files_are_named(tmp_path):
    directory = opus_mt_tokenizer(tmp_path / "opus")
    (directory / "target.spm").write_bytes(b"not a protobuf")
    with pytest.raises(HFImportError, match="target.spm: not a SentencePiece model"):
        load_marian_tokenizers(directory)
    (directory / "vocab.json").unlink()
    with pytest.raises(HFImportError, match="vocab.json: cannot read it"):
        load_marian_tokenizers(directory)
