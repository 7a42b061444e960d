"""GPT2LMHeadModel (and GPT2Model, whose head is the tied embedding) -> our causal_lm, and its PEFT adapters.

GPT-2 is pre-LN with a final LayerNorm, learned positions, unscaled embeddings and tanh-approximated GELU.
Its projections are Conv1D: the weight is stored (in, out), nn.Linear's transposed, and ``c_attn`` holds
q, k and v side by side in its output dimension.

A PEFT LoRA adapter on GPT-2 targets ``c_attn``, ``c_proj`` and ``c_fc``. Its A and B are nn.Linear-shaped
whatever the base (``fan_in_fan_out`` only orients a merge into Conv1D weights), so ``c_attn``'s update
B A x splits by B's rows into q, k and v updates sharing A: ADAPTER_LAYOUT renames onto our modules. Ours
(trained by ``python -m training lora``) go back as one rank-3r LoRA on c_attn (``_to_peft``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from model.config import CausalLMConfig, TransformerConfig
from model.hf.common import HFImportError, Tensors, Unsupported, activation, check_supported, field, strip_prefix, take
from model.lora_config import LoRAConfig
from model.lora_io import KEY_PREFIX, AdapterLayout, PeftFiles, peft_files, peft_targets, unmapped_tensor

ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
RULES = (
    Unsupported("scale_attn_weights", (True,), "attention scores unscaled by 1/sqrt(head_dim)"),
    Unsupported("scale_attn_by_inverse_layer_idx", (False,), "attention scores scaled per layer"),
    Unsupported("add_cross_attention", (False,), "cross-attention layers"),
)
QKV = ("q_proj", "k_proj", "v_proj")  # our Linears of c_attn's output, in its order


def to_config(hf: Mapping[str, Any]) -> CausalLMConfig:
    """Our config for GPT-2's config.json (HFImportError naming a field we cannot express)."""
    check_supported(hf, RULES, "GPT-2")
    d_model = field(hf, "n_embd", default=768)
    vocab = field(hf, "vocab_size", default=50257)
    eos = field(hf, "eos_token_id", default=50256)
    ids = {"eos_token_id": eos, "bos_token_id": field(hf, "bos_token_id", default=50256),
           "pad_token_id": field(hf, "pad_token_id", default=eos)}  # GPT-2 has no pad token: rows end at eos
    for name, value in ids.items():
        if not 0 <= value < vocab:
            raise HFImportError(f"config.json: {name}={value} is outside the vocabulary (vocab_size={vocab})")
    return CausalLMConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_heads=field(hf, "n_head", default=12),
        d_ff=field(hf, "n_inner", default=4 * d_model),
        dropout=0.0,
        max_len=field(hf, "n_positions", default=1024),
        positions="learned",
        norm="pre",
        activation=activation(hf, "activation_function", "gelu_new"),
        bias=True,
        scale_embeddings=False,
        tie_embeddings=field(hf, "tie_word_embeddings", bool, True),
        final_norm=True,
        layer_norm_eps=field(hf, "layer_norm_epsilon", float, 1e-5),
        pad_id=ids["pad_token_id"],
        n_layers=field(hf, "n_layer", default=12),
        bos_id=ids["bos_token_id"],
        eos_id=eos,
    )


