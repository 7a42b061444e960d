"""The seq2seq translators' and T5's tokenizers from their SentencePiece files, as `transformers` 5 builds them.

NllbTokenizer, MBart50Tokenizer and T5Tokenizer are `tokenizers`-backed in transformers 5: given a tokenizer.json they
rebuild its pipeline (model.hf.tokenizer_classes); given only the SentencePiece model (sentencepiece.bpe.model,
spiece.model) they convert it first, which :func:`spm_tokenizer_json` reproduces: NLLB a BPE over the pieces with
``<s> <pad> </s> <unk>`` at 0..3 (the fairseq offset: piece i >= 3 gets id i + 1) and merges ordered by the merged
piece's id; mBART-50 a Unigram in the same order followed by its 52 language codes and ``<mask>``; T5 a Unigram over
the pieces as they are, then the sentinels ``<extra_id_N>`` from the last down to 0. Added tokens follow in the
order transformers adds them: tokenizer_config.json's added_tokens_decoder by id, the named special tokens, then the
extra ones (NLLB's language codes). The .model files are protobufs read by :func:`read_spm` (nothing unpickled).
:func:`load_languages` gives the language codes of NLLB's, M2M100's and mBART-50's (model.hf.languages); where
tokenizer_config.json asks for clean_up_tokenization_spaces, decoded text is cleaned up as transformers does
(model.hf.cleanup: T5's and mBART-50's Unigram, not NLLB's BPE).
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import sentencepiece
import tokenizers

from model.config import TransformerConfig
from model.hf.cleanup import tokenizer_class
from model.hf.common import HFImportError, read_bytes, read_config, read_json
from model.hf.languages import MBART50_CODES, NAMED_TOKENS, Languages, read_languages, token_text
from model.hf.m2m100_tokenizer import M2M100_FILES, M2M100SpmTokenizer, load_m2m100_tokenizer
from model.hf.tokenizer import MAX_TOKEN_FILE_BYTES, TOKENIZER_FILE, _special_ids, load_tokenizer
from model.hf.tokenizer_classes import pipeline
from model.tokenizer import Tokenizer, TokenizerError, file_limit

CONFIG = "tokenizer_config.json"
SPM_FILES = {"NllbTokenizer": "sentencepiece.bpe.model", "MBart50Tokenizer": "sentencepiece.bpe.model",
             "T5Tokenizer": "spiece.model"}
SEQ2SEQ_FILES = (*dict.fromkeys(SPM_FILES.values()), *M2M100_FILES)  # everything this module reads besides CONFIG
REGISTERED = {"m2m_100": "M2M100Tokenizer", "t5": "T5Tokenizer", "mt5": "T5Tokenizer"}  # without a declared class
DEFAULTS = {  # each class's named special tokens (tokenizer_config.json's win)
    "NllbTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
                      "pad_token": "<pad>", "cls_token": "<s>", "mask_token": "<mask>"},
    "MBart50Tokenizer": {"eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>", "pad_token": "<pad>",
                         "cls_token": "<s>", "mask_token": "<mask>"},
    "T5Tokenizer": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}}
MAX_EXTRA_IDS = 10_000  # T5's sentinels: 100 in every released model
CONTROL, USER_DEFINED = 3, 4  # SentencePiece piece types transformers adds as (special / plain) added tokens


def seq2seq_class(directory: Path, settings: dict[str, Any]) -> str | None:
    """The seq2seq tokenizer class transformers picks for ``directory`` (None: not one of this module's)."""
    declared = settings.get("tokenizer_class") or read_config(directory).get("tokenizer_class")
    if not isinstance(declared, str):
        declared = REGISTERED.get(read_config(directory).get("model_type"))
    cls = declared.removesuffix("Fast") if isinstance(declared, str) else None
    return cls if cls in SPM_FILES or cls == "M2M100Tokenizer" else None


def load_seq2seq_tokenizer(directory: Path, config: TransformerConfig) -> Tokenizer | M2M100SpmTokenizer | None:
    """``directory``'s tokenizer where transformers picks one of this module's classes (None otherwise): M2M100's from
    its SentencePiece model and vocab.json; NLLB's, mBART-50's and T5's from tokenizer.json (model.hf.tokenizer, with
    the class's pipeline), or without one from the SentencePiece model, as transformers converts it."""
    settings = read_settings(directory)
    cls = seq2seq_class(directory, settings)
    if cls == "M2M100Tokenizer":
        return load_m2m100_tokenizer(directory, settings)
    if cls is None:
        return None
    if (directory / TOKENIZER_FILE).is_file() or not (directory / SPM_FILES[cls]).is_file():
        return load_tokenizer(directory, config)
    proto = read_bytes(directory / SPM_FILES[cls], file_limit(config.vocab_size), f"{cls} reads {SPM_FILES[cls]}")
    data = pipeline(spm_tokenizer_json(cls, read_spm(proto, SPM_FILES[cls]), settings), cls, settings)
    backend = tokenizers.Tokenizer.from_str(json.dumps(data))
    try:
        return tokenizer_class(settings, backend)(backend, _special_ids(directory, backend, config))
    except TokenizerError as exc:
        raise HFImportError(f"{SPM_FILES[cls]}: {exc}") from None


def load_languages(directory: Path, tokenizer: Tokenizer | M2M100SpmTokenizer) -> Languages | None:
    """The language codes of ``directory``'s tokenizer (as loaded by :func:`load_seq2seq_tokenizer`); None for a
    tokenizer without languages (T5's, and every other class)."""
    if isinstance(tokenizer, M2M100SpmTokenizer):
        return tokenizer.languages
    settings = read_settings(directory)
    cls = seq2seq_class(directory, settings)
    if cls is None or tokenizer.eos_id is None:
        return None
    return read_languages(cls, settings, tokenizer.token_to_id, tokenizer.eos_id)


def read_settings(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json (empty where the directory has none)."""
    path = directory / CONFIG
    return read_json(path, MAX_TOKEN_FILE_BYTES) if path.is_file() else {}


def spm_tokenizer_json(cls: str, spm: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer.json transformers' ``cls`` builds from SentencePiece model ``spm`` (:func:`read_spm`) before its
    own pipeline (model.hf.tokenizer_classes) replaces the normalizer, pre-tokenizer, decoder and template."""
    named = {key: token_text(settings.get(key)) or default for key, default in DEFAULTS[cls].items()}
    pieces = [(piece, score) for piece, score, _ in spm["pieces"]]
    if cls == "NllbTokenizer":
        merges = generate_merges({piece: i for i, (piece, _) in enumerate(pieces)})
        vocab = {named[key]: i for i, key in enumerate(("bos_token", "pad_token", "eos_token", "unk_token"))}
        for piece, _ in pieces:
            vocab.setdefault(piece, len(vocab))
        model = {"type": "BPE", "vocab": vocab, "merges": [list(m) for m in merges]}
    else:
        if cls == "MBart50Tokenizer":
            head = [(named[key], 0.0) for key in ("cls_token", "pad_token", "eos_token", "unk_token")]
            pieces = [*head, *pieces[3:], *((code, 0.0) for code in MBART50_CODES), (named["mask_token"], 0.0)]
        else:
            pieces += [(f"<extra_id_{i}>", 0.0) for i in range(_extra_ids(settings) - 1, -1, -1)]
        model = {"type": "Unigram", "unk_id": spm["unk_id"], "vocab": [list(p) for p in pieces]}
        vocab = {piece: i for i, (piece, _) in reversed(list(enumerate(pieces)))}  # the first of a repeated piece
    charsmap = spm["charsmap"]
    normalizer = {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode()} \
        if charsmap else None
    return {"version": "1.0", "truncation": None, "padding": None, "normalizer": normalizer, "pre_tokenizer": None,
            "post_processor": None, "decoder": None, "model": model,
            "added_tokens": _added_tokens(cls, spm, settings, named, vocab)}


def _added_tokens(cls: str, spm: dict[str, Any], settings: dict[str, Any], named: dict[str, str],
                  vocab: dict[str, int]) -> list[dict[str, Any]]:
    """The added tokens in the order transformers adds them, each at its vocabulary id or the next free one."""
    declared = settings.get("added_tokens_decoder") if isinstance(settings.get("added_tokens_decoder"), dict) else {}
    order = [(token_text(t), bool(t.get("special", True))) for _, t in
             sorted(((int(i), t) for i, t in declared.items() if str(i).isdigit() and isinstance(t, dict)),
                    key=lambda it: it[0])]
    order += [(named[key], True) for key in NAMED_TOKENS if key in named]
    extra = settings.get("extra_special_tokens")
    extra = settings.get("additional_special_tokens") if extra is None else extra
    if not isinstance(extra, list):  # the SentencePiece model's own control and user-defined pieces
        extra = [piece for piece, _, kind in spm["pieces"] if kind in (CONTROL, USER_DEFINED)]
    order += [(token_text(t), True) for t in extra]
    if cls == "MBart50Tokenizer":
        order += [(code, True) for code in MBART50_CODES]
    elif cls == "T5Tokenizer":
        order += [(f"<extra_id_{i}>", True) for i in range(_extra_ids(settings))]
    added: dict[str, dict[str, Any]] = {}
    next_id = len(vocab)
    for content, special in order:
        if not content or content in added:
            continue
        token_id = vocab.get(content)
        if token_id is None:
            token_id, next_id = next_id, next_id + 1
        added[content] = {"id": token_id, "content": content, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": not special, "special": special}
    return list(added.values())


def _extra_ids(settings: dict[str, Any]) -> int:
    """T5Tokenizer's number of sentinels (tokenizer_config.json's extra_ids, 100 by default)."""
    count = settings.get("extra_ids", 100)
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_EXTRA_IDS:
        raise HFImportError(f"{CONFIG}: extra_ids={count!r} must be an integer from 0 to {MAX_EXTRA_IDS}")
    return count


def generate_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """transformers' generate_merges without scores: every split of a piece into two pieces, ordered by the merged
    piece's id (then the left piece's length, then the right's), ties within a piece by the parts' ids."""
    merges = []
    for merge, piece_id in vocab.items():
        local = [(merge[:i], merge[i:], piece_id) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])))
    return [(left, right) for left, right, _ in merges]


