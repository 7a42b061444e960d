"""tokenizer_config.json's clean_up_tokenization_spaces (model/hf/cleanup.py) for every tokenizer kind we load.

A WordPiece (BertTokenizer), a byte-level BPE (RobertaTokenizer: transformers skips the clean-up over a BPE unless
clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output) and a SentencePiece Unigram
(XLMRobertaTokenizer), with the flag unset, off, on and forced: decode and decode_batch equal transformers' decode
(special tokens skipped or kept) on punctuated texts and on random runs of punctuation and contraction pieces. Streamed
text (model.detokenize) stays a prefix of the whole where the clean-up removes spaces a later token decides (" n" of
" n't"), which it would not without the clean-up's held tokens.
"""

from __future__ import annotations

import random

import pytest

from model.detokenize import IncrementalDecoder
from model.hf.cleanup import FORCE_BPE, CleanedUpTokenizer
from tests.hf_tokenizers import load, roberta_bpe, sentencepiece_unigram, wordpiece, write_directory
from tests.model.test_hf_tokenizer_encoders import BERT, ROBERTA

transformers = pytest.importorskip("transformers")

# kind: (tokenizer.json, tokenizer_config.json, config.json's model_type)
KINDS = {"wordpiece": (lambda: wordpiece(lowercase=True, strip_accents=None), BERT, "bert"),
         "byte-level-bpe": (roberta_bpe, ROBERTA, "roberta"),
         "sentencepiece": (sentencepiece_unigram, ROBERTA, "xlm-roberta")}
FLAGS = {"unset": {}, "off": {"clean_up_tokenization_spaces": False}, "on": {"clean_up_tokenization_spaces": True},
         "forced": {"clean_up_tokenization_spaces": True, FORCE_BPE: True}}
TEXTS = ["I don't know , it 's fine .", "hello . world , again ! is it ?", "it ' s , they 're ' here ' !",
         "we 've seen it ; I 'm here", "do n't , ca n't , won 't", "print('hello') , x . y", " , . ' '", ""]
PIECES = {".", ",", "?", "!", "'", "n", "t", "s", "m", "v", "e", "r", "ve", "re", "", "the"}  # markers stripped
CLEANED = {"unset": False, "off": False, "on": True, "forced": True}  # over a BPE: only "forced"


def directory_of(tmp_path_factory, kind: str, flag: str):
    build, settings, model_type = KINDS[kind]
    return write_directory(tmp_path_factory.mktemp(f"{kind}-{flag}") / "t", build(), {**settings, **FLAGS[flag]},
                           model_type)


def sequences(theirs) -> list[list[int]]:
    """The texts' ids (with the template's special tokens) and 300 random runs of 1-12 ids, mostly punctuation and
    contraction pieces."""
    rng = random.Random(0)
    vocab = theirs.backend_tokenizer.get_vocab()
    pieces = [i for t, i in vocab.items() if t.lstrip("#▁Ġ") in PIECES]
    runs = [[rng.choice(pieces) if rng.random() < 0.8 else rng.randrange(len(vocab)) for _ in range(rng.randint(1, 12))]
            for _ in range(300)]
    return [theirs(t)["input_ids"] for t in TEXTS] + runs


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("kind", KINDS)
def test_decode_cleans_up_as_transformers(tmp_path_factory, kind, flag):
    directory = directory_of(tmp_path_factory, kind, flag)
    theirs, ours = transformers.AutoTokenizer.from_pretrained(directory), load(directory)
    cleaned = CLEANED[flag] and (kind != "byte-level-bpe" or flag == "forced")
    assert isinstance(ours, CleanedUpTokenizer) == cleaned
    seqs = sequences(theirs)
    for skip in (True, False):
        want = [theirs.decode(ids, skip_special_tokens=skip) for ids in seqs]
        assert [ours.decode(ids, skip_special_tokens=skip) for ids in seqs] == want, (kind, flag, skip)
        assert ours.decode_batch(seqs, skip_special_tokens=skip) == want
    raw = [ours.backend.decode(ids) for ids in seqs]
    assert (raw != [ours.decode(ids) for ids in seqs]) == cleaned  # the clean-up changes some texts here


@pytest.mark.parametrize("kind", ["wordpiece", "sentencepiece"])
def test_streamed_text_stays_a_prefix_of_the_cleaned_up_whole(tmp_path_factory, kind):
    directory = directory_of(tmp_path_factory, kind, "on")
    theirs, ours = transformers.AutoTokenizer.from_pretrained(directory), load(directory)
    broken = 0
    for ids in sequences(theirs):
        whole = ours.decode(ids)
        for held, check in ((ours.held_ids, True), ((), False)):
            stream, text = IncrementalDecoder(ours.decode, (), held), ""
            for token in ids:
                text += stream.push(token)
                if check:
                    assert whole.startswith(text), (ids, text, whole)
                elif not whole.startswith(text):
                    broken += 1
                    break
    assert broken  # without the clean-up's held tokens, some streamed text is not
