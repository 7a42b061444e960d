"""The translators' and T5's tokenizer directories as `transformers` and the hub lay them out, over SentencePiece models
trained here (nothing downloaded): NLLB-200 and mBART-50 (sentencepiece.bpe.model), M2M100 (sentencepiece.bpe.model
and vocab.json), T5 (spiece.model with T5's <pad> </s> <unk> ids). ``layout="json"``: the tokenizer transformers
builds from the SentencePiece files, written by save_pretrained (tokenizer.json); ``layout="spm"``: the
SentencePiece files and a tokenizer_config.json as the hub's (transformers 4) directories have them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import sentencepiece

from tests.hf_directories import CORPUS, SPM_CORPUS, strings, transformers

NLLB_LANGUAGES = ["eng_Latn", "fra_Latn", "deu_Latn", "zho_Hans", "ace_Arab"]  # a few of the 202, as a fine-tune lists
MBART50_LANGUAGES = ["en_XX", "fr_XX", "de_DE", "zh_CN"]
M2M100_LANGUAGES = ["en", "de", "zh", "ja"]  # in both of M2M100Tokenizer's sets (m2m100, wmt21)
EXTRA_TEXTS = ["", " ", "  leading and trailing  ", "a\tb\nc", "ＦＵＬＬ ｗｉｄｔｈ", "ﬁne ligature", "…!?", "e\u0301",
               "x" * 60, "日本語のテキスト。", "Grüße   aus\u3000Köln", "%s {name} $1", "the file . is ok , don 't ?",
               "it 's , they 're ' here ' !"]


def texts(count: int = 240) -> list[str]:
    """Short strings with accents, CJK, emoji, punctuation, whitespace runs and the empty string."""
    return strings(count) + EXTRA_TEXTS


def train(model_type: str, t5: bool = False) -> bytes:
    """A tiny SentencePiece model (``t5``: T5's ids, <pad> 0, </s> 1, <unk> 2 and no <s>)."""
    ids = {"pad_id": 0, "eos_id": 1, "unk_id": 2, "bos_id": -1} if t5 else {}
    model = io.BytesIO()
    corpus = SPM_CORPUS + CORPUS + strings(400)  # enough words for a few hundred merges
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=model, vocab_size=300,
                                             model_type=model_type, character_coverage=0.995, hard_vocab_limit=False,
                                             minloglevel=2, **ids)
    return model.getvalue()


def _write(directory: Path, files: dict[str, bytes], settings: dict, model_type: str) -> Path:
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return directory


def _special(content: str) -> dict:
    return {"content": content, "lstrip": content == "<mask>", "normalized": content == "<mask>", "rstrip": False,
            "single_word": False, "special": True}


def _saved(directory: Path, cls: str, model_type: str) -> Path:
    """The tokenizer transformers builds from ``directory``'s files, written by save_pretrained beside config.json."""
    out = directory.with_name(directory.name + "-saved")
    getattr(transformers, cls).from_pretrained(directory).save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


def nllb(directory: Path, layout: str, legacy: bool = False, declared_ids: bool = True) -> Path:
    """NLLB-200: sentencepiece.bpe.model (BPE) and a tokenizer_config.json listing a few language codes
    (``declared_ids``: with transformers 4's added_tokens_decoder, codes then <mask> after the pieces)."""
    proto = train("bpe")
    size = sentencepiece.SentencePieceProcessor(model_proto=proto).get_piece_size() + 1  # <pad> added by fairseq
    added = ["<s>", "<pad>", "</s>", "<unk>"]
    declared = {str(i): _special(t) for i, t in enumerate(added)}
    declared |= {str(size + i): _special(t) for i, t in enumerate([*NLLB_LANGUAGES, "<mask>"])}
    settings = {"tokenizer_class": "NllbTokenizer", "additional_special_tokens": NLLB_LANGUAGES,
                "legacy_behaviour": legacy, "src_lang": "fra_Latn", "tgt_lang": None, "bos_token": "<s>",
                "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "sep_token": "</s>",
                "cls_token": "<s>", "mask_token": "<mask>"}
    if declared_ids:
        settings["added_tokens_decoder"] = declared
    spm = _write(directory, {"sentencepiece.bpe.model": proto}, settings, "m2m_100")
    return spm if layout == "spm" else _saved(spm, "NllbTokenizer", "m2m_100")


def mbart50(directory: Path, layout: str) -> Path:
    """mBART-50: sentencepiece.bpe.model (Unigram) and tokenizer_config.json as mbart-large-50's."""
    settings = {"tokenizer_class": "MBart50Tokenizer", "src_lang": "de_DE", "tgt_lang": None}
    spm = _write(directory, {"sentencepiece.bpe.model": train("unigram")}, settings, "mbart")
    return spm if layout == "spm" else _saved(spm, "MBart50Tokenizer", "mbart")


def t5(directory: Path, layout: str, extra_ids: int = 100) -> Path:
    """T5: spiece.model (Unigram, <pad> </s> <unk> at 0..2) with ``extra_ids`` sentinels."""
    settings = {"tokenizer_class": "T5Tokenizer", "extra_ids": extra_ids, "eos_token": "</s>", "unk_token": "<unk>",
                "pad_token": "<pad>", "additional_special_tokens": [f"<extra_id_{i}>" for i in range(extra_ids)]}
    spm = _write(directory, {"spiece.model": train("unigram", t5=True)}, settings, "t5")
    return spm if layout == "spm" else _saved(spm, "T5Tokenizer", "t5")


def m2m100(directory: Path, language_codes: str = "m2m100") -> Path:
    """M2M100: sentencepiece.bpe.model (BPE), vocab.json in fairseq's order (<s> <pad> </s> <unk>, then the pieces,
    every seventh left out so that some are <unk>), written by M2M100Tokenizer.save_pretrained; tokenizer_config.json
    lists the language tokens as additional_special_tokens, as the hub's does."""
    proto = train("bpe")
    spm = sentencepiece.SentencePieceProcessor(model_proto=proto)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(3, spm.get_piece_size()):
        if i % 7:
            vocab.setdefault(spm.id_to_piece(i), len(vocab))
    source = directory.with_name(directory.name + "-files")
    source.mkdir(parents=True)
    (source / "sentencepiece.bpe.model").write_bytes(proto)
    (source / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = transformers.M2M100Tokenizer(vocab_file=str(source / "vocab.json"),
                                             spm_file=str(source / "sentencepiece.bpe.model"), src_lang="de",
                                             language_codes=language_codes)
    tokenizer.save_pretrained(directory)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["additional_special_tokens"] = list(tokenizer.lang_code_to_token.values())
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    (directory / "config.json").write_text(json.dumps({"model_type": "m2m_100"}))
    return directory


def cleaning_up(directory: Path) -> Path:
    """``directory`` with clean_up_tokenization_spaces set in its tokenizer_config.json (as transformers 4 wrote it)."""
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "clean_up_tokenization_spaces": True}))
    return directory
