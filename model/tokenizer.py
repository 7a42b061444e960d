"""Byte-level BPE tokenizer: a thin wrapper over the HF `tokenizers` library.

Checkpoints store the native ``tokenizer.json`` (no pickle). Invariants, checked on every load: ours
hold the seven ``SPECIAL_TOKENS`` at ids 0..6 in order (training relies on ``Tokenizer.pad_id == 0``);
an imported one (model.hf: a Hugging Face GPT-2 ``tokenizer.json``) brings its own ``SpecialIds``, and
model code reads the ids from the model config, never from this class.

Special tokens in user text: a literal "[MASK]" or "<s>" inside a string is encoded as ordinary
bytes, never as the special id (``encode_special_tokens = True`` on the backend), so untrusted
input cannot forge control tokens. Special ids only enter a sequence through ``add_bos``,
``add_eos``, ``encode_pair`` and an imported tokenizer's own template (``encode_templated``). That
flag is runtime state and is not written to tokenizer.json, so a Hugging Face export of ``backend``
keeps the library's default matching behaviour.

Thread safety: encode/decode on a `tokenizers.Tokenizer` are safe to call from several threads;
this wrapper never mutates its backend after ``__init__``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from model.files import UnreadableFile, read_regular
from model.placeholders import MAX_SENTINELS, TOKEN_PATTERN, sentinel

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_FILE = "tokenizer.json"
MAX_PLACEHOLDERS = 200  # most frequent placeholders kept as single tokens
# What a tokenizer may claim, so that ``max_token_bytes`` (the service's byte bound before encoding) bounds the
# work: a vocabulary piece covers at most MAX_PIECE_BYTES (real ones: tens of bytes), and WordPiece's
# max_input_chars_per_word is at most MAX_WORD_CHARS (BERT's is 100). WordPiece tries every prefix of every
# remaining suffix, so a word costs ~chars**3: a 1,000-char word takes 40 ms, 8,000 take 8 s.
MAX_PIECE_BYTES = 1024
MAX_WORD_CHARS = 200
# tokenizer.json's size: at most 64 MiB, and at most 1 MiB + 256 bytes per id of the model's vocabulary (GPT-2's
# is 27 bytes per id, XLM-R's ~70): parsing peaks at ~16x the file, so a file too large is refused before that.
MAX_TOKENIZER_BYTES = 64 << 20
TOKENIZER_BYTES_PER_ID = 256
_BYTE_ALPHABET = 256  # ByteLevel initial alphabet: every byte is always a token
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece byte-fallback piece, as ByteFallback reads it


class TokenizerError(ValueError):
    """A tokenizer file is missing or unreadable, not byte-level BPE, or has the wrong special tokens."""


@dataclass(frozen=True)
class SpecialIds:
    """The ids of an imported tokenizer's special tokens (None where it has no such token)."""

    pad: int | None = None
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None


@dataclass(frozen=True)
class TokenSpans:
    """One encoded text (or window of it): per token its id, piece (the vocabulary's string), character offsets
    into the text ((0, 0) for a template token) and whether it is special (added by the template)."""

    ids: list[int]
    pieces: list[str]
    offsets: list[tuple[int, int]]
    special: list[bool]

    def take(self, positions: Sequence[int]) -> TokenSpans:
        """The tokens at ``positions``."""
        return TokenSpans(*([column[i] for i in positions] for column in (self.ids, self.pieces, self.offsets,
                                                                          self.special)))


