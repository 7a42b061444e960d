"""Which tokenizer class `transformers.AutoTokenizer` (5.x) picks for a directory, and the pipeline that class builds.

transformers loads tokenizer.json exactly as written only into ``TokenizersBackend`` (``PreTrainedTokenizerFast``).
The Llama-family classes keep the file's vocabulary, merges, post-processor and added tokens but build their own
normalizer, pre-tokenizer, decoder and BPE options, so the ids depend on the class: Llama 2's legacy tokenizer.json
(a "Prepend ▁" normalizer) encodes leading spaces differently under LlamaTokenizer's Metaspace pre-tokenizer.
The encoders' classes also replace the file's template (post-processor) by their own: BertTokenizer (and
DistilBertTokenizer) ``[CLS] a [SEP] (b [SEP])``, RobertaTokenizer a RobertaProcessing, XLMRobertaTokenizer
``<s> a </s> (</s> b </s>)``; XLMRobertaTokenizer keeps only the file's Precompiled normalizer and hard-codes
unk_id 3. The seq2seq classes (model.hf.seq2seq_tokenizers) build a Metaspace pipeline: NllbTokenizer a BPE with
``[src_lang] a </s>`` (``a </s> [src_lang]`` with legacy_behaviour), MBart50Tokenizer a Unigram with
``[src_lang] a </s>``, T5Tokenizer a Unigram after a whitespace split with ``a </s>``; BartTokenizer is
RobertaTokenizer. :func:`pipeline` returns tokenizer.json's text with the picked class's pipeline in place of the
file's.
What AutoTokenizer does with tokenizer_config.json's ``add_bos_token`` / ``add_eos_token`` beside a tokenizer.json:
nothing (they are dropped; the file's post-processor, or the class's own, is the template), so they are not read
here either.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

from model.hf.common import HFImportError
from model.hf.languages import DEFAULT_SOURCE, wrap

BACKEND = "TokenizersBackend"  # the file as written (PreTrainedTokenizerFast is its alias)
AS_WRITTEN = {BACKEND, "PreTrainedTokenizer", "PreTrainedTokenizerFast", "PythonBackend"}
# config.json's model_type -> the class transformers registers for it (where that class rebuilds the pipeline, or is
# TokenizersBackend while the hub's files name a class that would)
REGISTERED = {"gpt2": "GPT2Tokenizer", "bert": "BertTokenizer", "qwen2": "Qwen2Tokenizer",
              "qwen3": "Qwen2Tokenizer", "distilbert": "BertTokenizer", "roberta": "RobertaTokenizer",
              "roberta-prelayernorm": "RobertaTokenizer", "xlm-roberta": "XLMRobertaTokenizer",
              "xlm-roberta-xl": BACKEND, "modernbert": BACKEND, "t5": "T5Tokenizer", "mt5": "T5Tokenizer",
              "bart": "RobertaTokenizer",
              **{t: "GemmaTokenizer" for t in ("gemma", "gemma2", "gemma3", "gemma3_text")}}
# model types whose declared tokenizer_class transformers overrides by the registered one (or by TokenizersBackend)
OVERRIDDEN = {"phi3", "qwen2", "modernbert"}
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
BPE = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,  # a new BPE's options
       "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
SPACE_RUNS = normalizers.Replace(Regex(" {2,}"), " ")  # NllbTokenizer's / MBart50Tokenizer's, after Precompiled
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
        return registered if model_type in OVERRIDDEN or registered == BACKEND else _known(declared)
    if model_type in {"mistral", "phi3"}:  # registered as TokenizersBackend (without mistral_common)
        return BACKEND
    return _known(declared)


def pipeline(data: dict[str, Any], cls: str, settings: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json ``data`` with class ``cls``'s normalizer, pre-tokenizer, decoder, model options and, for the
    classes that build one, template (``settings``: tokenizer_config.json, for add_prefix_space, legacy, unk_token,
    do_lower_case, the special tokens...)."""
    if cls in AS_WRITTEN:
        return data
    built = BUILDERS[cls](settings, data)
    model = data.get("model") or {}
    if _model_type(model) != built.model["type"]:
        raise HFImportError(f"tokenizer.json: {cls} rebuilds a {built.model['type']} tokenizer, but this file's model "
                            f"is {_model_type(model)!r}; transformers would not load it as written")
    parts = {"normalizer": built.normalizer, "pre_tokenizer": built.pre_tokenizer, "decoder": built.decoder,
             **({"post_processor": built.post_processor} if built.post_processor is not None else {})}
    return {**data, **{k: _json(v) for k, v in parts.items()}, "model": {**model, **built.model}}


