"""Which tokenizer class `transformers.AutoTokenizer` (5.x) picks for a directory, and the pipeline that class builds.

transformers loads tokenizer.json exactly as written only into ``TokenizersBackend`` (``PreTrainedTokenizerFast``).
The Llama-family classes keep the file's vocabulary, merges, post-processor and added tokens but build their own
normalizer, pre-tokenizer, decoder and BPE options, so the ids depend on the class: Llama 2's legacy tokenizer.json
(a "Prepend ▁" normalizer) encodes leading spaces differently under LlamaTokenizer's Metaspace pre-tokenizer.
:func:`pipeline` returns tokenizer.json's text with the picked class's pipeline in place of the file's. What
AutoTokenizer does with tokenizer_config.json's ``add_bos_token`` / ``add_eos_token`` beside a tokenizer.json:
nothing (they are dropped; the file's post-processor is the template), so they are not read here either.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex, decoders, normalizers, pre_tokenizers

from model.hf.common import HFImportError

BACKEND = "TokenizersBackend"  # the file as written (PreTrainedTokenizerFast is its alias)
AS_WRITTEN = {BACKEND, "PreTrainedTokenizer", "PreTrainedTokenizerFast", "PythonBackend"}
# config.json's model_type -> the class transformers registers for it (only where that class rebuilds the pipeline)
REGISTERED = {"gpt2": "GPT2Tokenizer", "bert": "BertTokenizer", "qwen2": "Qwen2Tokenizer",
              "qwen3": "Qwen2Tokenizer",
              **{t: "GemmaTokenizer" for t in ("gemma", "gemma2", "gemma3", "gemma3_text")}}
# model types whose declared tokenizer_class transformers overrides by the registered one (or by TokenizersBackend)
OVERRIDDEN = {"phi3", "qwen2"}
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
BPE = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,  # a new BPE's options
       "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
SPM_DECODE = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]


def picked_class(hf: dict[str, Any], settings: dict[str, Any], data: dict[str, Any]) -> str:
    """The class AutoTokenizer instantiates for a directory: config.json ``hf``, tokenizer_config.json ``settings``,
    tokenizer.json ``data`` (transformers' tokenization_auto rules, for the model types we import)."""
    model_type = hf.get("model_type")
    declared = settings.get("tokenizer_class") or hf.get("tokenizer_class")
    declared = declared.removesuffix("Fast") if isinstance(declared, str) else None
    registered = REGISTERED.get(model_type)
    auto_map = settings.get("auto_map")
    remote = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    if remote and model_type not in OVERRIDDEN:
        raise HFImportError(f"tokenizer_config.json: auto_map names a tokenizer class in the repository's own code "
                            f"({remote!r}), which transformers runs only with trust_remote_code and we never run")
    if declared == "LlamaTokenizer" and model_type not in {"mistral", *OVERRIDDEN} and _byte_level(data):
        return BACKEND  # LlamaTokenizer hard-codes Metaspace: a ByteLevel file (Llama 3) loads as written
    if declared is None:
        return registered or BACKEND
    if registered is not None and registered != declared:
        return registered if model_type in OVERRIDDEN else _known(declared)
    if model_type in {"mistral", "phi3"}:  # registered as TokenizersBackend (without mistral_common)
        return BACKEND
    return _known(declared)


def pipeline(data: dict[str, Any], cls: str, settings: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json ``data`` with class ``cls``'s normalizer, pre-tokenizer, decoder and model options
    (``settings``: tokenizer_config.json, for add_prefix_space, legacy, unk_token, do_lower_case...)."""
    if cls in AS_WRITTEN:
        return data
    built = BUILDERS[cls](settings)
    model = data.get("model") or {}
    if model.get("type") != built.model["type"]:
        raise HFImportError(f"tokenizer.json: {cls} rebuilds a {built.model['type']} tokenizer, but this file's model "
                            f"is {model.get('type')!r}; transformers would not load it as written")
    parts = {"normalizer": built.normalizer, "pre_tokenizer": built.pre_tokenizer, "decoder": built.decoder}
    return {**data, **{k: _json(v) for k, v in parts.items()}, "model": {**model, **built.model}}


@dataclass(frozen=True)
class Built:
    """What a tokenizer class sets itself: its components and its model's options (the file gives the rest)."""

    normalizer: Any
    pre_tokenizer: Any
    decoder: Any
    model: dict[str, Any]


def _llama(settings: dict[str, Any]) -> Built:
    prefix = settings.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if settings.get("legacy", False) else "first") if prefix else "never"
    decoder = decoders.Sequence([*SPM_DECODE, *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return Built(None, pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False), decoder,
                 {**BPE, "fuse_unk": True, "byte_fallback": True})


def _gemma(settings: dict[str, Any]) -> Built:
    return Built(normalizers.Replace(" ", "▁"), pre_tokenizers.Split(" ", behavior="merged_with_previous"),
                 decoders.Sequence(SPM_DECODE),
                 {**BPE, "fuse_unk": True, "byte_fallback": True, "unk_token": _text(settings, "unk_token", "<unk>")})


def _qwen2(settings: dict[str, Any]) -> Built:
    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.get("add_prefix_space")), use_regex=False)
    return Built(normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level]), decoders.ByteLevel(),
                 {**BPE, "continuing_subword_prefix": "", "end_of_word_suffix": ""})


def _gpt2(settings: dict[str, Any]) -> Built:
    return Built(None, pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.get("add_prefix_space"))),
                 decoders.ByteLevel(), {**BPE, "continuing_subword_prefix": "", "end_of_word_suffix": ""})


def _bert(settings: dict[str, Any]) -> Built:
    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=settings.get("tokenize_chinese_chars", True),
        strip_accents=settings.get("strip_accents"), lowercase=settings.get("do_lower_case", True))
    return Built(normalizer, pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(prefix="##"),
                 {"type": "WordPiece", "unk_token": _text(settings, "unk_token", "[UNK]"),
                  "continuing_subword_prefix": "##", "max_input_chars_per_word": 100})


BUILDERS: dict[str, Callable[[dict[str, Any]], Built]] = {
    "LlamaTokenizer": _llama, "GemmaTokenizer": _gemma, "Qwen2Tokenizer": _qwen2, "GPT2Tokenizer": _gpt2,
    "BertTokenizer": _bert}


def _text(settings: dict[str, Any], key: str, default: str) -> str:
    value = settings.get(key, default)
    return str(value.get("content") if isinstance(value, dict) else value)


def _known(declared: str) -> str:
    if declared in AS_WRITTEN:
        return BACKEND
    if declared in BUILDERS:
        return declared
    raise HFImportError(f"tokenizer_config.json: tokenizer_class={declared!r} is not a class whose pipeline is "
                        f"reproduced here (supported: {', '.join(sorted(BUILDERS))}, and PreTrainedTokenizerFast, "
                        f"which takes tokenizer.json as written)")


def _byte_level(data: dict[str, Any]) -> bool:
    return any('"ByteLevel"' in json.dumps(data.get(part)) for part in ("pre_tokenizer", "decoder"))


def _json(component: Any) -> Any:
    return None if component is None else json.loads(component.__getstate__())
