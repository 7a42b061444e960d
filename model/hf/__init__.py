"""Hugging Face model directories (config.json + model.safetensors) as our models, exactly.

:func:`load_hf_model` reads the config, refuses what our families cannot express (naming the field), reads
the weights (safetensors only) and maps them onto our module names. One module per architecture, each with
``ARCHITECTURES`` (the ``architectures`` names it takes), ``to_config`` (HF config -> ours) and ``state_dict``
(HF tensors -> ours), and ``ADAPTER_LAYOUT`` (PEFT adapters in its names <-> ours): gpt2.py (GPT2LMHeadModel,
GPT2Model), bert.py (BertForSequenceClassification, BertModel) and its thin maps roberta.py (RoBERTa's and
XLM-RoBERTa's) and distilbert.py, modernbert.py (ModernBERT's encoder and heads), marian.py (MarianMTModel), llama.py
(LlamaForCausalLM), bart.py (BartForConditionalGeneration) and its thin maps mbart.py
(MBartForConditionalGeneration) and m2m100.py (M2M100ForConditionalGeneration: M2M100, NLLB-200), and the Llama
family's thin maps over llama.py: mistral.py (MistralForCausalLM), qwen2.py
(Qwen2ForCausalLM), qwen3.py (Qwen3ForCausalLM), phi3.py (Phi3ForCausalLM), gemma3.py (Gemma3ForCausalLM).
t5.py: T5ForConditionalGeneration and MT5ForConditionalGeneration (T5 v1.0, v1.1, Flan-T5, mT5).
:func:`hf_companions` reads what else the directory brings (model.checkpoint.load_hf_checkpoint adds it to the
model): tokenizer.json (tokenizer.py) or OPUS-MT's SentencePiece files (marian_tokenizer.py), generation_config.json's
rules (generation.py) and sentence-transformers' pooling (sentence.py).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from model.build import build_empty, load_into
from model.config import TransformerConfig
from model.files import read_regular
from model.hf.common import CONFIG_FILE, HFImportError, read_config, read_weights
from model.hf.generation import GENERATION_FILE, generation_rules
from model.hf.marian_tokenizer import MARIAN_FILES, is_marian_tokenizer, load_marian_tokenizers
from model.hf.sentence import embedding_defaults, score_activation, sentence_files
from model.hf.seq2seq_tokenizers import SEQ2SEQ_FILES, load_languages, load_seq2seq_tokenizer
from model.hf.tokenizer import TOKENIZER_FILES, load_tokenizer
from model.tokenizer import MAX_TOKENIZER_BYTES  # the largest file a companion may be

# config.json's model_type -> the module of its importer (imported when a directory of that type loads)
IMPORTERS = {"gpt2": "model.hf.gpt2", "bert": "model.hf.bert", "marian": "model.hf.marian",
             "llama": "model.hf.llama", "mistral": "model.hf.mistral", "qwen2": "model.hf.qwen2",
             "qwen3": "model.hf.qwen3", "phi3": "model.hf.phi3", "gemma3_text": "model.hf.gemma3",
             "roberta": "model.hf.roberta", "xlm-roberta": "model.hf.roberta", "distilbert": "model.hf.distilbert",
             "bart": "model.hf.bart",
             "mbart": "model.hf.mbart",
             "t5": "model.hf.t5",
             "mt5": "model.hf.t5",
             "m2m_100": "model.hf.m2m100",
             "modernbert": "model.hf.modernbert"}


def is_hf_directory(directory: str | Path) -> bool:
    """Whether ``directory`` is in the Hugging Face layout (a config.json naming a model_type)."""
    try:
        return "model_type" in read_config(Path(directory))
    except HFImportError:  # unreadable: whichever loader reads it says what is wrong with it
        return False


def _importer(hf: dict) -> ModuleType:
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in IMPORTERS:
        raise HFImportError(f"{CONFIG_FILE}: model_type={model_type!r} is not supported "
                            f"(supported: {sorted(IMPORTERS)})")
    return importlib.import_module(IMPORTERS[model_type])


def load_hf_model(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, TransformerConfig]:
    """The model of HF directory ``directory`` as ours, in eval mode (HFImportError says what does not fit)."""
    directory = Path(directory)
    hf = read_config(directory)
    model_type = hf.get("model_type")
    importer = _importer(hf)
    architectures = hf.get("architectures") or importer.ARCHITECTURES[:1]
    unknown = [a for a in architectures if a not in importer.ARCHITECTURES]
    if unknown:
        raise HFImportError(f"{CONFIG_FILE}: architectures={unknown} are not supported for {model_type} "
                            f"(supported: {list(importer.ARCHITECTURES)})")
    config = importer.to_config(hf)
    state = importer.state_dict(config, read_weights(directory))
    model = build_empty(config)  # the tensors read become its parameters: the weights are held once
    load_into(model, {k: v.to(dtype) for k, v in state.items()})
    return model.to(dtype).eval(), config


def hf_companions(directory: Path, config: TransformerConfig) -> dict[str, Any]:
    """Everything but the weights that an HF directory brings, as Checkpoint fields: the tokenizers, labels,
    the PEFT adapter layout, sentence-transformers' embedding defaults, generation rules and a multilingual
    translator's language codes (model.hf.languages). ``directory`` is
    an HF model directory, or the copy of its files (``companion_files``) an imported checkpoint keeps."""
    if is_marian_tokenizer(directory):
        source_tokenizer, tokenizer = load_marian_tokenizers(directory)
    else:  # NLLB's, M2M100's, mBART-50's, T5's classes (SentencePiece files or tokenizer.json), else tokenizer.json
        tokenizer = load_seq2seq_tokenizer(directory, config) or load_tokenizer(directory, config)
        source_tokenizer = None
    _check_vocabularies(config, source_tokenizer, tokenizer)
    hf = read_config(directory)
    importer = _importer(hf)
    return {
        "tokenizer": tokenizer,
        "source_tokenizer": source_tokenizer,
        "labels": importer.labels(hf) if hasattr(importer, "labels") else None,
        "adapter_layout": getattr(importer, "ADAPTER_LAYOUT", None),  # PEFT adapters' module names
        "embedding": embedding_defaults(directory),
        "score_activation": score_activation(hf),
        "generation": generation_rules(directory, config) if config.family != "classifier" else None,
        "languages": load_languages(directory, tokenizer) if config.family == "seq2seq" and source_tokenizer is None
        else None,
    }


def companion_files(directory: Path) -> dict[str, bytes]:
    """The files :func:`hf_companions` reads in ``directory`` (relative name -> bytes), to keep beside an
    imported checkpoint: config.json, the tokenizer's files, generation_config.json, sentence-transformers'."""
    names = [CONFIG_FILE, GENERATION_FILE, *TOKENIZER_FILES, *MARIAN_FILES, *SEQ2SEQ_FILES, *sentence_files(directory)]
    return {name: read_regular(directory / name, MAX_TOKENIZER_BYTES) for name in dict.fromkeys(names)
            if (directory / name).is_file()}


def _check_vocabularies(config: TransformerConfig, source: object | None, target: object) -> None:
    """Every id a tokenizer gives must index the model's embeddings."""
    sides = [("target", target, config.vocab_size)]
    if source is not None:
        sides.append(("source", source, getattr(config, "src_vocab_size", None) or config.vocab_size))
    for side, tokenizer, size in sides:
        if tokenizer.vocab_size > size:
            raise HFImportError(f"the {side} tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                                f"{size}")


__all__ = ["HFImportError", "companion_files", "hf_companions", "is_hf_directory", "load_hf_model"]
