"""PEFT LoRA adapters on Llama-family bases (Llama, and the importers sharing its module names) <-> ours.

PEFT names a LlamaForCausalLM's projections ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` and
``model.layers.{i}.mlp.{gate,up,down}_proj``; an importer's ``PROJECTIONS`` (model/hf/llama.py) maps them onto our
blocks, and a LoRA's A and B follow their Linear there unchanged (o_proj -> self_attn.out_proj, gate_proj -> ffn.fc1,
up_proj -> ffn.up, down_proj -> ffn.fc2). ``lm_head`` may be a LoRA target too (a Linear like the others; PEFT then
saves the head's own weight beside it, which model.lora_io takes when it is the base's). ``lm_head`` and
``embed_tokens`` may be in modules_to_save: the adapter's own copies (model.lora_layers.HeadCopies; our
``lm_head`` and ``embed.tokens``). Refused by name: LoRA on ``embed_tokens`` (PEFT's lora_embedding_A/B) and
other modules_to_save. :func:`adapter_layout` builds the layout for one importer's names.

A fused module (Phi-3's ``qkv_proj``, ``gate_up_proj``) is one LoRA whose B's rows split into the parts' (q, k, v;
the gate, up): the parts share its A (as GPT-2's c_attn in model/hf/gpt2.py). Ours go back as one LoRA on the fused
module of rank k r (A stacked, B block-diagonal, zeros for a part not adapted, lora_alpha times k: the scaling kept);
PEFT has one rank per adapter, so every other LoRA of the adapter is padded with zeros to the largest such rank.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from model.config import TransformerConfig
from model.lora_config import AdapterError, LoRAConfig, quote
from model.lora_io import KEY_PREFIX, AdapterLayout, PeftFiles, peft_files, peft_targets, unmapped_tensor

HEAD = "lm_head"  # the same path in PEFT's LlamaForCausalLM and in our CausalLM
# the key of an adapter's copy of the token embeddings: PEFT's, ours
EMBEDDINGS = (f"{KEY_PREFIX}model.embed_tokens.weight", f"{KEY_PREFIX}embed.tokens.weight")
COPIES = {HEAD: HEAD, "embed_tokens": "tokens"}  # modules_to_save names: PEFT's -> ours (model.lora_config.HEADS)
NO_EMBEDDING_LORA = "LoRA on embed_tokens is not supported (put embed_tokens in modules_to_save instead)"
# the output rows of our Linears that a fused module's B splits into, by their last name
ROWS = {"q_proj": lambda c: c.n_heads * c.head_dim, "k_proj": lambda c: c.kv_heads * c.head_dim,
        "v_proj": lambda c: c.kv_heads * c.head_dim, "fc1": lambda c: c.d_ff, "up": lambda c: c.d_ff}


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]


def split_b(key: str, b: torch.Tensor, parts: tuple[str, ...], model: TransformerConfig) -> list[torch.Tensor]:
    """A fused module's B, its rows split into its parts' (our paths in a layer, in the fused order)."""
    rows = [ROWS[_leaf(part)](model) for part in parts]
    if b.dim() != 2 or b.shape[0] != sum(rows):
        raise AdapterError(f"tensor {quote(key)} has shape {tuple(b.shape)}: expected {sum(rows)} rows "
                           f"({' + '.join(map(str, rows))} for {', '.join(parts)})")
    return [part.contiguous() for part in b.split(rows)]


def fuse(parts: tuple[str, ...], pairs: Mapping[str, Mapping[str, torch.Tensor]], model: TransformerConfig
          ) -> dict[str, torch.Tensor]:
    """One LoRA of rank len(parts) r for the parts' LoRAs (our paths -> their A and B; a part missing adds zeros)."""
    some = next(iter(pairs.values()))
    a, b = [], []
    for part in parts:
        pair = pairs.get(part)
        a.append(pair["A"] if pair else torch.zeros_like(some["A"]))
        b.append(pair["B"] if pair else some["B"].new_zeros(ROWS[_leaf(part)](model), some["B"].shape[1]))
    return {"A": torch.cat(a), "B": torch.block_diag(*b)}


