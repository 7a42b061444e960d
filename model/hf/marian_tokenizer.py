"""OPUS-MT's tokenizer files (source.spm, target.spm, vocab.json) as `transformers`' MarianTokenizer reads them.

A text is split into SentencePiece pieces by source.spm (a leading ``>>xx<<`` language code is one token), the
pieces are looked up in vocab.json (``<unk>`` for a piece it lacks: Marian's vocabulary is not the
SentencePiece model's) and ``</s>`` is appended. Outputs are decoded with target.spm over the target
vocabulary (``target_vocab.json`` when tokenizer_config.json says ``separate_vocabs``). The .spm files are
SentencePiece protobufs and the vocabularies JSON: nothing is unpickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sentencepiece

from model.hf.common import HFImportError, read_json
from model.hf.languages import token_text
from model.hf.spm_vocab import SPIECE_UNDERLINE, PieceTable, read_spm, read_vocab

SOURCE_SPM, TARGET_SPM, VOCAB, TARGET_VOCAB = "source.spm", "target.spm", "vocab.json", "target_vocab.json"
CONFIG = "tokenizer_config.json"
MARIAN_FILES = (SOURCE_SPM, TARGET_SPM, VOCAB, TARGET_VOCAB, CONFIG)  # everything this module reads
MAX_FILE_BYTES = 16 << 20  # OPUS-MT's vocab.json is ~1.5 MB, each .spm ~0.8 MB; JSON parses to ~10x its size
HINT = f"an OPUS-MT directory needs {SOURCE_SPM}, {TARGET_SPM} and {VOCAB}"
MAX_UNKNOWN_BYTES = 4  # a character neither vocabulary knows is one <unk>: at most 4 UTF-8 bytes


class MarianSideTokenizer(PieceTable):
    """One side of an OPUS-MT tokenizer (source: encodes; target: decodes), with our Tokenizer's interface."""

    uses_own_template = True  # inputs are pieces + </s>, as tokenizer(text) gives them in transformers
    bos_id = cls_id = sep_id = mask_id = None
    sentinels = 0  # no placeholder sentinels (model.placeholders): its outputs' placeholders are checked only

    def __init__(self, spm: sentencepiece.SentencePieceProcessor, vocab: dict[str, int], tokens: dict[str, str]
                 ) -> None:
        self._spm = spm
        self._vocab = vocab
        self._pieces = {i: piece for piece, i in vocab.items()}
        self.unk_id, self.eos_id, self.pad_id = (self._special(vocab, tokens, role) for role in ("unk", "eos", "pad"))
        self._specials = frozenset(i for i in (self.unk_id, self.eos_id, self.pad_id) if i is not None)
        self.max_token_bytes = max(MAX_UNKNOWN_BYTES, *(len(piece.encode("utf-8")) for piece in vocab))

    @staticmethod
    def _special(vocab: dict[str, int], tokens: dict[str, str], role: str) -> int:
        text = tokens[role]
        if text not in vocab:
            raise HFImportError(f"{VOCAB}: the {role} token {text!r} is not in the vocabulary")
        return vocab[text]

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text``'s pieces (``add_eos``: then ``</s>``; there is no start token)."""
        if add_bos:
            raise ValueError("an OPUS-MT tokenizer has no start token")
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # a target-language code: one token
            code, text = [self._vocab.get(text[: end + 2], self.unk_id)], text[end + 2 :]
        ids = code + [self._vocab.get(p, self.unk_id) for p in self._spm.encode(text, out_type=str)]
        return ids + [self.eos_id] * add_eos

    def encode_templated(self, texts: Sequence[str]) -> list[list[int]]:
        """What MarianTokenizer's ``tokenizer(text)`` gives: the pieces' ids, then ``</s>``."""
        return self.encode_batch(texts, add_eos=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` as MarianTokenizer decodes it (special tokens between pieces kept when not skipped)."""
        out = "".join(self._spm.decode_pieces(run) + (f"{special} " if special is not None else "")
                      for run, special in self._segments(ids, skip_special_tokens))
        return out.replace(SPIECE_UNDERLINE, " ").strip()


def is_marian_tokenizer(directory: Path) -> bool:
    return (directory / SOURCE_SPM).is_file()


def load_marian_tokenizers(directory: Path) -> tuple[MarianSideTokenizer, MarianSideTokenizer]:
    """(source side, target side) of ``directory``'s OPUS-MT tokenizer."""
    config = read_json(directory / CONFIG, MAX_FILE_BYTES) if (directory / CONFIG).is_file() else {}
    tokens = {role: token_text(config.get(f"{role}_token")) or default
              for role, default in (("unk", "<unk>"), ("eos", "</s>"), ("pad", "<pad>"))}
    vocab = read_vocab(directory / VOCAB, MAX_FILE_BYTES, HINT)
    separate = config.get("separate_vocabs")
    target_vocab = read_vocab(directory / TARGET_VOCAB, MAX_FILE_BYTES, HINT) if separate else vocab
    return (MarianSideTokenizer(read_spm(directory / SOURCE_SPM, MAX_FILE_BYTES, HINT), vocab, tokens),
            MarianSideTokenizer(read_spm(directory / TARGET_SPM, MAX_FILE_BYTES, HINT), target_vocab, tokens))
