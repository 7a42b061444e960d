"""What OPUS-MT's and M2M100's tokenizers share: a SentencePiece model whose pieces are looked up in a vocabulary
JSON (model/hf/marian_tokenizer.py, model/hf/m2m100_tokenizer.py). The files are a protobuf and JSON: nothing is
unpickled."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import sentencepiece

from model.hf.common import HFImportError, read_bytes, read_json
from model.tokenizer import MAX_PIECE_BYTES

SPIECE_UNDERLINE = "\u2581"


def read_spm(path: Path, limit: int, hint: str) -> sentencepiece.SentencePieceProcessor:
    """The SentencePiece model at ``path`` (at most ``limit`` bytes); HFImportError when it is not one."""
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(read_bytes(path, limit, hint))
    except (RuntimeError, OSError, ValueError) as exc:
        raise HFImportError(f"{path.name}: not a SentencePiece model: {str(exc)[:200]}") from None
    return processor


def read_vocab(path: Path, limit: int, hint: str) -> dict[str, int]:
    """A piece -> id vocabulary JSON: distinct non-negative ids, every piece within the service's byte bound (a
    longer one would let the bound checked before encoding bound nothing)."""
    vocab = read_json(path, limit, hint=hint)
    ids = list(vocab.values())
    if not vocab or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) \
            or len(set(ids)) != len(ids):
        raise HFImportError(f"{path.name}: expected distinct non-negative integer ids")
    longest = max(vocab, key=lambda piece: len(piece.encode("utf-8")))
    if len(longest.encode("utf-8")) > MAX_PIECE_BYTES:
        raise HFImportError(f"{path.name}: the piece {longest[:40]!r}... is {len(longest.encode('utf-8'))} bytes long, "
                            f"over the limit of {MAX_PIECE_BYTES}")
    return vocab


class PieceTable:
    """Our Tokenizer's batch and inspection methods over ``_pieces`` (id -> piece) and ``encode`` / ``decode``."""

    _pieces: dict[int, str]
    _specials: frozenset[int]

    @property
    def vocab_size(self) -> int:
        return max(self._pieces) + 1

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary piece ``token`` (None where there is none), as `tokenizers.Tokenizer`'s."""
        return self._piece_ids.get(token)

    def id_to_token(self, i: int) -> str | None:
        """The piece of id ``i`` (None where there is none), as `tokenizers.Tokenizer`'s."""
        return self._pieces.get(i)

    @functools.cached_property
    def _piece_ids(self) -> dict[str, int]:
        return {piece: i for i, piece in self._pieces.items()}

    def _segments(self, ids: Sequence[int], skip_special_tokens: bool) -> list[tuple[list[str], str | None]]:
        """``ids``' pieces cut at the special tokens kept: (the run of other pieces before one, its piece), the last
        run with None; ids outside the vocabulary, and the special ones when skipped, are left out. What the
        tokenizers' ``decode`` joins, each in its library's way."""
        segments, run = [], []
        for i in map(int, ids):
            piece = self._pieces.get(i)
            if piece is None or (skip_special_tokens and i in self._specials):
                continue
            if i in self._specials:
                segments.append((run, piece))
                run = []
            else:
                run.append(piece)
        segments.append((run, None))
        return segments

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        return [self.encode(t, add_bos, add_eos) for t in texts]

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in seqs]

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Readable piece per id (the SentencePiece word mark shown as a space)."""
        pieces = []
        for i in map(int, ids):
            if i not in self._pieces:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            pieces.append(self._pieces[i].replace(SPIECE_UNDERLINE, " "))
        return pieces

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError
