"""Hugging Face model directories (config.json + model.safetensors) as our models, exactly.

:func:`load_hf_model` reads the config, refuses what our families cannot express (naming the field), reads
the weights (safetensors only) and maps them onto our module names. One module per architecture, each with
``ARCHITECTURES`` (the ``architectures`` names it takes), ``to_config`` (HF config -> ours) and ``state_dict``
(HF tensors -> ours): gpt2.py (GPT2LMHeadModel).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from model.config import TransformerConfig
from model.hf import gpt2
from model.hf.common import CONFIG_FILE, HFImportError, read_config, read_weights

IMPORTERS: dict[str, ModuleType] = {"gpt2": gpt2}  # config.json's model_type -> its importer


def is_hf_directory(directory: str | Path) -> bool:
    """Whether ``directory`` is in the Hugging Face layout (a config.json naming a model_type)."""
    path = Path(directory) / CONFIG_FILE
    try:
        return path.is_file() and "model_type" in read_config(Path(directory))
    except HFImportError:
        return path.is_file()  # a broken HF config is still an HF directory: loading it says what is wrong


def load_hf_model(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, TransformerConfig]:
    """The model of HF directory ``directory`` as ours, in eval mode (HFImportError says what does not fit)."""
    from model.checkpoint import build_model  # model.checkpoint will import this package to detect HF layouts

    directory = Path(directory)
    hf = read_config(directory)
    model_type = hf.get("model_type")
    importer = IMPORTERS.get(model_type) if isinstance(model_type, str) else None
    if importer is None:
        raise HFImportError(f"{CONFIG_FILE}: model_type={model_type!r} is not supported "
                            f"(supported: {sorted(IMPORTERS)})")
    architectures = hf.get("architectures") or importer.ARCHITECTURES[:1]
    unknown = [a for a in architectures if a not in importer.ARCHITECTURES]
    if unknown:
        raise HFImportError(f"{CONFIG_FILE}: architectures={unknown} are not supported for {model_type} "
                            f"(supported: {list(importer.ARCHITECTURES)})")
    config = importer.to_config(hf)
    state = importer.state_dict(config, read_weights(directory))
    model = build_model(config)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(dtype).eval(), config


__all__ = ["HFImportError", "is_hf_directory", "load_hf_model"]
