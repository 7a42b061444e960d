"""Export a checkpoint as a Hugging Face `transformers` model directory that loads without custom code.

seq2seq -> MarianMTModel, causal_lm -> GPT2LMHeadModel, classifier -> BertForSequenceClassification,
when the config matches the architecture exactly; any other config is refused, naming the field.
Only torch, safetensors and tokenizers are used: config.json and model.safetensors are written here
in HF's naming, so exporting does not need `transformers` installed.

Marian's positions: HF rebuilds its sinusoidal table on load (the checkpoint holds none) with sin in
the first half of the dimensions and cos in the second, where ours interleaves them
(PE(pos, 2i) = sin, PE(pos, 2i+1) = cos). The export permutes the model dimension, HF dim k = our
dim perm[k] with perm = (0, 2, 4, ..., 1, 3, 5, ...), in every tensor indexed by it: the embedding
columns, the input columns of q/k/v/fc1, the output rows and biases of out_proj/fc2, and every
LayerNorm. All operations are equivariant under it (LayerNorm statistics ignore the order; head and
fc1 dimensions are not permuted), so the permuted weights give the same logits with HF's table.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors
from torch import nn

from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.config import TransformerConfig
from model.layers import TransformerLayer
from model.tokenizer import SPECIAL_TOKENS, Tokenizer
from training.errors import UserError

logger = logging.getLogger(__name__)

ARCHITECTURES = {
    "seq2seq": "MarianMTModel",
    "causal_lm": "GPT2LMHeadModel",
    "classifier": "BertForSequenceClassification",
}
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}  # all exact in transformers
Tensors = dict[str, torch.Tensor]


class ExportError(UserError):
    """The checkpoint cannot be expressed exactly by the target architecture, or the output is in the way."""


@dataclass(frozen=True)
class Need:
    """A config field value an architecture hard-codes."""

    field: str
    value: Any
    meaning: str


NEEDS: dict[str, tuple[Need, ...]] = {
    "seq2seq": (
        Need("positions", "sinusoidal", "sinusoidal positions"),
        Need("norm", "post", "post-LN"),
        Need("bias", True, "biases in every projection"),
        Need("embedding_norm", False, "no embedding LayerNorm"),
        Need("final_norm", False, "no final LayerNorm"),
        Need("layer_norm_eps", 1e-5, "LayerNorm eps 1e-5"),
        Need("tie_embeddings", True, "the output projection tied to the embeddings"),
        Need("src_vocab_size", None, "one vocabulary shared by source and target"),
    ),
    "causal_lm": (
        Need("positions", "learned", "learned positions"),
        Need("norm", "pre", "pre-LN"),
        Need("final_norm", True, "a final LayerNorm"),
        Need("bias", True, "biases in every projection"),
        Need("scale_embeddings", False, "unscaled embeddings"),
        Need("embedding_norm", False, "no embedding LayerNorm"),
    ),
    "classifier": (
        Need("positions", "learned", "learned positions"),
        Need("norm", "post", "post-LN"),
        Need("final_norm", False, "no final LayerNorm"),
        Need("bias", True, "biases in every projection"),
        Need("scale_embeddings", False, "unscaled embeddings"),
        Need("embedding_norm", True, "an embedding LayerNorm"),
        Need("pooler", True, "the dense + tanh pooler"),
    ),
}


def check_exportable(config: TransformerConfig) -> str:
    """The HF architecture for ``config``; raises ExportError naming the first field that does not fit."""
    architecture = ARCHITECTURES[config.family]
    for need in NEEDS[config.family]:
        actual = getattr(config, need.field)
        if actual != need.value:
            raise ExportError(
                f"{need.field}={actual!r} but {architecture} needs {need.meaning} ({need.field}={need.value!r})"
            )
    if config.pad_id != Tokenizer.pad_id:
        raise ExportError(f"pad_id={config.pad_id} but the exported tokenizer pads with id {Tokenizer.pad_id}")
    return architecture


def export_hf(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write checkpoint directory ``checkpoint`` as an HF model directory ``out``; returns ``out``."""
    try:
        ckpt = load_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    architecture = check_exportable(ckpt.config)
    if ckpt.source_tokenizer is not None:
        raise ExportError(f"{architecture} export needs one tokenizer; the checkpoint has a separate source tokenizer")
    config, tensors = BUILDERS[ckpt.family](ckpt)
    config = {"architectures": [architecture], "dtype": "float32", **config}
    files = {"config.json": _json(config), **tokenizer_files(ckpt)}
    generation = generation_config(ckpt.config)
    if generation is not None:
        files["generation_config.json"] = _json(generation)
    out = Path(out)
    _write_dir(out, files, tensors, overwrite)
    logger.info(
        "exported %s checkpoint %s as %s to %s (%d tensors)", ckpt.family, checkpoint, architecture, out, len(tensors)
    )
    return out