class _Names:
    """PEFT's names of a Llama-style importer's LoRAs and ours, both ways (see the module)."""

    def __init__(self, projections: Mapping[str, str | tuple[str, ...]], architecture: str) -> None:
        self.parts = {theirs: (ours,) if isinstance(ours, str) else tuple(ours) for theirs, ours in projections.items()}
        self.architecture = architecture
        self.targets = {HEAD: (HEAD,)}  # PEFT's target names (a module name, or a suffix of its path) -> our last names
        for theirs, ours in self.parts.items():
            self.targets[theirs] = self.targets[_leaf(theirs)] = tuple(map(_leaf, ours))
        self.module_of = {part: theirs for theirs, ours in self.parts.items() for part in ours}  # ours -> PEFT's
        self.layer_key = re.compile(rf"{re.escape(KEY_PREFIX)}(?:model\.)?layers\.(\d+)\."
                                    rf"({'|'.join(map(re.escape, self.parts))})\.lora_([AB])\.weight")
        self.our_key = re.compile(rf"{re.escape(KEY_PREFIX)}decoder\.layers\.(\d+)\."
                                  rf"({'|'.join(map(re.escape, self.module_of))})\.lora_([AB])\.weight")
        self.head_key = re.compile(rf"{re.escape(KEY_PREFIX)}{HEAD}\.(?:lora_[AB]\.weight|base_layer\.weight|weight)")

    def config(self, d: dict[str, Any]) -> dict[str, Any]:
        """adapter_config.json's targets and modules_to_save as our names."""
        listed = d.get("target_modules")
        if isinstance(listed, list) and any(isinstance(t, str) and _leaf(t) == "embed_tokens" for t in listed):
            raise AdapterError(f"target_modules {quote(listed)}: {NO_EMBEDDING_LORA}")
        d = peft_targets(d, self.targets, self.architecture)
        saved = d.get("modules_to_save")
        if not isinstance(saved, list) or not all(isinstance(m, str) for m in saved):
            return d  # None, or a malformed value model.lora_config names
        unknown = [m for m in saved if _leaf(m) not in COPIES]
        if unknown:
            raise AdapterError(f"modules_to_save {quote(unknown)} is not supported for {self.architecture} "
                               f"(supported: {', '.join(COPIES)})")
        return {**d, "modules_to_save": sorted({COPIES[_leaf(m)] for m in saved})}

    def tensors(self, found: dict[str, torch.Tensor], model: TransformerConfig) -> dict[str, torch.Tensor]:
        """PEFT's tensors under our keys; a fused module's B split into its parts', which share its A."""
        ours = {}
        for key, t in found.items():
            if self.head_key.fullmatch(key):
                ours[key] = t
                continue
            if key == EMBEDDINGS[0]:  # the adapter's own copy of the embeddings
                ours[EMBEDDINGS[1]] = t
                continue
            if "lora_embedding_" in key or ".embed_tokens.base_layer." in key:
                raise AdapterError(f"tensor {quote(key)}: {NO_EMBEDDING_LORA}")
            match = self.layer_key.fullmatch(key)
            if match is None:
                raise unmapped_tensor(key, self.architecture, self.targets)
            layer, module, kind = match.groups()
            parts = self.parts[module]
            pieces = [t] * len(parts) if kind == "A" or len(parts) == 1 else split_b(key, t, parts, model)
            for part, piece in zip(parts, pieces, strict=True):
                ours[f"{KEY_PREFIX}decoder.layers.{layer}.{part}.lora_{kind}.weight"] = piece
        return ours

    def to_peft(self, lora: LoRAConfig, tensors: dict[str, torch.Tensor], model: TransformerConfig) -> PeftFiles:
        """Our adapter as PEFT's on the HF model: its names; a fused module's parts as one LoRA (see the module)."""
        theirs: dict[str, torch.Tensor] = {}
        modules: dict[tuple[str, str], dict[str, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
        for key, t in tensors.items():
            if self.head_key.fullmatch(key):
                theirs[key] = t
            elif key == EMBEDDINGS[1]:
                theirs[EMBEDDINGS[0]] = t
            elif match := self.our_key.fullmatch(key):
                layer, part, kind = match.groups()
                modules[layer, self.module_of[part]][part][kind] = t  # (layer, PEFT's module) -> our part -> A, B
            else:
                raise unmapped_tensor(key, self.architecture, self.module_of)
        grow = max((len(self.parts[module]) for _, module in modules), default=1)
        for (layer, module), pairs in modules.items():
            ab = fuse(self.parts[module], pairs, model)
            for kind in "AB":
                theirs[f"{KEY_PREFIX}model.layers.{layer}.{module}.lora_{kind}.weight"] = ab[kind]
        r = grow * lora.r
        for key, t in theirs.items():  # every LoRA to rank grow r: zero rows of A, zero columns of B
            if key.endswith(".lora_A.weight"):
                theirs[key] = F.pad(t, (0, 0, 0, r - t.shape[0]))
            elif key.endswith(".lora_B.weight"):
                theirs[key] = F.pad(t, (0, r - t.shape[1]))
        to_hf = {ours: hf for hf, ours in COPIES.items()}
        saved = [to_hf[m] for m in lora.modules_to_save or ()]
        return peft_files(lora, theirs, "CAUSAL_LM", r=r, lora_alpha=grow * lora.lora_alpha,
                          modules_to_save=saved or None)


def adapter_layout(projections: Mapping[str, str | tuple[str, ...]], architecture: str) -> AdapterLayout:
    """The AdapterLayout of a Llama-style importer whose layers' ``projections`` map PEFT's path in a layer to ours
    (``mlp.gate_proj`` -> ``ffn.fc1``), or to our parts of a fused module in its row order (``mlp.gate_up_proj`` ->
    (``ffn.fc1``, ``ffn.up``)); ``architecture`` names it in errors."""
    names = _Names(projections, architecture)
    return AdapterLayout(config=names.config, tensors=names.tensors, to_peft=names.to_peft)


def fused_projections(projections: Mapping[str, str], fused: Mapping[str, tuple[str, ...]]
                      ) -> dict[str, str | tuple[str, ...]]:
    """``projections`` (a Llama-style importer's) with the modules a checkpoint fuses replaced by the fused ones:
    ``fused`` maps a fused module's path in a layer to the paths of its parts in ``projections``, in row order."""
    parts = {part for group in fused.values() for part in group}
    return {**{theirs: ours for theirs, ours in projections.items() if theirs not in parts},
            **{module: tuple(projections[part] for part in group) for module, group in fused.items()}}
