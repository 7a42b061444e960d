"""A Hugging Face directory's ``tokenizer.json`` as our Tokenizer, with the model's own special ids.

Byte-level BPE only for now (GPT-2's layout); WordPiece (BERT) and SentencePiece (Marian) tokenizers are
refused with a message that says so. Nothing but tokenizer.json is read (no pickle, no vocab.txt merges).
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from model.config import TransformerConfig
from model.hf.common import HFImportError
from model.tokenizer import SpecialIds, Tokenizer, TokenizerError

TOKENIZER_FILE = "tokenizer.json"
MAX_TOKENIZER_BYTES = 64 << 20  # GPT-2's is 1.4 MB; multilingual vocabularies reach ~20 MB


def load_tokenizer(directory: Path, config: TransformerConfig) -> Tokenizer:
    """``directory``'s tokenizer.json with the special ids of ``config`` (pad, bos, eos)."""
    path = directory / TOKENIZER_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKENIZER_BYTES + 1)
    except OSError as exc:
        raise HFImportError(f"{TOKENIZER_FILE}: cannot read it ({exc.strerror or exc}); a Hugging Face model "
                            "directory needs its tokenizer.json beside config.json") from None
    if len(raw) > MAX_TOKENIZER_BYTES:
        raise HFImportError(f"{TOKENIZER_FILE}: over {MAX_TOKENIZER_BYTES} bytes")
    try:
        backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception for bad JSON or schema
        raise HFImportError(f"{TOKENIZER_FILE}: not a tokenizers file: {str(exc)[:200]}") from None
    specials = SpecialIds(pad=config.pad_id, bos=getattr(config, "bos_id", config.pad_id),
                          eos=getattr(config, "eos_id", config.pad_id))
    try:
        tokenizer = Tokenizer(backend, specials)
    except TokenizerError as exc:
        raise HFImportError(f"{TOKENIZER_FILE}: {exc}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise HFImportError(f"{TOKENIZER_FILE}: {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                            f"{config.vocab_size}")
    return tokenizer
