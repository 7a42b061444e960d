"""Tests for model.tokenizer: special ids, lossless round trips, placeholders, files, padding."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from model.placeholders import TOKEN_PATTERN as PLACEHOLDER_PATTERN
from model.tokenizer import (
    MAX_PIECE_BYTES,
    MAX_WORD_CHARS,
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    SpecialIds,
    Tokenizer,
    TokenizerError,
    pad_batch,
)

CORPUS = [
    "Delete %s from {name}?",
    "Copied %d files to {0} in %.2f seconds.",
    "the cat sat on the mat",
    "the dog ate the bone",
    "def add(x, y):\n    return x + y\n",
    "\tindented with a tab",
    "Hello, world! 😀 Grüße aus Köln.",
] * 8

TRICKY = [
    "",
    " ",
    "def f(x):\n    if x:\n\treturn {'a': [1, 2]}\n\n",
    "trailing spaces   \n\n\t \r\n",
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    "日本語のテキスト, 中文, 한국어",
    "combining e\u0301 vs \u00e9, RTL مرحبا, zero-width\u200bjoiner",
    "control \x00\x01\x7f and unseen ÿ ǅ 𝔘𝔫𝔦",
    "literal specials [MASK] <s></s><pad> [CLS][SEP] <unk>",
    "100% done, %s and {name} and %%",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(CORPUS, vocab_size=400)


def test_special_ids_are_fixed(tok: Tokenizer) -> None:
    ids = [tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id]
    assert ids == list(range(7))
    assert [tok.backend.token_to_id(t) for t in SPECIAL_TOKENS] == ids
    assert 7 + 256 <= tok.vocab_size <= 400


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_is_exact(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text


def test_literal_special_tokens_stay_plain_text(tok: Tokenizer) -> None:
    text = "[MASK] <s> </s> <pad> [CLS] [SEP] <unk>"
    ids = tok.encode(text)
    assert min(ids) >= len(SPECIAL_TOKENS)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_bos_eos_and_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("the cat", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "the cat"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>the cat</s>"


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    assert tok.encode_batch(TRICKY, add_eos=True) == [tok.encode(t, add_eos=True) for t in TRICKY]
    assert tok.decode_batch(tok.encode_batch(TRICKY)) == TRICKY


def test_max_token_bytes_bounds_the_tokens_a_text_needs(tok: Tokenizer) -> None:
    """The longest piece sets how many bytes a token covers: the service refuses texts by size before encoding
    them, which is exact only if no text of n bytes encodes in fewer than n / max_token_bytes tokens."""
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    assert max(len(t.encode()) for t in texts if "\ufffd" not in t) == tok.max_token_bytes  # whole characters
    for text in TRICKY + CORPUS + [p * 40 for p in PLACEHOLDER_PATTERN.findall(" ".join(CORPUS))]:
        assert len(text.encode()) <= len(tok.encode(text)) * tok.max_token_bytes


def test_decode_drops_out_of_vocab_ids(tok: Tokenizer) -> None:
    ids = tok.encode("the cat")
    assert tok.decode([*ids, tok.vocab_size + 5, -1]) == "the cat"


@pytest.mark.parametrize(
    "text",
    [
        "%s",
        "%d",
        "%i",
        "%u",
        "%f",
        "%.2f",
        "%5d",
        "%ld",
        "%lu",
        "%%",
        "%1$s",
        "%(name)s",
        "{name}",
        "{0}",
        "{}",
    ],
)
def test_placeholder_pattern_matches(text: str) -> None:
    assert PLACEHOLDER_PATTERN.fullmatch(text)


def test_placeholder_pattern_ignores_prose() -> None:
    assert PLACEHOLDER_PATTERN.findall("100% done, 5 % off, {not a placeholder}") == []


def test_placeholders_are_single_tokens(tok: Tokenizer) -> None:
    text = "Delete %s from {name}?"
    ids = tok.encode(text)
    for placeholder in ("%s", "{name}"):
        pid = tok.backend.token_to_id(placeholder)
        assert pid is not None and pid in ids
        assert tok.encode(placeholder) == [pid]
    assert tok.encode("x%sy")[1] == tok.backend.token_to_id("%s")  # never split, even inside a word
    assert tok.decode(ids) == text


def test_placeholders_can_be_disabled() -> None:
    plain = Tokenizer.train(CORPUS, vocab_size=400, keep_placeholders=False)
    assert len(plain.encode("{name}")) > 1


def test_train_is_deterministic(tok: Tokenizer) -> None:
    again = Tokenizer.train(iter(CORPUS), vocab_size=400)  # any iterable, here a one-shot iterator
    assert again.backend.to_str() == tok.backend.to_str()


def test_train_rejects_tiny_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(CORPUS, vocab_size=100)


def test_encode_pair_layout(tok: Tokenizer) -> None:
    a, b = tok.encode("the cat"), tok.encode("the dog")
    ids, segments = tok.encode_pair("the cat", "the dog")
    assert ids == [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
    assert segments == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    ids, segments = tok.encode_pair("the cat")
    assert ids == [tok.cls_id, *a, tok.sep_id] and segments == [0] * len(ids)


@pytest.mark.parametrize("target", ["dir", "nested/dir", "custom.json"])
def test_save_load_round_trip(tok: Tokenizer, tmp_path, target: str) -> None:
    path = tmp_path / target
    tok.save(path)
    file = path if target.endswith(".json") else path / TOKENIZER_FILE
    assert file.is_file()
    assert [p.name for p in file.parent.iterdir()] == [file.name]  # no temp file left behind
    loaded = Tokenizer.load(path)
    assert loaded.encode_batch(TRICKY) == tok.encode_batch(TRICKY)
    assert loaded.vocab_size == tok.vocab_size
    assert min(loaded.encode("[MASK]")) >= len(SPECIAL_TOKENS)  # protection survives reload
    tok.save(path)  # overwriting is fine and byte-identical
    assert Tokenizer.load(file).backend.to_str() == loaded.backend.to_str()


def test_load_missing_file(tmp_path) -> None:
    with pytest.raises(TokenizerError, match="not found.*nope.json"):
        Tokenizer.load(tmp_path / "nope.json")
    with pytest.raises(TokenizerError, match=TOKENIZER_FILE):
        Tokenizer.load(tmp_path)  # directory without tokenizer.json


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0"}', "", "\xff"])
def test_load_corrupt_file(tmp_path, content: str) -> None:
    file = tmp_path / TOKENIZER_FILE
    file.write_text(content, encoding="latin-1")
    with pytest.raises(TokenizerError, match=str(file)):
        Tokenizer.load(file)


def test_load_rejects_wrong_special_tokens(tmp_path) -> None:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    swapped = ["<s>", "<pad>", *SPECIAL_TOKENS[2:]]
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=swapped))
    file = tmp_path / TOKENIZER_FILE
    backend.save(str(file))
    with pytest.raises(TokenizerError, match=rf"{file}.*special tokens.*'<pad>' has id 1"):
        Tokenizer.load(file)


def test_load_rejects_non_byte_level(tok: Tokenizer, tmp_path) -> None:
    data = json.loads(tok.backend.to_str())
    data["pre_tokenizer"] = {"type": "Whitespace"}
    file = tmp_path / TOKENIZER_FILE
    file.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError, match="byte-level"):
        Tokenizer.load(file)


def test_saved_file_is_world_readable(tok: Tokenizer, tmp_path) -> None:
    tok.save(tmp_path)
    assert os.stat(tmp_path / TOKENIZER_FILE).st_mode & 0o777 == 0o644


def test_pad_batch() -> None:
    ids, lengths = pad_batch([[5, 6, 7], [8], []], pad_id=0)
    assert ids.dtype == lengths.dtype == torch.long
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert lengths.tolist() == [3, 1, 0]
    ids, lengths = pad_batch([], pad_id=0)
    assert ids.shape == (0, 0) and lengths.shape == (0,)


def test_token_strings_are_readable(tok: Tokenizer) -> None:
    ids = tok.encode("the cat sat", add_bos=True)
    pieces = tok.token_strings(ids)
    assert pieces[0] == "<s>"
    assert "".join(pieces[1:]) == "the cat sat"
    assert all("Ġ" not in p for p in pieces)
    assert tok.token_strings(tok.encode("%s")) == ["%s"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_strings([tok.vocab_size])


def test_concurrent_encode_matches_serial(tok: Tokenizer) -> None:
    texts = TRICKY * 20
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(tok.encode, texts)) == [tok.encode(t) for t in texts]


def test_without_a_decoder_token_strings_are_the_pieces(tok: Tokenizer) -> None:
    """tokenizer.json's "decoder": null: each id's piece as it is stored (transformers' convert_ids_to_tokens)."""
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    backend.decoder = None
    bare = Tokenizer(backend, SpecialIds())
    ids = bare.encode("the cat")
    assert bare.token_strings(ids) == [backend.id_to_token(i) for i in ids] and "Ġcat" in bare.token_strings(ids)


def _wordpiece(vocab: dict[str, int], max_chars: int) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=max_chars))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