@dataclass(frozen=True)
class Built:
    """What a tokenizer class sets itself: its components and its model's options (the file gives the rest)."""

    normalizer: Any
    pre_tokenizer: Any
    decoder: Any
    model: dict[str, Any]
    post_processor: Any = None  # None: the file's template


def _llama(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    prefix = settings.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if settings.get("legacy", False) else "first") if prefix else "never"
    decoder = decoders.Sequence([*SPM_DECODE, *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return Built(None, pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False), decoder,
                 {**BPE, "fuse_unk": True, "byte_fallback": True})


def _gemma(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    return Built(normalizers.Replace(" ", "▁"), pre_tokenizers.Split(" ", behavior="merged_with_previous"),
                 decoders.Sequence(SPM_DECODE),
                 {**BPE, "fuse_unk": True, "byte_fallback": True, "unk_token": _text(settings, "unk_token", "<unk>")})


def _qwen2(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.get("add_prefix_space")), use_regex=False)
    return Built(normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level]), decoders.ByteLevel(),
                 {**BPE, "continuing_subword_prefix": "", "end_of_word_suffix": ""})


def _gpt2(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    return Built(None, pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.get("add_prefix_space"))),
                 decoders.ByteLevel(), {**BPE, "continuing_subword_prefix": "", "end_of_word_suffix": ""})


def _bert(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=settings.get("tokenize_chinese_chars", True),
        strip_accents=settings.get("strip_accents"), lowercase=settings.get("do_lower_case", True))
    cls, sep = _text(settings, "cls_token", "[CLS]"), _text(settings, "sep_token", "[SEP]")
    template = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, _token_id(data, cls, "cls_token")), (sep, _token_id(data, sep, "sep_token"))])
    return Built(normalizer, pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(prefix="##"),
                 {"type": "WordPiece", "unk_token": _text(settings, "unk_token", "[UNK]"),
                  "continuing_subword_prefix": "##", "max_input_chars_per_word": 100}, template)


def _roberta(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    """GPT2Tokenizer's byte-level BPE with a RobertaProcessing template (``<s> a </s> (</s> b </s>)``)."""
    cls, sep = _text(settings, "cls_token", "<s>"), _text(settings, "sep_token", "</s>")
    template = processors.RobertaProcessing(
        (sep, _token_id(data, sep, "sep_token")), (cls, _token_id(data, cls, "cls_token")),
        trim_offsets=bool(settings.get("trim_offsets", True)),
        add_prefix_space=bool(settings.get("add_prefix_space", False)))
    return replace(_gpt2(settings, data), post_processor=template)


def _xlm_roberta(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    """A Unigram with unk_id 3 whatever the file says, the file's Precompiled normalizer alone (or none),
    whitespace split then Metaspace, and ``<s> a </s> (</s> b </s>)`` with every token in segment 0."""
    scheme = "always" if settings.get("add_prefix_space", True) else "never"
    bos, eos = _text(settings, "bos_token", "<s>"), _text(settings, "eos_token", "</s>")
    template = processors.TemplateProcessing(
        single=[bos, "$A", eos], pair=[bos, "$A", eos, eos, "$B", eos],
        special_tokens=[(bos, _token_id(data, bos, "bos_token")), (eos, _token_id(data, eos, "eos_token"))])
    return Built(_precompiled(data.get("normalizer")),
                 pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                          pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)]),
                 decoders.Metaspace(replacement="▁", prepend_scheme=scheme),
                 {"type": "Unigram", "unk_id": 3, "byte_fallback": False}, template)


