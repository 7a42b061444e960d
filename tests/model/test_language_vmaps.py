"""Vocabulary maps per target language (model.vocab_map.LanguageMaps) on a tiny random NLLB-200 (transformers'
M2M100ForConditionalGeneration with NllbTokenizer's files): each row keeps to its own language's map (its forced
first token, or its target prefix's first token, picks it), a row whose language has no map gets the unrestricted
output, rows of several languages share a batch without changing each other's outputs, maps allowing every token
give the unrestricted outputs, bad vmaps/ contents fail the load naming the file, and `build-vmap --target-lang`
writes a map the loader reads back."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from model.checkpoint import checkpoint_vocabulary_map, load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_seq2seq
from model.vocab_map import VMAP_FILE, LanguageMaps, VocabularyMap, VocabularyMapError, language_map_path
from tests.hf_directories import opus_mt_directory
from tests.hf_seq2seq_tokenizers import m2m100, nllb
from tests.service.test_seq2seq_languages import translator
from training.cli import main as training_main

pytest.importorskip("transformers")

TEXTS = ["the quick brown fox jumps", "hello world again", "good morning to you", "open the file now"]
MAPPED = ("fra_Latn", "deu_Latn")  # the languages given a map; zho_Hans has none
NEW = 8


def write_map(directory: Path, code: str, allowed: set[int], spell) -> None:
    path = language_map_path(directory, code)
    path.parent.mkdir(exist_ok=True)
    path.write_text(VocabularyMap(frozenset(allowed), {}, copy_source=False).dump(spell, spell), encoding="utf-8")


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("language-vmaps")
    return translator(root, "nllb", "nllb", nllb(root / "nllb-tok", "json"))


@pytest.fixture(scope="module")
def mapped(nllb_dir: Path, tmp_path_factory) -> Path:
    """The model with a map for French and one for German, each a random third of the vocabulary (seeded per
    language, so the two differ)."""
    directory = tmp_path_factory.mktemp("mapped") / "nllb"
    shutil.copytree(nllb_dir, directory)
    ckpt = load_checkpoint(directory, device="cpu")
    size, spell = ckpt.tokenizer.vocab_size, ckpt.tokenizer.backend.id_to_token
    for seed, code in enumerate(MAPPED):
        write_map(directory, code, set(random.Random(seed).sample(range(size), size // 3)), spell)
    return directory


def _run(ckpt, codes: list[str | None], strategy: str, vocab_map=None, prefixed: bool = False, texts=TEXTS):
    """Best tokens of ``texts`` into ``codes`` (forced first, or with ``prefixed`` as the target prefix)."""
    tokens = [ckpt.languages.target_id(c) if c else None for c in codes]
    sources = [ckpt.languages.source_ids(ckpt.prompt_tokenizer.encode(t), "eng_Latn") for t in texts[:len(codes)]]
    config = GenerationConfig(strategy=strategy, num_beams=4 if strategy == "beam" else 1, max_new_tokens=NEW,
                              eos_token_id=ckpt.config.eos_id)
    targets = [[t] if prefixed and t is not None else [] for t in tokens] if prefixed else None
    forced = [None if prefixed else t for t in tokens]
    out = generate_seq2seq(ckpt.model, sources, config, targets=targets, vocab_map=vocab_map, forced_first=forced)
    return sources, tokens, [h[0].tokens for h in out]


@pytest.mark.parametrize("prefixed", [False, True])
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_each_row_keeps_to_its_languages_map_in_a_mixed_batch(mapped, strategy, prefixed):
    ckpt = load_checkpoint(mapped, device="cpu")
    maps = checkpoint_vocabulary_map(ckpt)
    assert isinstance(maps, LanguageMaps) and sorted(maps.codes.values()) == sorted(MAPPED)
    codes = ["fra_Latn", "deu_Latn", "zho_Hans", "fra_Latn"]
    sources, tokens, got = _run(ckpt, codes, strategy, maps, prefixed)
    _, _, plain = _run(ckpt, codes, strategy, None, prefixed)
    for i, code in enumerate(codes):
        alone = _run(ckpt, [code], strategy, maps, prefixed, texts=[TEXTS[i]])[2][0]
        allowed = maps.candidates_in(sources[i], tokens[i])
        if code in MAPPED:
            assert set(got[i]) <= set(allowed) and tokens[i] in allowed
            assert not set(allowed) >= set(maps.candidates_in(sources[i], tokens[1 - MAPPED.index(code)]))
        else:  # no map for its language: the whole vocabulary, as without any map
            assert allowed is None and got[i] == plain[i]
        assert got[i] == alone  # its batch changes nothing
    assert any(g != p for g, p in zip(got, plain, strict=True))  # the maps did restrict


def test_maps_allowing_every_token_give_the_unrestricted_outputs(nllb_dir, tmp_path):
    directory = tmp_path / "nllb"
    shutil.copytree(nllb_dir, directory)
    ckpt = load_checkpoint(directory, device="cpu")
    for code in MAPPED:
        write_map(directory, code, set(range(ckpt.tokenizer.vocab_size)), ckpt.tokenizer.backend.id_to_token)
    maps = checkpoint_vocabulary_map(load_checkpoint(directory, device="cpu"))
    for strategy in ("greedy", "beam"):
        assert _run(ckpt, list(MAPPED), strategy, maps)[2] == _run(ckpt, list(MAPPED), strategy)[2]


BAD = {
    "unknown code": ({"vmaps/xx_Latn.txt": "\t</s>\n"}, "'xx_Latn' is not a language code of this model"),
    "other name": ({"vmaps/fra_Latn.map": "\t</s>\n"}, "expected one <language code>.txt file"),
    "unknown token": ({"vmaps/fra_Latn.txt": "\t</s> no-such-token\n"},
                      "fra_Latn.txt: line 1: target token 'no-such-token'"),
    "both kinds": ({"vmaps/fra_Latn.txt": "\t</s>\n", VMAP_FILE: "\t</s>\n"}, "holds both vmap.txt and vmaps/"),
    "empty folder": ({"vmaps/": ""}, "holds no map"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_language_maps_fail_the_load_naming_the_file(nllb_dir, tmp_path, case):
    files, message = BAD[case]
    directory = tmp_path / "nllb"
    shutil.copytree(nllb_dir, directory)
    for name, text in files.items():
        if name.endswith("/"):
            (directory / name).mkdir()
        else:
            (directory / name).parent.mkdir(exist_ok=True)
            (directory / name).write_text(text, encoding="utf-8")
    with pytest.raises(VocabularyMapError, match=message):
        checkpoint_vocabulary_map(load_checkpoint(directory, device="cpu"))


def test_build_vmap_with_a_target_language_writes_that_languages_map(nllb_dir, tmp_path, capsys):
    directory = tmp_path / "nllb"
    shutil.copytree(nllb_dir, directory)
    train = tmp_path / "train.tsv"
    words = ["the", "quick", "brown", "fox", "jumps", "hello", "world", "good", "morning", "open", "file", "now"]
    rng = random.Random(0)
    train.write_text("".join(f"{' '.join(rng.sample(words, 4))}\t{' '.join(rng.sample(words, 3))}\n"
                             for _ in range(40)), encoding="utf-8")
    args = ["build-vmap", "--model", str(directory), "--train", str(train), "--per-token", "4", "--always", "8"]
    assert training_main([*args, "--target-lang", "deu_Latn"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target_lang"] == "deu_Latn" and report["vmap"].endswith("vmaps/deu_Latn.txt")
    maps = checkpoint_vocabulary_map(load_checkpoint(directory, device="cpu"))
    assert isinstance(maps, LanguageMaps) and list(maps.codes.values()) == ["deu_Latn"]
    assert 0 < report["mean_candidates"] < report["vocab_size"] / 2
    assert training_main([*args, "--target-lang", "xx_Latn"]) == 1
    assert "xx_Latn" in capsys.readouterr().err
    assert training_main(args) == 1  # vmap.txt beside vmaps/ would not load
    assert "name one with --target-lang" in capsys.readouterr().err
    test = tmp_path / "test.tsv"
    test.write_text("hello world\tgood morning\n", encoding="utf-8")
    assert training_main(["evaluate", "--model", str(directory), "--test", str(test), "--vmap"]) == 1
    assert "keeps maps per target language" in capsys.readouterr().err  # evaluate forces no language: refused


@pytest.mark.parametrize("kind", ["opus-mt", "m2m100 sentencepiece"])
def test_build_vmap_on_a_sentencepiece_translator_writes_a_map_the_loader_reads(kind, tmp_path, capsys):
    """Translators whose tokenizers are Python SentencePiece tables (OPUS-MT's two sides, M2M100's spm files), not a
    tokenizer.json: build-vmap spells the map in their pieces and the service's loader reads them back."""
    if kind == "opus-mt":
        directory = opus_mt_directory(tmp_path / "model")
    else:
        directory = translator(tmp_path, "m2m100", "m2m100", m2m100(tmp_path / "m2m100-tok"))
    train = tmp_path / "train.tsv"
    words = ["the", "quick", "brown", "fox", "jumps", "hello", "world", "good", "morning", "open", "file", "now"]
    rng = random.Random(1)
    train.write_text("".join(f"{' '.join(rng.sample(words, 4))}\t{' '.join(rng.sample(words, 3))}\n"
                             for _ in range(30)), encoding="utf-8")
    assert training_main(["build-vmap", "--model", str(directory), "--train", str(train), "--per-token", "4",
                          "--always", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    loaded = checkpoint_vocabulary_map(load_checkpoint(directory, device="cpu"))
    assert isinstance(loaded, VocabularyMap) and report["vmap"].endswith(VMAP_FILE)
    assert 0 < report["mean_candidates"] < report["vocab_size"]