def test_max_token_bytes_is_bounded_or_the_tokenizer_refused() -> None:
    """WordPiece's cost per word grows with the cube of max_input_chars_per_word, and a long piece lifts the
    byte bound before encoding: both are bounded, so max_token_bytes never exceeds MAX_PIECE_BYTES."""
    vocab = {"[UNK]": 0, "a": 1, "##a": 2}
    assert Tokenizer(_wordpiece(vocab, MAX_WORD_CHARS), SpecialIds()).max_token_bytes == 4 * MAX_WORD_CHARS
    assert 4 * MAX_WORD_CHARS <= MAX_PIECE_BYTES
    with pytest.raises(TokenizerError, match=f"max_input_chars_per_word={MAX_WORD_CHARS + 1} is over the limit"):
        Tokenizer(_wordpiece(vocab, MAX_WORD_CHARS + 1), SpecialIds())
    long = {**vocab, "b" * (MAX_PIECE_BYTES + 1): 3}
    with pytest.raises(TokenizerError, match=f"is {MAX_PIECE_BYTES + 1} bytes long, over the limit"):
        Tokenizer(_wordpiece(long, 100), SpecialIds())


def test_load_refuses_a_fifo_at_once(tmp_path) -> None:
    os.mkfifo(tmp_path / TOKENIZER_FILE)  # a blocking open would wait for a writer forever
    with pytest.raises(TokenizerError, match="a FIFO, not a regular file"):
        Tokenizer.load(tmp_path)