# ---- weights ----------------------------------------------------------------------------------


def _linear(
    prefix: str, linear: nn.Linear, inputs: torch.Tensor | None = None, outputs: torch.Tensor | None = None
) -> Tensors:
    """``prefix``weight/bias, with the input columns and/or the output rows reordered by a permutation."""
    weight, bias = linear.weight, linear.bias
    if inputs is not None:
        weight = weight[:, inputs]
    if outputs is not None:
        weight = weight[outputs]
        bias = bias[outputs]
    return {f"{prefix}weight": weight, f"{prefix}bias": bias}


def _norm(prefix: str, norm: nn.LayerNorm, perm: torch.Tensor | None = None) -> Tensors:
    if perm is None:
        return {f"{prefix}weight": norm.weight, f"{prefix}bias": norm.bias}
    return {f"{prefix}weight": norm.weight[perm], f"{prefix}bias": norm.bias[perm]}


def _marian_attention(prefix: str, attn: nn.Module, perm: torch.Tensor, shift: torch.Tensor | None) -> Tensors:
    """q/k/v/out_proj; with ``shift``, the inputs arrive as x - shift and the biases restore x + attn(x)."""
    tensors = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        linear = getattr(attn, name)
        bias = linear.bias if shift is None else linear.bias + linear.weight @ shift
        tensors |= {f"{prefix}{name}.weight": linear.weight[:, perm], f"{prefix}{name}.bias": bias}
    out_bias = attn.out_proj.bias if shift is None else attn.out_proj.bias + shift  # post-LN: the residual
    return tensors | {f"{prefix}out_proj.weight": attn.out_proj.weight[perm], f"{prefix}out_proj.bias": out_bias[perm]}


def _marian_layer(prefix: str, layer: TransformerLayer, perm: torch.Tensor, shift: torch.Tensor | None) -> Tensors:
    tensors = _marian_attention(f"{prefix}self_attn.", layer.self_attn, perm, shift)
    tensors |= _norm(f"{prefix}self_attn_layer_norm.", layer.self_attn_norm, perm)
    if layer.cross_attn is not None:
        tensors |= _marian_attention(f"{prefix}encoder_attn.", layer.cross_attn, perm, None)
        tensors |= _norm(f"{prefix}encoder_attn_layer_norm.", layer.cross_attn_norm, perm)
    tensors |= _linear(f"{prefix}fc1.", layer.ffn.fc1, inputs=perm)
    tensors |= _linear(f"{prefix}fc2.", layer.ffn.fc2, outputs=perm)
    return tensors | _norm(f"{prefix}final_layer_norm.", layer.ffn_norm, perm)


