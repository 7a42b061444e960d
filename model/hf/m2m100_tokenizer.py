"""M2M100's tokenizer files (sentencepiece.bpe.model, vocab.json) as `transformers`' M2M100Tokenizer reads them.

M2M100Tokenizer is a Python (sentencepiece) class in transformers 5, with no tokenizer.json form: a text is split
into pieces by the SentencePiece model, the pieces are looked up in vocab.json (``<unk>`` for a piece it lacks), and
the language tokens ``__en__`` ... follow the vocabulary (ids ``len(vocab.json) + i`` in the order of its
``language_codes`` set). ``tokenizer(text)`` gives ``__src_lang__ pieces </s>``. Decoding joins the pieces with
SentencePiece and strips the result (then cleans it up where tokenizer_config.json asks: model.hf.cleanup); special
tokens (the named ones and the language tokens) are dropped with ``skip_special_tokens``, as a hub directory's
tokenizer_config.json (listing the language tokens as additional_special_tokens) makes transformers do. The files
are a protobuf and JSON: nothing is unpickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece

from model.hf.cleanup import clean_up_tokenization, cleans_up
from model.hf.common import HFImportError
from model.hf.languages import Languages, language_tokens, read_languages, token_text
from model.hf.spm_vocab import PieceTable, read_spm, read_vocab

SPM, VOCAB = "sentencepiece.bpe.model", "vocab.json"
M2M100_FILES = (SPM, VOCAB)
MAX_FILE_BYTES = 32 << 20  # M2M100's vocab.json is ~2.7 MB, its SentencePiece model ~2.4 MB
MAX_UNKNOWN_BYTES = 4  # a character the vocabulary lacks is one <unk>: at most 4 UTF-8 bytes
ROLES = {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>"}  # M2M100Tokenizer's defaults


class M2M100SpmTokenizer(PieceTable):
    """M2M100Tokenizer with our Tokenizer's interface (encodes and decodes: source and target share it)."""

    uses_own_template = True  # inputs are __src__ pieces </s>, as tokenizer(text) gives them in transformers
    cls_id = sep_id = mask_id = None
    sentinels = 0  # no placeholder sentinels (model.placeholders)

    def __init__(self, spm: sentencepiece.SentencePieceProcessor, vocab: dict[str, int], settings: dict[str, Any]
                 ) -> None:
        self._spm = spm
        self._vocab = vocab
        tokens = {role: token_text(settings.get(f"{role}_token")) or default for role, default in ROLES.items()}
        for role, text in tokens.items():
            if text not in vocab:
                raise HFImportError(f"{VOCAB}: the {role} token {text!r} is not in the vocabulary")
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = (vocab[tokens[role]] for role in ROLES)
        languages = language_tokens("M2M100Tokenizer", settings) or {}
        self._pieces = {i: piece for piece, i in vocab.items()}
        self._pieces |= {len(vocab) + i: token for i, token in enumerate(languages.values())}  # after vocab.json
        self.languages: Languages = read_languages("M2M100Tokenizer", settings, self.token_to_id, self.eos_id)
        self._specials = frozenset({self.bos_id, self.eos_id, self.unk_id, self.pad_id, *self.languages.ids.values()})
        self.max_token_bytes = max(MAX_UNKNOWN_BYTES, *(len(piece.encode("utf-8")) for piece in vocab))
        self._clean_up = cleans_up(settings, bpe=False)  # a Python class: whatever the SentencePiece model

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text``'s pieces (optionally wrapped in ``<s>`` ... ``</s>``)."""
        ids = [self._vocab.get(piece, self.unk_id) for piece in self._spm.encode(text, out_type=str)]
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def encode_templated(self, texts: Sequence[str]) -> list[list[int]]:
        """What M2M100Tokenizer's ``tokenizer(text)`` gives: ``__src_lang__`` (tokenizer_config.json's), the pieces'
        ids, ``</s>``."""
        return [self.languages.source_ids(self.encode(t)) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` as M2M100Tokenizer decodes it (ids outside the vocabulary are dropped)."""
        text = "".join(self._spm.decode(run) + (special if special is not None else "")
                       for run, special in self._segments(ids, skip_special_tokens)).strip()
        return clean_up_tokenization(text) if self._clean_up else text


def load_m2m100_tokenizer(directory: Path, settings: dict[str, Any]) -> M2M100SpmTokenizer:
    """``directory``'s M2M100Tokenizer (``settings``: its tokenizer_config.json)."""
    hint = f"an M2M100 directory needs {SPM} and {VOCAB}"
    if settings.get("sp_model_kwargs"):  # sampling (enable_sampling, alpha): not what a served model should do
        raise HFImportError(f"tokenizer_config.json: sp_model_kwargs={settings['sp_model_kwargs']!r} is not supported "
                            "(only the SentencePiece model's own settings)")
    vocab = read_vocab(directory / VOCAB, MAX_FILE_BYTES, hint)
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise HFImportError(f"{VOCAB}: expected the ids 0..n-1, each once (the language tokens follow them)")
    return M2M100SpmTokenizer(read_spm(directory / SPM, MAX_FILE_BYTES, hint), vocab, settings)