def state_dict(c: CausalLMConfig, tensors: Tensors) -> Tensors:
    """Our CausalLM's state dict from GPT-2's tensors (shapes checked)."""
    t = strip_prefix(tensors, "transformer.")
    d, ff = c.d_model, c.d_ff
    embed = take(t, "wte.weight", (c.vocab_size, d))
    ours = {"embed.tokens.weight": embed, "embed.positions.weight": take(t, "wpe.weight", (c.max_len, d))}
    for i in range(c.n_layers):
        p, q = f"h.{i}.", f"decoder.layers.{i}."
        qkv, qkv_bias = take(t, f"{p}attn.c_attn.weight", (d, 3 * d)).T, take(t, f"{p}attn.c_attn.bias", (3 * d,))
        for j, name in enumerate(QKV):
            ours[f"{q}self_attn.{name}.weight"] = qkv[j * d : (j + 1) * d]
            ours[f"{q}self_attn.{name}.bias"] = qkv_bias[j * d : (j + 1) * d]
        conv1d = {"self_attn.out_proj": ("attn.c_proj", d, d), "ffn.fc1": ("mlp.c_fc", d, ff),
                  "ffn.fc2": ("mlp.c_proj", ff, d)}
        for name, (theirs, n_in, n_out) in conv1d.items():
            ours[f"{q}{name}.weight"] = take(t, f"{p}{theirs}.weight", (n_in, n_out)).T
            ours[f"{q}{name}.bias"] = take(t, f"{p}{theirs}.bias", (n_out,))
        for name, theirs in (("self_attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
            ours |= _norm(t, f"{p}{theirs}.", f"{q}{name}.", d)
    ours |= _norm(t, "ln_f.", "decoder.final_norm.", d)
    ours["lm_head.weight"] = embed if c.tie_embeddings else take(t, "lm_head.weight", (c.vocab_size, d))
    return ours


def _norm(t: Tensors, theirs: str, ours: str, d: int) -> Tensors:
    return {f"{ours}weight": take(t, f"{theirs}weight", (d,)), f"{ours}bias": take(t, f"{theirs}bias", (d,))}


# PEFT's target names (a module name, or a suffix of its path) -> our modules' last names
_ADAPTER_TARGETS = {
    "c_attn": QKV, "attn.c_attn": QKV,
    "c_proj": ("out_proj", "fc2"), "attn.c_proj": ("out_proj",), "mlp.c_proj": ("fc2",),
    "c_fc": ("fc1",), "mlp.c_fc": ("fc1",),
}
_ADAPTER_KEY = re.compile(r"base_model\.model\.(?:transformer\.)?h\.(\d+)\."
                          r"(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.lora_([AB])\.weight")
_ADAPTER_MODULES = {"attn.c_proj": "self_attn.out_proj", "mlp.c_fc": "ffn.fc1", "mlp.c_proj": "ffn.fc2"}


def _adapter_config(d: dict[str, Any]) -> dict[str, Any]:
    return {**peft_targets(d, _ADAPTER_TARGETS, "GPT-2"), "fan_in_fan_out": False}


def _adapter_tensors(tensors: dict[str, torch.Tensor], model: TransformerConfig) -> dict[str, torch.Tensor]:
    ours = {}
    for key, t in tensors.items():
        match = _ADAPTER_KEY.fullmatch(key)
        if match is None:
            raise unmapped_tensor(key, "GPT-2", _ADAPTER_TARGETS)
        layer, module, kind = match.groups()
        prefix = f"base_model.model.decoder.layers.{layer}."
        if module != "attn.c_attn":
            ours[f"{prefix}{_ADAPTER_MODULES[module]}.lora_{kind}.weight"] = t
            continue
        parts = [t] * 3 if kind == "A" else list(t.chunk(3))  # B's rows: q, k, v (a wrong shape is named later)
        for name, part in zip(QKV, parts, strict=True):
            ours[f"{prefix}self_attn.{name}.lora_{kind}.weight"] = part.contiguous()
    return ours


# our modules of a layer -> GPT-2's (the inverse of _ADAPTER_MODULES; q, k and v all in c_attn)
_HF_MODULES = {ours: theirs for theirs, ours in _ADAPTER_MODULES.items()} | {f"self_attn.{n}": "attn.c_attn"
                                                                            for n in QKV}
_OUR_KEY = re.compile(rf"base_model\.model\.decoder\.layers\.(\d+)\.({'|'.join(map(re.escape, _HF_MODULES))})"
                      r"\.lora_([AB])\.weight")


def _to_peft(config: LoRAConfig, tensors: dict[str, torch.Tensor], model: TransformerConfig) -> PeftFiles:
    """Our adapter as PEFT's on GPT2LMHeadModel (``transformer.`` paths; Conv1D: fan_in_fan_out). A layer's q, k
    and v LoRAs become one of rank 3r on c_attn, exactly: A stacks their A's, B holds their B's block-diagonally
    (zeros for one not adapted) and lora_alpha triples with r, keeping the scaling; PEFT has one rank per adapter,
    so the other modules' A and B are padded with zeros to rank 3r."""
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = defaultdict(dict)  # (layer, our module) -> A and B
    for key, t in tensors.items():
        match = _OUR_KEY.fullmatch(key)
        if match is None:
            raise unmapped_tensor(key, "GPT-2", _HF_MODULES)
        layer, module, kind = match.groups()
        pairs[layer, module][kind] = t
    r, d = config.r, model.d_model
    grow = 3 if any(_HF_MODULES[module] == "attn.c_attn" for _, module in pairs) else 1
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, dict[str, torch.Tensor]]] = defaultdict(dict)  # layer -> q/k/v -> A and B
    for (layer, module), ab in pairs.items():
        prefix = f"{KEY_PREFIX}transformer.h.{layer}.{_HF_MODULES[module]}"
        if _HF_MODULES[module] == "attn.c_attn":
            fused[layer][module.removeprefix("self_attn.")] = ab
            continue
        out[f"{prefix}.lora_A.weight"] = F.pad(ab["A"], (0, 0, 0, (grow - 1) * r))  # zero rows
        out[f"{prefix}.lora_B.weight"] = F.pad(ab["B"], (0, (grow - 1) * r))  # zero columns
    for layer, qkv in fused.items():
        dtype = next(iter(qkv.values()))["A"].dtype
        missing = {"A": torch.zeros(r, d, dtype=dtype), "B": torch.zeros(d, r, dtype=dtype)}
        blocks = [qkv.get(name, missing) for name in QKV]
        prefix = f"{KEY_PREFIX}transformer.h.{layer}.attn.c_attn"
        out[f"{prefix}.lora_A.weight"] = torch.cat([b["A"] for b in blocks])
        out[f"{prefix}.lora_B.weight"] = torch.block_diag(*(b["B"] for b in blocks))
    return peft_files(config, out, "CAUSAL_LM", r=grow * r, lora_alpha=grow * config.lora_alpha, fan_in_fan_out=True)


ADAPTER_LAYOUT = AdapterLayout(config=_adapter_config, tensors=_adapter_tensors, to_peft=_to_peft)

