"""What a Hugging Face model's generation_config.json imposes on every generation (not per-request defaults).

Two rules that change which tokens come out: ``bad_words_ids`` of one token each (OPUS-MT bans its pad
token, whose logit could otherwise win) and ``forced_eos_token_id`` (the last token allowed is EOS). Rules
we cannot apply exactly are refused by name; older configs keep these fields in config.json instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model.config import TransformerConfig
from model.hf.common import HFImportError, read_config, read_json

GENERATION_FILE = "generation_config.json"
MAX_FILE_BYTES = 1 << 16


@dataclass(frozen=True)
class GenerationRules:
    banned_token_ids: tuple[int, ...] = ()
    forced_eos: bool = False


def generation_rules(directory: Path, config: TransformerConfig) -> GenerationRules:
    """The rules of ``directory``'s generation_config.json (else config.json) for model ``config``."""
    has_file = (directory / GENERATION_FILE).is_file()
    source = read_json(directory / GENERATION_FILE, MAX_FILE_BYTES) if has_file else read_config(directory)
    name = GENERATION_FILE if has_file else "config.json"
    if source.get("no_repeat_ngram_size"):
        raise HFImportError(f"{name}: no_repeat_ngram_size={source['no_repeat_ngram_size']!r} is not supported")
    bad = source.get("bad_words_ids") or []
    if not isinstance(bad, list) or not all(isinstance(w, list) and len(w) == 1 and isinstance(w[0], int)
                                            and 0 <= w[0] < config.vocab_size for w in bad):
        raise HFImportError(f"{name}: bad_words_ids must be single tokens of the vocabulary (a list of [id] lists); "
                            f"got {str(bad)[:80]}")
    forced = source.get("forced_eos_token_id")
    eos = getattr(config, "eos_id", None)
    if forced is not None and forced != eos:
        raise HFImportError(f"{name}: forced_eos_token_id={forced!r} differs from the model's eos_token_id={eos}")
    return GenerationRules(tuple(sorted({w[0] for w in bad} - {eos})), forced is not None)
