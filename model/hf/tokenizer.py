"""A Hugging Face directory's ``tokenizer.json`` as our Tokenizer, with the model's own special tokens.

Any `tokenizers` file (GPT-2's and Qwen's byte-level BPE, Llama 2's / Mistral's / Gemma's SentencePiece-converted
BPE with byte fallback, BERT's WordPiece, Unigram), with the pipeline of the class `transformers.AutoTokenizer`
would pick for the directory (model.hf.tokenizer_classes: LlamaTokenizer, for one, replaces the file's normalizer
and pre-tokenizer by its own). It encodes inputs by the file's own template (post-processor), as ``tokenizer(text)``
does in `transformers` 5, which ignores tokenizer_config.json's add_bos_token / add_eos_token beside a
tokenizer.json. Decoded text is cleaned up where tokenizer_config.json's clean_up_tokenization_spaces asks, as the
class does (model.hf.cleanup). Special tokens: the ids config.json names (pad, bos, eos) win; the others come from
tokenizer_config.json / special_tokens_map.json by their text. Only JSON is read (no pickle, no sentencepiece
model files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from model.config import TransformerConfig
from model.hf.cleanup import tokenizer_class
from model.hf.common import HFImportError, read_bytes, read_config, read_json
from model.hf.tokenizer_classes import picked_class, pipeline
from model.tokenizer import SpecialIds, Tokenizer, TokenizerError, file_limit

TOKENIZER_FILE = "tokenizer.json"
TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # the first that names a token wins
TOKENIZER_FILES = (TOKENIZER_FILE, *TOKEN_FILES)  # everything this module reads
MAX_TOKEN_FILE_BYTES = 1 << 20
MODELS = ("BPE", "Unigram", "WordPiece", "WordLevel")  # tokenizer.json's model types (the `tokenizers` library's)
ROLES = ("pad", "bos", "eos", "unk", "cls", "sep", "mask")


def load_tokenizer(directory: Path, config: TransformerConfig) -> Tokenizer:
    """``directory``'s tokenizer.json with its special ids (see the module docstring); its size is bounded by the
    model's vocabulary (model.tokenizer.file_limit) before a byte is read."""
    raw = read_bytes(directory / TOKENIZER_FILE, file_limit(config.vocab_size), "a Hugging Face model directory "
                     "needs its tokenizer.json beside config.json")
    try:
        data = json.loads(raw)
        kind = (data.get("model") or {}).get("type")
    except (ValueError, RecursionError, AttributeError) as exc:
        raise HFImportError(f"{TOKENIZER_FILE}: not a tokenizers file: {str(exc)[:200]}") from None
    if kind is not None and kind not in MODELS:
        raise HFImportError(f"{TOKENIZER_FILE}: model type {kind!r} is not one the tokenizers library reads "
                            f"(supported: {', '.join(MODELS)})")
    settings = _settings(directory)
    rebuilt = pipeline(data, picked_class(read_config(directory), settings, data), settings)
    try:  # the file's own text unless the class rebuilds its pipeline (no second serialization of a large file)
        backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8") if rebuilt is data else json.dumps(rebuilt))
    except Exception as exc:  # tokenizers raises a bare Exception for bad JSON or schema
        raise HFImportError(f"{TOKENIZER_FILE}: not a tokenizers file: {str(exc)[:200]}") from None
    backend.no_truncation()  # the file's truncation / padding sections: transformers sets both per call instead
    backend.no_padding()
    try:
        tokenizer = tokenizer_class(settings, backend)(backend, _special_ids(directory, backend, config))
    except TokenizerError as exc:
        raise HFImportError(f"{TOKENIZER_FILE}: {exc}") from None
    return tokenizer


def _settings(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json (empty where the directory has none)."""
    path = directory / TOKEN_FILES[0]
    return read_json(path, MAX_TOKEN_FILE_BYTES) if path.is_file() else {}


def _special_ids(directory: Path, backend: tokenizers.Tokenizer, config: TransformerConfig) -> SpecialIds:
    named: dict[str, Any] = {}
    for name in reversed(TOKEN_FILES):  # tokenizer_config.json's entries override special_tokens_map.json's
        path = directory / name
        if path.is_file():
            named |= {k: v for k, v in read_json(path, MAX_TOKEN_FILE_BYTES).items() if k.endswith("_token")}
    ids = {}
    for role in ROLES:
        token = named.get(f"{role}_token")
        text = token.get("content") if isinstance(token, dict) else token  # an AddedToken's fields, or its text
        ids[role] = backend.token_to_id(text) if isinstance(text, str) else None
    ids["pad"] = config.pad_id
    for role in ("bos", "eos"):  # the model's own start/end ids (generative families) win over the files'
        ids[role] = getattr(config, f"{role}_id", ids[role])
    return SpecialIds(**ids)
