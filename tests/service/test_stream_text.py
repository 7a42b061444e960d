"""Streamed text (service/engine/jobs.py StreamText over model/detokenize.py): each event's text continues a prefix of
the finished text, and the events add up to it, for the tokenizers the Llama family ships (byte-level BPE, Qwen2's,
SentencePiece-BPE with byte fallback with and without Strip, as transformers builds them) and Unigram and OPUS-MT's,
on random token sequences (broken UTF-8 and byte-fallback runs, special tokens inside) and on real text, after a
target prefix or not, with stop strings; and each token decodes a short window, not the whole sequence."""

from __future__ import annotations

import random

import pytest

from model.generation import trim_stop
from model.hf.marian_tokenizer import load_marian_tokenizers
from model.search import Hypothesis
from service.engine.jobs import StreamText
from tests.hf_directories import opus_mt_tokenizer
from tests.hf_tokenizers import byte_level_bpe, load, sentencepiece_bpe, unigram, with_tool, write_directory

TEXTS = ["hello world  déjà 日本語 😀👍🏽 x", "the  file\n\n could not be opened", " 12 ab  ",
         "Grüße aus Köln 👍🏽👍🏽", "print('hello')\n    return x + y"]
# name: (tokenizer.json, tokenizer_config.json, model_type), loaded as model.hf loads them
LAYOUTS = {
    "byte-level": (byte_level_bpe, {"tokenizer_class": "GPT2Tokenizer"}, "llama"),
    "qwen2": (lambda: byte_level_bpe(qwen=True), {}, "qwen2"),
    "llama2": (lambda: with_tool(sentencepiece_bpe(legacy=True)), {"tokenizer_class": "LlamaTokenizer"}, "llama"),
    "mistral": (lambda: with_tool(sentencepiece_bpe(legacy=False)), {"tokenizer_class": "PreTrainedTokenizerFast"},
                "mistral"),
    "gemma3": (lambda: sentencepiece_bpe(legacy=True, prefix=False), {}, "gemma3_text"),
    "unigram": (unigram, {}, "llama"),
}


@pytest.fixture(scope="module", params=[*LAYOUTS, "opus-mt"])
def tokenizer(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "opus-mt":
        return load_marian_tokenizers(opus_mt_tokenizer(directory / "marian"))[1]
    build, settings, model_type = LAYOUTS[request.param]
    return load(write_directory(directory / "tokenizer", build(), settings, model_type))


def sequences(tokenizer, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prefix, tokens): random ids (any byte piece or special token, broken UTF-8 too) and real texts' ids."""
    rng = random.Random(seed)
    size = tokenizer.vocab_size
    found = []
    for i in range(count):
        prefix = [rng.randrange(size) for _ in range(rng.choice([0, 0, 1, 3]))]
        if i % 2:
            tokens = [rng.randrange(size) for _ in range(rng.randint(1, 40))]
        else:
            tokens = tokenizer.encode(rng.choice(TEXTS) + rng.choice(TEXTS))[: rng.randint(1, 60)]
        found.append((prefix, tokens))
    return found


def streamed(tokenizer, prefix: list[int], tokens: list[int], stops: list[str]) -> tuple[str, str]:
    """(events' text joined, the finished text), asserting that every event continues a prefix of the finished text."""
    stream = StreamText.of(tokenizer, stops, prefix=prefix)
    final, _ = stream.final_text(tokens)
    joined = ""
    for token in tokens:
        joined += stream.feed(token).text
        assert final.startswith(joined), (prefix, tokens, joined, final)
    joined += stream.finish(Hypothesis(tokens=tokens, score=0.0, logprob=0.0, finish_reason="length")).text
    return joined, final


def test_events_add_up_to_the_decoded_text(tokenizer):
    for prefix, tokens in sequences(tokenizer, 300, seed=0):
        joined, final = streamed(tokenizer, prefix, tokens, [])
        assert joined == final


def test_stop_strings_cut_the_stream_as_they_cut_the_finished_text(tokenizer):
    rng = random.Random(1)
    for prefix, tokens in sequences(tokenizer, 200, seed=2):
        text = tokenizer.decode(tokens)
        at = rng.randrange(len(text) + 1)
        stops = [text[at: at + rng.randint(1, 4)] or "zz", text[at + 1: at + 2] or "y", "never there"]
        joined, final = streamed(tokenizer, prefix, tokens, stops)
        assert joined == final == trim_stop(final, stops)


def test_each_token_decodes_a_short_window(tokenizer):
    """O(window) per token: no decode while streaming reads more than a few dozen tokens of a 600-token output."""
    tokens = tokenizer.encode(" ".join(TEXTS * 40))[:600]
    windows = []

    def decode(ids, skip_special_tokens=True):
        windows.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens)

    stream = StreamText(decode, ["never there"], held=getattr(tokenizer, "held_ids", ()))
    text = "".join(stream.feed(token).text for token in tokens)
    assert len(tokens) == 600 and tokenizer.decode(tokens).startswith(text)
    assert max(windows) <= 32, max(windows)


@pytest.mark.parametrize("layout, byte_pieces", [("byte-level", 0), ("llama2", 256)])
def test_byte_fallback_pieces_and_specials_wait(tmp_path, layout, byte_pieces):
    build, settings, model_type = LAYOUTS[layout]
    tokenizer = load(write_directory(tmp_path / layout, build(), settings, model_type))
    specials = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    assert tokenizer.held_ids == (frozenset(range(3, 259)) | specials if byte_pieces else frozenset())