class Tokenizer:
    """Ours: byte-level BPE with the project's special tokens at ids 0..6. Or an imported Hugging Face
    tokenizer.json (GPT-2's byte-level BPE, BERT's WordPiece, ...) with its special ids given: it encodes
    inputs by its own template (``uses_own_template``), as ``tokenizer(text)`` does in `transformers`."""

    # Ours: fixed by SPECIAL_TOKENS and verified in __init__; an imported tokenizer sets its own.
    pad_id: int | None = 0
    bos_id: int | None = 1
    eos_id: int | None = 2
    unk_id: int | None = 3
    cls_id: int | None = 4
    sep_id: int | None = 5
    mask_id: int | None = 6

    def __init__(self, backend: tokenizers.Tokenizer, specials: SpecialIds | None = None) -> None:
        """Wrap ``backend``; raises TokenizerError unless it is byte-level BPE with our specials (or, with
        ``specials``, an imported tokenizer with those ids inside its vocabulary)."""
        if specials is None:
            _check_byte_level(backend)
            _check_special_tokens(backend)
        else:
            self._use_specials(backend, specials)
        self.uses_own_template = specials is not None
        backend.encode_special_tokens = True  # literal "[MASK]" in text stays plain text
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self._max_token_bytes = _max_token_bytes(backend, added.values())

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        min_frequency: int = 2,
        keep_placeholders: bool = True,
    ) -> Tokenizer:
        """Train on ``texts``; the result has at most ``vocab_size`` tokens, placeholders included.

        ``texts`` is materialised once (placeholder counting and BPE need two passes).
        Placeholders seen at least ``min_frequency`` times become non-special added tokens.
        """
        floor = len(SPECIAL_TOKENS) + _BYTE_ALPHABET
        if vocab_size < floor:
            raise ValueError(f"vocab_size must be >= {floor} (specials + 256 bytes), got {vocab_size}")
        start = time.perf_counter()
        texts = list(texts)
        placeholders: list[str] = []
        if keep_placeholders:
            limit = min(MAX_PLACEHOLDERS, vocab_size - floor)
            placeholders = _frequent_placeholders(texts, min_frequency, limit)

        backend = tokenizers.Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - len(placeholders),  # leave room for the placeholders
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
        # normalized=False: matched on the raw text, before byte-level pre-tokenization.
        backend.add_tokens([AddedToken(p, special=False, normalized=False) for p in placeholders])
        logger.info(
            "trained tokenizer: %d tokens (%d placeholders) on %d texts in %.2fs",
            backend.get_vocab_size(),
            len(placeholders),
            len(texts),
            time.perf_counter() - start,
        )
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path, max_bytes: int | None = None) -> Tokenizer:
        """Load a tokenizer.json file, or a directory containing one (a regular file of at most ``max_bytes``,
        MAX_TOKENIZER_BYTES by default: see ``file_limit``)."""
        file = _resolve_file(Path(path))
        try:
            text = read_regular(file, MAX_TOKENIZER_BYTES if max_bytes is None else max_bytes).decode("utf-8")
        except FileNotFoundError:
            raise TokenizerError(f"tokenizer file not found: {file}") from None
        except UnreadableFile as e:
            raise TokenizerError(f"{file}: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read tokenizer file {file}: {e}") from e
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON or schema
            raise TokenizerError(f"invalid tokenizer file {file}: {e}") from e
        try:
            tokenizer = cls(backend)
        except TokenizerError as e:
            raise TokenizerError(f"{file}: {e}") from None
        logger.debug("loaded tokenizer from %s (%d tokens)", file, tokenizer.vocab_size)
        return tokenizer

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json atomically; ``path`` is a ``*.json`` file or a directory."""
        path = Path(path)
        file = path if path.suffix == ".json" and not path.is_dir() else path / TOKENIZER_FILE
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self._backend.to_str(pretty=True))
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp creates 0600
            os.replace(tmp, file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        logger.debug("saved tokenizer to %s", file)

    def _use_specials(self, backend: tokenizers.Tokenizer, specials: SpecialIds) -> None:
        size = backend.get_vocab_size(with_added_tokens=True)
        for name, value in vars(specials).items():
            if value is not None and not 0 <= value < size:
                raise TokenizerError(f"the {name} token id {value} is outside the vocabulary (size {size})")
            setattr(self, f"{name}_id", value)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary token ``token`` (None where there is none)."""
        return self._backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary token of id ``i`` (None where there is none)."""
        return self._backend.id_to_token(i)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (for export to Hugging Face)."""
        return self._backend

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token covers: a length bound known before encoding. Byte-level BPE
        without a normalizer is lossless, so there a text of n bytes needs at least n / max_token_bytes tokens;
        a tokenizer that drops text (WordPiece's whitespace) can fit more, and the bound is then a size cap."""
        return self._max_token_bytes

    @functools.cached_property
    def sentinels(self) -> int:
        """How many placeholder sentinels (model.placeholders: ``｟0｠``, ``｟1｠``, ...) are single tokens here: a
        translation model trained on protected pairs has them; any other tokenizer none."""
        count = 0
        while count < MAX_SENTINELS and self._backend.token_to_id(sentinel(count)) is not None:
            count += 1
        return count

    @functools.cached_property
    def held_ids(self) -> frozenset[int]:
        """Ids after which a stream of text waits for the next token (model.detokenize): with a ByteFallback decoder
        (SentencePiece's), the <0xXX> byte pieces, since a run of them decodes as a whole, and the special tokens
        decode skips, since a run joins across them; none for other decoders."""
        decoder = self._backend.decoder
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        pieces = {i for piece, i in self._backend.get_vocab(with_added_tokens=False).items()
                  if _BYTE_PIECE.fullmatch(piece)}
        return frozenset(pieces | {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special})

    @property
    def vocab_size(self) -> int:
        """Number of ids, special and added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally wrapped in <s> ... </s>."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return self._wrap(ids, add_bos, add_eos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        """``encode`` over many texts (parallel in Rust)."""
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, add_bos, add_eos) for e in encodings]

    def encode_templated(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` over many texts with the special tokens the tokenizer's own template adds (Hugging Face's
        ``tokenizer(text)``)."""
        return [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=True)]

    def encode_pair(self, text_a: str, text_b: str | None = None) -> tuple[list[int], list[int]]:
        """BERT layout ``[CLS] a [SEP] (b [SEP])`` (an imported tokenizer's own pair template); returns
        ``(ids, segment_ids)``, segment 1 for b."""
        if self.uses_own_template:
            encoding = self._backend.encode(text_a, text_b, add_special_tokens=True)
            return encoding.ids, encoding.type_ids
        ids = [self.cls_id, *self.encode(text_a), self.sep_id]
        segments = [0] * len(ids)
        if text_b is not None:
            b = [*self.encode(text_b), self.sep_id]
            ids += b
            segments += [1] * len(b)
        return ids, segments

    def encode_windows(self, text: str, max_length: int | None = None, stride: int = 0) -> list[TokenSpans]:
        """``text`` by the tokenizer's own template, with each token's piece, character offsets into ``text`` and
        special-token flag, as ``tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)``
        gives them. With ``max_length``: windows of at most that many tokens, the template's tokens included, each
        repeating the last ``stride`` text tokens of the one before (``truncation=True,
        return_overflowing_tokens=True, stride=stride``); ValueError where ``stride`` leaves no room."""
        encoding = self._backend.encode(text, add_special_tokens=True)  # offsets trimmed once, on the whole text
        spans = TokenSpans(encoding.ids, encoding.tokens, encoding.offsets,
                           [bool(s) for s in encoding.special_tokens_mask])
        inside = [i for i, s in enumerate(encoding.sequence_ids) if s is not None]  # the text's tokens
        if max_length is None or not inside:
            return [spans]
        first, last = inside[0], inside[-1] + 1
        room = max_length - (len(spans.ids) - (last - first))  # text tokens per window
        if not 0 <= stride < room:
            raise ValueError(f"stride must be >= 0 and below max_length minus the template's tokens ({room}), "
                             f"got {stride}")
        windows, start = [], first
        while True:  # Encoding.truncate's windows, each wrapped in the template's tokens
            end = min(start + room, last)
            windows.append(spans.take([*range(first), *range(start, end), *range(last, len(spans.ids))]))
            if end == last:
                return windows
            start = end - stride

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary (e.g. padded embedding rows) are dropped."""
        return self._backend.decode(self._valid(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """``decode`` over many sequences."""
        return self._backend.decode_batch(
            [self._valid(ids) for ids in seqs], skip_special_tokens=skip_special_tokens
        )

    @property
    def byte_level(self) -> bool:
        """Whether this is byte-level BPE, whose ByteLevel decoder maps every piece to its bytes whatever the
        pre-tokenizer and normalizer (ours, GPT-2's, Qwen's, Llama 3's): what grammar libraries can read."""
        return isinstance(self._backend.model, models.BPE) and isinstance(self._backend.decoder, decoders.ByteLevel)

    def backend_json(self) -> str:
        """The tokenizer.json text of the backend (what other libraries load)."""
        return self._backend.to_str()

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Readable piece per id ('Ġthe' -> ' the'); a partial UTF-8 character shows as '\ufffd'."""
        pieces = []
        for i in map(int, ids):
            token = self._backend.id_to_token(i) if i >= 0 else None
            if token is None:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            # Added tokens (specials, placeholders) are stored as raw text, not byte-level; without a decoder
            # (tokenizer.json's "decoder": null) a piece is its text, as convert_ids_to_tokens gives it.
            decoder = self._backend.decoder
            pieces.append(token if i in self._added_ids or decoder is None else decoder.decode([token]))
        return pieces

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def _valid(self, ids: Sequence[int]) -> list[int]:
        size = self.vocab_size
        return [i for i in map(int, ids) if 0 <= i < size]


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``seqs``; returns ``(ids (B, T), lengths (B,))``, both int64."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # (B,)
    max_len = int(lengths.max()) if len(seqs) else 0
    ids = torch.full((len(seqs), max_len), pad_id, dtype=torch.long)  # (B, T)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return ids, lengths


def _frequent_placeholders(texts: Iterable[str], min_frequency: int, limit: int) -> list[str]:
    """Placeholders seen at least ``min_frequency`` times, most frequent first (ties by text)."""
    counts = Counter(m for text in texts for m in TOKEN_PATTERN.findall(text))
    ranked = sorted((p for p, n in counts.items() if n >= min_frequency), key=lambda p: (-counts[p], p))
    return ranked[:limit]


def file_limit(vocab_size: int) -> int:
    """The most bytes a tokenizer.json for a model of ``vocab_size`` ids may hold (see MAX_TOKENIZER_BYTES)."""
    return min(MAX_TOKENIZER_BYTES, (1 << 20) + TOKENIZER_BYTES_PER_ID * max(vocab_size, 0))


def _max_token_bytes(backend: tokenizers.Tokenizer, added: Iterable[AddedToken]) -> int:
    """The most UTF-8 bytes one token of ``backend`` covers (see ``Tokenizer.max_token_bytes``); TokenizerError
    naming a piece over MAX_PIECE_BYTES or a WordPiece max_input_chars_per_word over MAX_WORD_CHARS."""
    vocabulary = list(backend.get_vocab(with_added_tokens=False))
    pieces = [*vocabulary, *(token.content for token in added)]  # added tokens are raw text
    # byte-level pieces are one character per byte; elsewhere a prefix such as "##" or "▁" only loosens the bound
    byte_level = isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel)
    sizes = [len(piece) if byte_level and i < len(vocabulary) else len(piece.encode("utf-8"))
             for i, piece in enumerate(pieces)]
    longest = max(sizes, default=0)
    if longest > MAX_PIECE_BYTES:
        piece = pieces[sizes.index(longest)]
        raise TokenizerError(f"the piece {piece[:40]!r}{'...' if len(piece) > 40 else ''} is {longest} bytes long, "
                             f"over the limit of {MAX_PIECE_BYTES}")
    if isinstance(backend.model, models.WordPiece):  # a longer word is one [UNK]
        chars = backend.model.max_input_chars_per_word
        if chars > MAX_WORD_CHARS:
            raise TokenizerError(f"model.max_input_chars_per_word={chars} is over the limit of {MAX_WORD_CHARS} "
                                 "(WordPiece's cost grows with its cube)")
        longest = max(longest, 4 * chars)
    return longest


def _check_byte_level(backend: tokenizers.Tokenizer) -> None:
    """Raise TokenizerError unless ``backend`` is the lossless byte-level BPE layout built by train."""
    if not (
        isinstance(backend.model, models.BPE)
        and backend.normalizer is None  # any normalizer would break decode(encode(x)) == x
        and isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel)
        and isinstance(backend.decoder, decoders.ByteLevel)
    ):
        raise TokenizerError(
            "expected a byte-level BPE tokenizer (BPE model, no normalizer, ByteLevel pre-tokenizer and "
            f"decoder); got model={type(backend.model).__name__}, "
            f"normalizer={type(backend.normalizer).__name__}, "
            f"pre_tokenizer={type(backend.pre_tokenizer).__name__}, decoder={type(backend.decoder).__name__}"
        )


def _check_special_tokens(backend: tokenizers.Tokenizer) -> None:
    """Raise TokenizerError unless SPECIAL_TOKENS are special added tokens with ids 0..6."""
    added = backend.get_added_tokens_decoder()
    for expected_id, name in enumerate(SPECIAL_TOKENS):
        actual_id = backend.token_to_id(name)
        if actual_id != expected_id or not added.get(expected_id, AddedToken("")).special:
            found = [backend.id_to_token(i) for i in range(len(SPECIAL_TOKENS))]
            raise TokenizerError(
                f"special tokens must be {list(SPECIAL_TOKENS)} at ids 0..{len(SPECIAL_TOKENS) - 1}; "
                f"found {found} ({name!r} has id {actual_id})"
            )


def _resolve_file(path: Path) -> Path:
    return path / TOKENIZER_FILE if path.is_dir() else path
