"""PEFT adapters of the BERT-shaped encoders (BERT, RoBERTa / XLM-R, DistilBERT, ModernBERT) <-> our classifier's
modules.

Each architecture names the same modules its own way (:class:`EncoderNames`): a layer's Linears, the encoder's
attribute under a head model (``bert.``, ``roberta.``, ``distilbert.``), and the head model's own Linears, which
are our ``pooler`` and ``classifier`` (BERT's pooler.dense and classifier, RoBERTa's classifier.dense and
classifier.out_proj, DistilBERT's pre_classifier and classifier). A LoRA on any of them maps onto ours, and so does
an adapter's own copy of a head (PEFT's ``modules_to_save``: SEQ_CLS adapters copy ``classifier``, which is
RoBERTa's whole head and, by PEFT's suffix match, DistilBERT's pre_classifier too; ModernBERT's ``head`` is its dense
and LayerNorm, our pooler and head_norm): a copy of each of our modules it holds, norms included, used for the rows of
its adapter (model.lora_layers.HeadCopies), beside other adapters' LoRAs on the same module. An adapter of the
headless model (no prefix) loads on the head model's encoder as well. A token classification head
(*ForTokenClassification) is one Linear, ``classifier``, on every token's state (after ModernBERT's head.dense and
head.norm, our pooler and head_norm): its LoRAs and a TOKEN_CLS adapter's copy of ``classifier`` (and of ModernBERT's
``head``) map onto ours alike, the copy used for every token of the rows of its adapter. :func:`adapter_layout` gives
the AdapterLayout.

A fused Linear (ModernBERT's ``Wqkv``, ``Wi``: ``EncoderNames.fused``) is one LoRA whose B's rows split into our parts'
(q, k, v; fc1, up), which share its A; ours go back as one LoRA of rank k r on the fused module and every other LoRA
padded to that rank, as model.hf.llama_adapters does for Phi-3.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from model.config import TransformerConfig
from model.hf.llama_adapters import fuse, split_b
from model.lora_config import LoRAConfig
from model.lora_io import KEY_PREFIX, AdapterLayout, PeftFiles, peft_files, peft_targets, unmapped_tensor

_LORA_KEY = re.compile(r"base_model\.model\.(.+)\.(lora_[AB]\.weight)")
_COPY_KEY = re.compile(r"base_model\.model\.(.+)\.(weight|bias)")  # a head copy (modules_to_save)


@dataclass(frozen=True)
class EncoderNames:
    """How a BERT-shaped Hugging Face architecture names the modules our classifier's adapters touch."""

    model: str  # the architecture, in errors
    prefix: str  # the encoder's attribute under the head model, with its dot ("bert.")
    layers: str  # the layer list under the encoder ("encoder.layer")
    linears: Mapping[str, str]  # a layer's Linears: ours -> theirs
    targets: Mapping[str, tuple[str, ...]]  # PEFT target names (a module name or a path suffix) -> our last names
    heads: Mapping[str, str]  # the head model's modules outside the layers (paths from its root) -> ours
    # PEFT modules_to_save names -> the heads of ours they copy (a name not here: ours alike)
    saves: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # a layer's fused Linears: theirs -> our parts in its row order (ModernBERT's attn.Wqkv -> q, k, v)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def module_paths(names: EncoderNames, config: TransformerConfig) -> dict[str, str | tuple[str, ...]]:
    """The HF model's module paths (as PEFT saves them) -> ours (a fused module's: our parts), for the model of
    ``config``: the head model's with a classification head, else the headless model's (its pooler: pooler.dense)."""
    layers = _layers(names, config.n_layers)
    if getattr(config, "num_labels", 0):
        return {names.prefix + path: ours for path, ours in layers.items()} | _heads(names, config)
    return layers | {"pooler.dense": "pooler"}


def _heads(names: EncoderNames, config: TransformerConfig) -> dict[str, str]:
    """The head model's modules -> ours: ``names.heads``; a token head's are its ``classifier`` and, where ours has a
    pooler, the head's dense and norm (ModernBERT's head.dense, head.norm)."""
    if getattr(config, "head", "sequence") != "token":
        return dict(names.heads)
    pooled = getattr(config, "pooler", False)
    return {theirs: ours for theirs, ours in names.heads.items() if ours in ("pooler", "head_norm") and pooled} | {
        "classifier": "classifier"}


def _layers(names: EncoderNames, n_layers: int) -> dict[str, str | tuple[str, ...]]:
    fused = {f"{names.layers}.{i}.{theirs}": tuple(f"encoder.layers.{i}.{part}" for part in parts)
             for i in range(n_layers) for theirs, parts in names.fused.items()}
    return fused | {f"{names.layers}.{i}.{theirs}": f"encoder.layers.{i}.{ours}"
                    for i in range(n_layers) for ours, theirs in names.linears.items()}


