"""OPUS-MT tokenizer files read as `transformers`' MarianTokenizer reads them (model/hf/marian_tokenizer.py).

SentencePiece models trained here (one per side), vocab.json laid out as OPUS-MT's (</s> 0, <unk> 1, the
pieces, <pad> last, a language code), then ids and decoded texts compared with MarianTokenizer on a few
hundred strings: accents, CJK, emoji, whitespace runs, pieces the vocabulary lacks.
"""

from __future__ import annotations

import io
import itertools
import json
import random
from pathlib import Path

import pytest
import sentencepiece

from model.hf.common import HFImportError
from model.hf.marian_tokenizer import load_marian_tokenizers

transformers = pytest.importorskip("transformers")

CORPUS = ["the file could not be opened", "no se pudo abrir el archivo", "Grüße aus Köln, déjà vu",
          "日本語のテキスト", "emoji 😀 and 👍🏽", "copy %s files into {name}", "print('hello world')"] * 30
FRAGMENTS = ["the", "file", "Köln", "déjà", "日本", "語", "😀", "👍🏽", "%s", "{name}", "  ", "\t", "zebra",
             "quartz", "ü", "e\u0301", "!", "?", "hello", "ÿǅ"]


PAD = 60  # after every piece of either side


def strings(count: int = 300) -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choice(FRAGMENTS) + rng.choice(["", " ", "  "]) for _ in range(rng.randint(1, 8)))
            for _ in range(count)]


def train_spm(text_seed: int) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS[text_seed:]), model_writer=model,
                                             vocab_size=56, character_coverage=0.98,
                                             hard_vocab_limit=False, minloglevel=2)
    return model.getvalue()


def opus_mt_tokenizer(directory: Path, separate_vocabs: bool = False) -> Path:
    """source.spm, target.spm and vocab.json (and target_vocab.json) as OPUS-MT ships them."""
    directory.mkdir(parents=True)
    sides = {"source.spm": train_spm(0), "target.spm": train_spm(3)}
    for name, proto in sides.items():
        (directory / name).write_bytes(proto)

    def vocab(proto: bytes, drop_every: int) -> dict[str, int]:
        spm = sentencepiece.SentencePieceProcessor(model_proto=proto)
        pieces = [spm.id_to_piece(i) for i in range(3, spm.get_piece_size())][::drop_every]  # some pieces missing
        ordered = {piece: i for i, piece in enumerate(dict.fromkeys(["</s>", "<unk>", ">>es<<", *pieces]))}
        fillers = {f"\u2581filler{i}": i for i in range(len(ordered), PAD)}  # ids without gaps, as OPUS-MT's
        return ordered | fillers | {"<pad>": PAD}  # one pad id for both sides, as a Marian config has one

    (directory / "vocab.json").write_text(json.dumps(vocab(sides["source.spm"], 1 if not separate_vocabs else 2)))
    config = {"separate_vocabs": separate_vocabs, "unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>"}
    if separate_vocabs:
        (directory / "target_vocab.json").write_text(json.dumps(vocab(sides["target.spm"], 1)))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


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
