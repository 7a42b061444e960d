"""Write a checkpoint as a Hugging Face model directory: config.json, model.safetensors, tokenizer files."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from model.checkpoint import HF_DIR, PROMPT_SPECIALS, Checkpoint, CheckpointError, load_checkpoint
from model.config import TransformerConfig
from model.hf import companion_files
from model.tokenizer import SPECIAL_TOKENS, Tokenizer
from training.export import bert, gpt2, marian
from training.export.common import ExportError, Tensors, check

logger = logging.getLogger(__name__)

EXPORTERS: dict[str, ModuleType] = {"seq2seq": marian, "causal_lm": gpt2, "classifier": bert}


def check_exportable(config: TransformerConfig, own_tokenizer: bool = True) -> str:
    """The HF architecture for ``config``; raises ExportError naming the first field that does not fit.
    ``own_tokenizer`` False: the checkpoint brings its Hugging Face tokenizer (imported), whose ids are its own."""
    exporter = EXPORTERS[config.family]
    check(config, exporter.ARCHITECTURE, exporter.NEEDS)
    if config.family == "classifier" and not config.num_labels:
        raise ExportError("num_labels=0 (no classification head) but BertForSequenceClassification needs one")
    if own_tokenizer and config.pad_id != Tokenizer.pad_id:
        raise ExportError(f"pad_id={config.pad_id} but the exported tokenizer pads with id {Tokenizer.pad_id}")
    return exporter.ARCHITECTURE


def export_hf(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write checkpoint directory ``checkpoint`` as an HF model directory ``out``; returns ``out``."""
    try:
        ckpt = load_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    imported = Path(checkpoint, HF_DIR)  # an imported checkpoint's own tokenizer and settings files
    if imported.is_dir():
        files: dict[str, str | bytes] = dict(companion_files(imported))  # as they came (source.spm is binary)
        if ckpt.family == "seq2seq":  # back as it came: its own config.json, vocabularies and tying
            tensors = marian.build_imported(ckpt, json.loads(files["config.json"]))
            architecture = marian.ARCHITECTURE
        else:
            architecture = check_exportable(ckpt.config, own_tokenizer=False)
            config, tensors = EXPORTERS[ckpt.family].build(ckpt)
            files["config.json"] = _json({"architectures": [architecture], "dtype": "float32", **config})
    else:
        architecture = check_exportable(ckpt.config)
        if ckpt.source_tokenizer is not None:
            raise ExportError(f"{architecture} export needs one tokenizer; the checkpoint has a separate source "
                              "tokenizer")
        files = tokenizer_files(ckpt)
        if ckpt.family != "classifier":
            files["generation_config.json"] = _json(generation_config(ckpt.config))
        config, tensors = EXPORTERS[ckpt.family].build(ckpt)
        files["config.json"] = _json({"architectures": [architecture], "dtype": "float32", **config})
    out = Path(out)
    _write_dir(out, files, tensors, overwrite)
    logger.info("exported %s checkpoint %s as %s to %s", ckpt.family, checkpoint, architecture, out)
    return out


def tokenizer_files(ckpt: Checkpoint) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for PreTrainedTokenizerFast.

    tokenizer.json's template is the service's: seq2seq sources ``a </s>`` and causal prompts ``<s> a``
    (model.checkpoint.PROMPT_SPECIALS), classifier inputs ``[CLS] a [SEP] (b [SEP])``, so ``tokenizer(a)``
    (or ``tokenizer(a, b)``) gives the ids and token_type_ids the model was trained on and is served with.
    """
    c = ckpt.config
    backend = BackendTokenizer.from_str(ckpt.tokenizer.backend.to_str())  # a copy: ours stays untouched
    names = dict(zip(("pad", "bos", "eos", "unk", "cls", "sep", "mask"), SPECIAL_TOKENS, strict=True))
    special = {f"{k}_token": names[k] for k in ("pad", "bos", "eos", "unk")}
    inputs = ["input_ids", "attention_mask"]  # no token_type_ids for GPT-2 (it would add wte[0]) or Marian
    if c.family == "classifier":
        special |= {f"{k}_token": names[k] for k in ("cls", "sep", "mask")}
        inputs.insert(1, "token_type_ids")
        cls, sep = names["cls"], names["sep"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, Tokenizer.cls_id), (sep, Tokenizer.sep_id)],
        )
    else:
        add_bos, add_eos = PROMPT_SPECIALS[c.family]
        bos, eos = names["bos"], names["eos"]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([bos] * add_bos + ["$A"] + [eos] * add_eos),
            special_tokens=[(bos, Tokenizer.bos_id), (eos, Tokenizer.eos_id)],
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": c.max_src_len if c.family == "seq2seq" else c.max_len,
        "model_input_names": inputs,
        "padding_side": "left" if c.family == "causal_lm" else "right",  # batched generate() continues prompts
        "clean_up_tokenization_spaces": False,  # decode exactly as ours does
        **special,
    }
    return {
        "tokenizer.json": backend.to_str(pretty=True),
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(special),
    }


def generation_config(config: TransformerConfig) -> dict[str, Any]:
    """generation_config.json of a generative family: the ids that start, end and pad."""
    generation = {"bos_token_id": config.bos_id, "eos_token_id": config.eos_id, "pad_token_id": config.pad_id}
    if config.family == "seq2seq":
        generation |= {"decoder_start_token_id": config.bos_id, "forced_eos_token_id": None}
    return generation


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


def _write_dir(out: Path, files: dict[str, str | bytes], tensors: Tensors, overwrite: bool) -> None:
    """Write everything (texts, or bytes copied as they are) into a temporary sibling, then rename it to ``out``."""
    if out.exists() and not (out.is_dir() and (overwrite or not any(out.iterdir()))):
        raise ExportError(f"{out} already exists and is not an empty directory (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weights = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in tensors.items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, content in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # sentence-transformers' 1_Pooling/, ...
            (tmp / name).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        tmp.chmod(0o755)  # mkdtemp creates 0700
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