def read_spm(proto: bytes, name: str) -> dict[str, Any]:
    """A SentencePiece model's pieces ((piece, score, type)), unk id and normalizer charsmap, read from its protobuf
    (ModelProto: pieces = 1 {piece = 1, score = 2, type = 3}, trainer_spec = 2 {unk_id = 40}, normalizer_spec = 3
    {precompiled_charsmap = 2}); the file is first checked by sentencepiece itself."""
    try:
        sentencepiece.SentencePieceProcessor().LoadFromSerializedProto(proto)
        fields = _fields(proto)
        pieces = []
        for raw in fields.get(1, []):
            piece = _fields(raw)
            pieces.append((piece[1][0].decode("utf-8"), struct.unpack("<f", piece[2][0])[0] if 2 in piece else 0.0,
                           piece[3][0] if 3 in piece else 1))
        trainer = _fields(fields[2][0]) if 2 in fields else {}
        normalizer = _fields(fields[3][0]) if 3 in fields else {}
    except (RuntimeError, ValueError, KeyError, IndexError, struct.error) as exc:
        raise HFImportError(f"{name}: not a SentencePiece model: {str(exc)[:200]}") from None
    return {"pieces": pieces, "unk_id": trainer.get(40, [0])[0], "charsmap": normalizer.get(2, [b""])[0]}


def _fields(data: bytes) -> dict[int, list[Any]]:
    """A protobuf message's fields: number -> values (varints as int, fixed32 as 4 bytes, strings as bytes)."""
    fields: dict[int, list[Any]] = {}
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at:at + size], at + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, at = data[at:at + width], at + width
        else:
            raise ValueError(f"protobuf wire type {wire}")
        fields.setdefault(number, []).append(value)
    return fields


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at