def _adapter_config(names: EncoderNames, d: dict[str, Any]) -> dict[str, Any]:
    d = peft_targets(d, names.targets, names.model)
    saves = d.get("modules_to_save")
    if isinstance(saves, list) and all(isinstance(s, str) for s in saves):  # else LoRAConfig names what is wrong
        d = {**d, "modules_to_save": list(dict.fromkeys(o for s in saves for o in names.saves.get(s, (s,))))}
    return d


def _adapter_tensors(names: EncoderNames, tensors: dict[str, torch.Tensor], model: TransformerConfig
                     ) -> dict[str, torch.Tensor]:
    paths = module_paths(names, model)
    if getattr(model, "num_labels", 0):  # an adapter of the headless model: the same encoder layers
        paths |= _layers(names, model.n_layers)
    else:  # the encoder's names under a head model
        paths |= {names.prefix + path: ours for path, ours in paths.items()}
    adapted = {name for ours in names.targets.values() for name in ours}  # a LoRA's modules (not the classifier)
    ours = {}
    for key, t in tensors.items():
        lora = _LORA_KEY.fullmatch(key)
        match = lora or _COPY_KEY.fullmatch(key)
        path = paths.get(match[1], "") if match else ""
        if isinstance(path, tuple) and lora:  # a fused Linear: A shared by its parts, B's rows split among them
            pieces = [t] * len(path) if match[2] == "lora_A.weight" else split_b(key, t, path, model)
            ours |= {f"{KEY_PREFIX}{part}.{match[2]}": piece for part, piece in zip(path, pieces, strict=True)}
            continue
        # a copy is of a head (ours: pooler, head_norm, classifier), never of a layer's Linear
        if not isinstance(path, str) or not path or (path.rpartition(".")[2] not in adapted if lora else "." in path):
            raise unmapped_tensor(key, names.model, names.targets)
        ours[f"{KEY_PREFIX}{path}.{match[2]}"] = t
    return ours


def _to_peft(names: EncoderNames, config: LoRAConfig, tensors: dict[str, torch.Tensor], model: TransformerConfig
             ) -> PeftFiles:
    """Our adapter as PEFT's on the model ours was imported from; modules_to_save: the PEFT names that copy our
    copied heads. task_type stays None: PEFT's SEQ_CLS would add the head to modules_to_save. The parts of a fused
    Linear go back as one LoRA (see the module)."""
    paths = module_paths(names, model)
    theirs_of = {ours: theirs for theirs, ours in paths.items() if isinstance(ours, str)}
    fused_of = {part: (theirs, parts) for theirs, parts in paths.items() if isinstance(parts, tuple) for part in parts}
    theirs, copied = {}, []
    fused: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # a fused module -> our part -> its A, B
    for key, t in tensors.items():
        lora = _LORA_KEY.fullmatch(key)
        match = lora or _COPY_KEY.fullmatch(key)
        if lora is not None and match[1] in fused_of:
            kind = match[2].removeprefix("lora_")[0]  # "A" or "B"
            fused.setdefault(fused_of[match[1]][0], {}).setdefault(match[1], {})[kind] = t
            continue
        if match is None or match[1] not in theirs_of:
            raise unmapped_tensor(key, names.model, [*names.linears, *names.fused, *names.heads.values()])
        theirs[f"{KEY_PREFIX}{theirs_of[match[1]]}.{match[2]}"] = t
        if lora is None:
            copied.append(match[1])
    grow = max((len(paths[module]) for module in fused), default=1)
    for module, pairs in fused.items():
        ab = fuse(paths[module], pairs, model)
        theirs |= {f"{KEY_PREFIX}{module}.lora_{kind}.weight": ab[kind] for kind in "AB"}
    r = grow * config.r
    for key, t in theirs.items():  # every LoRA to rank grow r: zero rows of A, zero columns of B
        if key.endswith(".lora_A.weight"):
            theirs[key] = F.pad(t, (0, 0, 0, r - t.shape[0]))
        elif key.endswith(".lora_B.weight"):
            theirs[key] = F.pad(t, (0, r - t.shape[1]))
    saves = [next((s for s, ours in names.saves.items() if head in ours), head) for head in copied]
    return peft_files(config, theirs, None, modules_to_save=sorted(set(saves)) or None, r=r,
                      lora_alpha=grow * config.lora_alpha)


def adapter_layout(names: EncoderNames) -> AdapterLayout:
    """The AdapterLayout of PEFT adapters on ``names``' architecture."""
    return AdapterLayout(config=partial(_adapter_config, names), tensors=partial(_adapter_tensors, names),
                         to_peft=partial(_to_peft, names))