def marian_permutation(d_model: int) -> torch.Tensor:
    """perm with HF Marian's positional dim k = our dim perm[k]: the sin dims (even) first, then the cos dims."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _marian(ckpt: Checkpoint) -> tuple[dict[str, Any], Tensors]:
    model, c = ckpt.model, ckpt.config
    perm = marian_permutation(c.d_model)
    embed = model.tgt_embed.tokens.weight
    start = embed[c.bos_id] * model.tgt_embed.scale  # what BOS adds to the decoder's first input

    def rows(weight: torch.Tensor) -> torch.Tensor:  # (V, D) -> (V + 1, D), HF's dim order
        return torch.cat([weight, weight.new_zeros(1, c.d_model)])[:, perm]

    tensors = {
        "model.encoder.embed_tokens.weight": rows(embed),
        "model.decoder.embed_tokens.weight": rows(embed - embed[c.bos_id]),  # BOS -> the zero vector
        "lm_head.weight": rows(model.lm_head.weight),
        "final_logits_bias": torch.cat([torch.zeros(1, c.vocab_size), torch.full((1, 1), float("-inf"))], dim=1),
    }
    for side, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        for i, layer in enumerate(stack.layers):
            shift = start if side == "decoder" and i == 0 else None
            tensors |= _marian_layer(f"model.{side}.layers.{i}.", layer, perm, shift)
    config = {
        "model_type": "marian",
        "vocab_size": c.vocab_size + 1,
        "decoder_vocab_size": c.vocab_size + 1,
        "d_model": c.d_model,
        "encoder_layers": c.n_encoder_layers,
        "decoder_layers": c.n_decoder_layers,
        "encoder_attention_heads": c.n_heads,
        "decoder_attention_heads": c.n_heads,
        "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.d_ff,
        "activation_function": HF_ACTIVATIONS[c.activation],
        "max_position_embeddings": c.max_len,
        "scale_embedding": c.scale_embeddings,
        "dropout": c.dropout,
        "attention_dropout": c.dropout,
        "activation_dropout": c.dropout,
        "share_encoder_decoder_embeddings": False,
        "tie_word_embeddings": False,
        "is_encoder_decoder": True,
        "pad_token_id": c.pad_id,
        "bos_token_id": c.bos_id,
        "eos_token_id": c.eos_id,
        "decoder_start_token_id": c.bos_id,
        "forced_eos_token_id": None,
    }
    return config, tensors


def _gpt2(ckpt: Checkpoint) -> tuple[dict[str, Any], Tensors]:
    model, c = ckpt.model, ckpt.config
    tensors = {
        "transformer.wte.weight": model.embed.tokens.weight,
        "transformer.wpe.weight": model.embed.positions.weight,
    }
    for i, layer in enumerate(model.decoder.layers):
        p, attn = f"transformer.h.{i}.", layer.self_attn
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        # Conv1D stores (in, out): nn.Linear weights transposed; c_attn is q, k, v side by side.
        tensors |= {
            f"{p}attn.c_attn.weight": torch.cat([lin.weight for lin in qkv]).T,
            f"{p}attn.c_attn.bias": torch.cat([lin.bias for lin in qkv]),
            f"{p}attn.c_proj.weight": attn.out_proj.weight.T,
            f"{p}attn.c_proj.bias": attn.out_proj.bias,
            f"{p}mlp.c_fc.weight": layer.ffn.fc1.weight.T,
            f"{p}mlp.c_fc.bias": layer.ffn.fc1.bias,
            f"{p}mlp.c_proj.weight": layer.ffn.fc2.weight.T,
            f"{p}mlp.c_proj.bias": layer.ffn.fc2.bias,
        }
        tensors |= _norm(f"{p}ln_1.", layer.self_attn_norm) | _norm(f"{p}ln_2.", layer.ffn_norm)
    tensors |= _norm("transformer.ln_f.", model.decoder.final_norm)
    if not c.tie_embeddings:
        tensors["lm_head.weight"] = model.lm_head.weight
    config = {
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.max_len,
        "n_embd": c.d_model,
        "n_layer": c.n_layers,
        "n_head": c.n_heads,
        "n_inner": c.d_ff,
        "activation_function": HF_ACTIVATIONS[c.activation],
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "layer_norm_epsilon": c.layer_norm_eps,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": c.tie_embeddings,
        "pad_token_id": c.pad_id,
        "bos_token_id": c.bos_id,
        "eos_token_id": c.eos_id,
    }
    return config, tensors


def _bert(ckpt: Checkpoint) -> tuple[dict[str, Any], Tensors]:
    model, c = ckpt.model, ckpt.config
    embed = model.embed
    # BERT always adds a token-type embedding: a single zero row adds nothing when we have no segments.
    segments = embed.segments.weight if embed.segments is not None else torch.zeros(1, c.d_model)
    tensors = {
        "bert.embeddings.word_embeddings.weight": embed.tokens.weight,
        "bert.embeddings.position_embeddings.weight": embed.positions.weight,
        "bert.embeddings.token_type_embeddings.weight": segments,
        **_norm("bert.embeddings.LayerNorm.", embed.norm),
        **_linear("bert.pooler.dense.", model.pooler),
        **_linear("classifier.", model.classifier),
    }
    for i, layer in enumerate(model.encoder.layers):
        p, attn = f"bert.encoder.layer.{i}.", layer.self_attn
        tensors |= _linear(f"{p}attention.self.query.", attn.q_proj) | _linear(f"{p}attention.self.key.", attn.k_proj)
        tensors |= _linear(f"{p}attention.self.value.", attn.v_proj)
        tensors |= _linear(f"{p}attention.output.dense.", attn.out_proj)
        tensors |= _norm(f"{p}attention.output.LayerNorm.", layer.self_attn_norm)
        tensors |= _linear(f"{p}intermediate.dense.", layer.ffn.fc1) | _linear(f"{p}output.dense.", layer.ffn.fc2)
        tensors |= _norm(f"{p}output.LayerNorm.", layer.ffn_norm)
    labels = ckpt.labels or [f"LABEL_{i}" for i in range(c.num_labels)]
    config = {
        "model_type": "bert",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "intermediate_size": c.d_ff,
        "hidden_act": HF_ACTIVATIONS[c.activation],
        "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": c.dropout,
        "max_position_embeddings": c.max_len,
        "type_vocab_size": max(c.type_vocab_size, 1),
        "layer_norm_eps": c.layer_norm_eps,
        "pad_token_id": c.pad_id,
        "position_embedding_type": "absolute",
        "id2label": {str(i): name for i, name in enumerate(labels)},
        "label2id": {name: i for i, name in enumerate(labels)},
    }
    return config, tensors


BUILDERS = {"seq2seq": _marian, "causal_lm": _gpt2, "classifier": _bert}


# ---- tokenizer and generation config ----------------------------------------------------------


def tokenizer_files(ckpt: Checkpoint) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for PreTrainedTokenizerFast.

    Our pipelines encode sources and prompts without special tokens and classifier inputs as
    ``[CLS] a [SEP] (b [SEP])``; the classifier's tokenizer.json gets that template so
    ``tokenizer(a, b)`` gives the ids and token_type_ids the model was trained on.
    """
    c = ckpt.config
    backend = BackendTokenizer.from_str(ckpt.tokenizer.backend.to_str())  # a copy: ours stays untouched
    names = dict(zip(("pad", "bos", "eos", "unk", "cls", "sep", "mask"), SPECIAL_TOKENS, strict=True))
    special = {f"{k}_token": names[k] for k in ("pad", "bos", "eos", "unk")}
    inputs = ["input_ids", "attention_mask"]
    if c.family == "classifier":
        special |= {f"{k}_token": names[k] for k in ("cls", "sep", "mask")}
        inputs.insert(1, "token_type_ids")
        cls, sep = names["cls"], names["sep"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, Tokenizer.cls_id), (sep, Tokenizer.sep_id)],
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": c.max_src_len if c.family == "seq2seq" else c.max_len,
        "model_input_names": inputs,  # no token_type_ids for GPT-2 (it would add wte[0]) or Marian
        "padding_side": "left" if c.family == "causal_lm" else "right",  # batched generate() continues prompts
        "clean_up_tokenization_spaces": False,  # decode exactly as ours does
        **special,
    }
    return {
        "tokenizer.json": backend.to_str(pretty=True),
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(special),
    }


def generation_config(config: TransformerConfig) -> dict[str, Any] | None:
    """generation_config.json for the generative families: the ids that start, end and pad."""
    if config.family == "classifier":
        return None
    generation = {"bos_token_id": config.bos_id, "eos_token_id": config.eos_id, "pad_token_id": config.pad_id}
    if config.family == "seq2seq":
        generation |= {"decoder_start_token_id": config.bos_id, "forced_eos_token_id": None}
    return generation


# ---- output -----------------------------------------------------------------------------------


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


def _write_dir(out: Path, files: dict[str, str], tensors: Tensors, overwrite: bool) -> None:
    """Write everything into a temporary sibling, then rename it to ``out``."""
    if out.exists() and not (out.is_dir() and (overwrite or not any(out.iterdir()))):
        raise ExportError(f"{out} already exists and is not an empty directory (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weights = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in tensors.items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp creates 0700
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
