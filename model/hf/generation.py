"""What a Hugging Face model's generation_config.json asks of every generation, as `generate()` applies it.

Two parts: rules imposed on every search (``bad_words_ids`` of one token each: OPUS-MT bans its pad token,
whose logit could otherwise win; ``forced_eos_token_id``: the last token allowed is EOS;
``no_repeat_ngram_size``, ``repetition_penalty``: a request may set its own; ``renormalize_logits``), and
defaults for what a request leaves unset (``num_beams``, ``max_length``/``max_new_tokens``, ``min_length``,
``length_penalty``, ``early_stopping``, ``do_sample`` with its ``temperature``/``top_k``/``top_p``).
``forced_bos_token_id`` (BART's ``<s>``) is the forced first token of every row that names none of its own (a target
language's: model.search.force_first_tokens). Fields that would change the tokens in ways we cannot reproduce are
refused by name. Older configs keep these fields in config.json instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import TransformerConfig
from model.generation_config import ConfigError, GenerationConfig
from model.hf.common import HFImportError, read_config, read_json

GENERATION_FILE = "generation_config.json"
MAX_FILE_BYTES = 1 << 16
# Fields whose non-default value changes generate()'s tokens in a way we do not reproduce.
UNSUPPORTED = {
    "encoder_repetition_penalty": 1.0, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "top_h": None,
    "encoder_no_repeat_ngram_size": 0, "suppress_tokens": None, "begin_suppress_tokens": None,
    "sequence_bias": None, "exponential_decay_length_penalty": None,
    "guidance_scale": None, "constraints": None, "force_words_ids": None, "penalty_alpha": None,
    "min_new_tokens": None, "watermarking_config": None,
}
HF_TOP_K = 50  # generate()'s top_k when sampling and the config names none


@dataclass(frozen=True)
class GenerationRules:
    """Applied to every search of the model: GenerationConfig fields, plus ``defaults`` for a request's unset
    fields (GenerationConfig field -> value)."""

    banned_token_ids: tuple[int, ...] = ()
    forced_eos: bool = False
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    renormalize: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)
    forced_bos: int | None = None  # a row's first token unless it names one (model.search.force_first_tokens)

    def imposed(self) -> dict[str, Any]:
        """The GenerationConfig fields every search of the model gets."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_IMPOSED}


_NOT_IMPOSED = ("defaults", "forced_bos")


def _number(source: dict, name: str, kind: type, default: Any) -> Any:
    value = source.get(name, default)
    if value is None:
        return default
    accepted = (int, float) if kind is float else kind  # JSON writes 1.0 as 1
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
        article = "an" if kind is int else "a"
        raise HFImportError(f"{name} must be {article} {kind.__name__}, got {value!r}")
    return value


def _defaults(source: dict, config: TransformerConfig) -> dict[str, Any]:
    """Request defaults as GenerationConfig fields: only what the file sets (ours apply otherwise)."""
    out: dict[str, Any] = {}
    beams = _number(source, "num_beams", int, 1)
    if _number(source, "do_sample", bool, False):
        if beams > 1:
            raise HFImportError(f"do_sample with num_beams={beams} (beam sampling) is not supported")
        out |= {"strategy": "sample", "temperature": _number(source, "temperature", float, 1.0),
                "top_k": _number(source, "top_k", int, HF_TOP_K), "top_p": _number(source, "top_p", float, 1.0)}
    elif beams > 1:
        out |= {"strategy": "beam", "num_beams": beams}
    if source.get("max_new_tokens") is not None:
        out["max_new_tokens"] = _number(source, "max_new_tokens", int, None)
    elif source.get("max_length") is not None and config.family == "seq2seq":  # counts the decoder start token
        out["max_new_tokens"] = max(1, _number(source, "max_length", int, None) - 1)
    min_length = _number(source, "min_length", int, 0)
    if min_length > 1 and config.family != "seq2seq":  # there it counts each request's prompt
        raise HFImportError(f"min_length={min_length} is not supported for a decoder-only model")
    if min_length > 1:  # counts the decoder start token too, as max_length does
        out["min_new_tokens"] = min_length - 1
    if "length_penalty" in source:
        out["length_penalty"] = _number(source, "length_penalty", float, 1.0)
    early = source.get("early_stopping", False)
    if not (isinstance(early, bool) or early == "never"):
        raise HFImportError(f"early_stopping must be true, false or 'never', got {early!r}")
    out["early_stopping"] = early  # generate()'s default is False; ours (True) is for our own checkpoints
    return out


def _penalty(source: dict) -> float:
    penalty = _number(source, "repetition_penalty", float, 1.0)
    if not penalty > 0 or penalty == float("inf"):
        raise HFImportError(f"repetition_penalty must be finite and > 0, got {penalty}")
    return float(penalty)


def generation_rules(directory: Path, config: TransformerConfig) -> GenerationRules:
    """The rules and defaults of ``directory``'s generation_config.json (else config.json) for model ``config``."""
    has_file = (directory / GENERATION_FILE).is_file()
    source = read_json(directory / GENERATION_FILE, MAX_FILE_BYTES) if has_file else read_config(directory)
    name = GENERATION_FILE if has_file else "config.json"
    try:
        rules = _rules(source, config)
        # what every request starts from must be a search we run: a default refused here, not on each request
        GenerationConfig(**rules.imposed(), **rules.defaults, eos_token_id=getattr(config, "eos_id", None) or 0)
    except (HFImportError, ConfigError) as exc:
        raise HFImportError(f"{name}: {exc}") from None
    return rules


def _rules(source: dict, config: TransformerConfig) -> GenerationRules:
    for key, neutral in UNSUPPORTED.items():
        if source.get(key, neutral) not in (neutral, None):
            raise HFImportError(f"{key}={source[key]!r} is not supported")
    bad = source.get("bad_words_ids") or []
    if not isinstance(bad, list) or not all(isinstance(w, list) and len(w) == 1 and isinstance(w[0], int)
                                            and 0 <= w[0] < config.vocab_size for w in bad):
        raise HFImportError(f"bad_words_ids must be single tokens of the vocabulary (a list of [id] lists); "
                            f"got {str(bad)[:80]}")
    forced = source.get("forced_eos_token_id")
    eos = getattr(config, "eos_id", None)
    if forced is not None and forced != eos:
        raise HFImportError(f"forced_eos_token_id={forced!r} differs from the model's eos_token_id={eos}")
    start = source.get("decoder_start_token_id")
    if config.family == "seq2seq" and start is not None and start != getattr(config, "bos_id", None):
        raise HFImportError(f"decoder_start_token_id={start!r} differs from the model's "
                            f"decoder_start_token_id={getattr(config, 'bos_id', None)}")
    forced_bos = source.get("forced_bos_token_id")
    if forced_bos is not None and (isinstance(forced_bos, bool) or not isinstance(forced_bos, int)
                                   or not 0 <= forced_bos < config.vocab_size or config.family != "seq2seq"):
        raise HFImportError(f"forced_bos_token_id={forced_bos!r} is not supported (a token of the vocabulary, "
                            "for an encoder-decoder)")
    ngram = _number(source, "no_repeat_ngram_size", int, 0)
    if ngram < 0:
        raise HFImportError(f"no_repeat_ngram_size must be >= 0, got {ngram}")
    return GenerationRules(
        banned_token_ids=tuple(sorted({w[0] for w in bad} - {eos})),
        forced_eos=forced is not None,
        no_repeat_ngram_size=ngram,
        repetition_penalty=_penalty(source),
        renormalize=_number(source, "renormalize_logits", bool, False),
        defaults=_defaults(source, config),
        forced_bos=forced_bos,
    )
