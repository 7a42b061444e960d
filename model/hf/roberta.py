"""RobertaModel / RobertaForSequenceClassification and XLM-RoBERTa's (the same weights) -> our classifier.

RoBERTa is BERT's encoder (bert.py) with three differences: positions count the non-pad tokens from
``pad_token_id + 1`` (``position_offset``: a left-padded row starts where a right-padded one does, as
transformers computes them from the input ids), one token type (or the one BERT has), and a classification head
``dense -> tanh -> out_proj`` on <s> without a pooler, which is our pooler (tanh) and classifier: classifier.dense
maps onto ``pooler``, classifier.out_proj onto ``classifier``. A RobertaModel keeps its own pooler when it saved one.
XLM-RoBERTa differs only in its tokenizer (a SentencePiece Unigram converted to tokenizer.json). PEFT adapters map as
BERT's (ADAPTER_LAYOUT, model.hf.encoder_adapters) under ``roberta.``, the head's two Linears onto our pooler and
classifier; a SEQ_CLS adapter's copy of ``classifier`` (modules_to_save) is a copy of both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.config import ClassifierConfig
from model.hf import bert
from model.hf.common import Tensors, check_supported, field, strip_prefix
from model.hf.encoder_adapters import EncoderNames, adapter_layout

HEADS = ("RobertaForSequenceClassification", "XLMRobertaForSequenceClassification")
TOKEN_HEADS = ("RobertaForTokenClassification", "XLMRobertaForTokenClassification")  # classifier: one Linear
ARCHITECTURES = (HEADS[0], "RobertaModel", HEADS[1], "XLMRobertaModel", *TOKEN_HEADS)
RULES = bert.RULES
# RoBERTa's head -> our modules (the rest of the names are BERT's)
HEAD_NAMES = {"classifier.dense.": "pooler.dense.", "classifier.out_proj.": "classifier."}
ADAPTER_NAMES = EncoderNames("RoBERTa", "roberta.", "encoder.layer", bert.LINEARS, bert.ADAPTER_TARGETS,
                             heads={"classifier.dense": "pooler", "classifier.out_proj": "classifier"},
                             saves={"classifier": ("pooler", "classifier")})
ADAPTER_LAYOUT = adapter_layout(ADAPTER_NAMES)


def labels(hf: Mapping[str, Any]) -> list[str] | None:
    """The class names of a *ForSequenceClassification / *ForTokenClassification in id order; None for a
    RobertaModel / XLMRobertaModel."""
    return bert.head_labels(hf, ARCHITECTURES, HEADS + TOKEN_HEADS)


def to_config(hf: Mapping[str, Any]) -> ClassifierConfig:
    """Our config for RoBERTa's / XLM-R's config.json (HFImportError naming a field we cannot express)."""
    check_supported(hf, RULES, "RoBERTa")
    return bert.encoder_config(hf, labels(hf), layer_norm_eps=field(hf, "layer_norm_eps", float, 1e-12),
                               vocab=50265, pad=1, offset_positions=True, head=bert.head_kind(hf, TOKEN_HEADS))


def state_dict(c: ClassifierConfig, tensors: Tensors) -> Tensors:
    """Our classifier's state dict from RoBERTa's tensors (``roberta.`` prefix under a head)."""
    t = strip_prefix(tensors, "roberta.")
    if c.num_labels and c.head == "sequence":  # a token head's classifier is already ours
        t = {_head_name(k): v for k, v in t.items()}
    return bert.state_dict(c, t)


def _head_name(name: str) -> str:
    for theirs, ours in HEAD_NAMES.items():
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name