def _metaspace_spm(normalizer: Any, model: dict[str, Any], template: Any, split: bool = False) -> Built:
    """The seq2seq SentencePiece classes' pipeline: Metaspace (always prepended, split) both ways; ``split``: a
    WhitespaceSplit before it (T5Tokenizer's)."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    pre = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace]) if split else metaspace
    return Built(normalizer, pre, decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True), model,
                 template)


def _source_template(settings: dict[str, Any], data: dict[str, Any], cls: str) -> Any:
    """NllbTokenizer's / MBart50Tokenizer's template for tokenizer_config.json's src_lang (model.hf.languages.wrap);
    a code the vocabulary lacks is the unknown token, as convert_tokens_to_ids gives it."""
    lang, eos = settings.get("src_lang") or DEFAULT_SOURCE[cls], _text(settings, "eos_token", "</s>")
    legacy = cls == "NllbTokenizer" and bool(settings.get("legacy_behaviour"))
    try:
        lang_id = _token_id(data, lang, "src_lang")
    except HFImportError:
        lang_id = _token_id(data, _text(settings, "unk_token", "<unk>"), "unk_token")
    return processors.TemplateProcessing(
        single=wrap(["$A"], lang, eos, legacy), pair=wrap(["$A", "$B"], lang, eos, legacy),
        special_tokens=[(eos, _token_id(data, eos, "eos_token")), (lang, lang_id)])


def _nllb(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    """BPE (fuse_unk), the file's Precompiled normalizer then spaces runs as one (no normalizer without it)."""
    charsmap = _precompiled(data.get("normalizer"))
    normalizer = None if charsmap is None else {"type": "Sequence", "normalizers": [charsmap, _json(SPACE_RUNS)]}
    model = {**BPE, "fuse_unk": True, "unk_token": _text(settings, "unk_token", "<unk>")}
    return _metaspace_spm(normalizer, model, _source_template(settings, data, "NllbTokenizer"))


def _mbart50(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    """A Unigram with unk_id 3, the file's Precompiled normalizer (if any) then space runs as one."""
    charsmap = _precompiled(data.get("normalizer"))
    normalizer = {"type": "Sequence", "normalizers": [*([charsmap] if charsmap else []), _json(SPACE_RUNS)]}
    return _metaspace_spm(normalizer, {"type": "Unigram", "unk_id": 3, "byte_fallback": False},
                          _source_template(settings, data, "MBart50Tokenizer"))


def _t5(settings: dict[str, Any], data: dict[str, Any]) -> Built:
    """A Unigram with unk_id 2, the file's Precompiled normalizer alone, ``a </s> (b </s>)``."""
    eos_id = _token_id(data, _text(settings, "eos_token", "</s>"), "eos_token")
    template = processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                             special_tokens=[("</s>", eos_id)])
    model = {"type": "Unigram", "unk_id": 2, "byte_fallback": False}
    return _metaspace_spm(_precompiled(data.get("normalizer")), model, template, split=True)


BUILDERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], Built]] = {
    "LlamaTokenizer": _llama, "GemmaTokenizer": _gemma, "Qwen2Tokenizer": _qwen2, "GPT2Tokenizer": _gpt2,
    "BertTokenizer": _bert, "DistilBertTokenizer": _bert, "RobertaTokenizer": _roberta,
    "XLMRobertaTokenizer": _xlm_roberta, "NllbTokenizer": _nllb, "MBart50Tokenizer": _mbart50, "T5Tokenizer": _t5,
    "BartTokenizer": _roberta}  # transformers 5's BartTokenizer is RobertaTokenizer


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


def _model_type(model: dict[str, Any]) -> str:
    """tokenizer.json's model type; older files (distilbert-base-*'s) leave it out and `tokenizers` tells it by the
    fields."""
    if "type" in model:
        return model["type"]
    if "merges" in model:
        return "BPE"
    if isinstance(model.get("vocab"), list):
        return "Unigram"
    return "WordPiece" if "max_input_chars_per_word" in model else "WordLevel"


def _token_id(data: dict[str, Any], text: str, role: str) -> int:
    """The id of token ``text`` in tokenizer.json (its added tokens first, then the model's vocabulary)."""
    for token in data.get("added_tokens") or []:
        if isinstance(token, dict) and token.get("content") == text and isinstance(token.get("id"), int):
            return token["id"]
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
        return vocab[text]
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs
        for i, entry in enumerate(vocab):
            if isinstance(entry, list) and entry and entry[0] == text:
                return i
    raise HFImportError(f"tokenizer_config.json: {role}={text!r} is not in tokenizer.json; transformers would add "
                        f"it as a new token, which this model's embeddings do not have")


def _precompiled(normalizer: Any) -> dict[str, Any] | None:
    """The first Precompiled normalizer at the top of tokenizer.json's normalizer (what XLMRobertaTokenizer keeps)."""
    parts = normalizer.get("normalizers") if isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" \
        else [normalizer]
    return next((part for part in parts or [] if isinstance(part, dict) and part.get("type") == "Precompiled"
                 and "precompiled_charsmap" in part), None)


def _byte_level(data: dict[str, Any]) -> bool:
    return any('"ByteLevel"' in json.dumps(data.get(part)) for part in ("pre_tokenizer", "decoder"))


def _json(component: Any) -> Any:
    """A tokenizers component as tokenizer.json writes it (a dict taken from the file stays as it is)."""
    if component is None or isinstance(component, dict):
        return component
    return json.loads(component.__getstate__())
