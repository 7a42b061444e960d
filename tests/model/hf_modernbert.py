"""Random ModernBERT models (ModernBertModel, *ForSequenceClassification with cls or mean pooling,
*ForTokenClassification) saved by `transformers` itself, alone or with a tokenizer.json trained here in ModernBERT's
layout (byte-level BPE, [CLS] a [SEP] (b [SEP])).

Tiny: 4 layers with local ones (window local_attention = 4: |i - j| <= 2) between global ones, inputs longer than
the window. Shared by tests/model/test_hf_modernbert.py and the served tests (tests/service/test_rerank.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.hf_compare import randomize
from tests.hf_directories import CORPUS, SPM_CORPUS, TEXTS

transformers = pytest.importorskip("transformers")

SPECIALS = {"unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
            "mask_token": "[MASK]"}
SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=24,
             max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=3, global_rope_theta=160.0,
             local_rope_theta=10.0, pad_token_id=0, cls_token_id=1, sep_token_id=2, bos_token_id=1, eos_token_id=2)
# head -> (class, config fields); None fields: the headless model
HEADS = {
    "model": ("ModernBertModel", None),
    "cls": ("ModernBertForSequenceClassification", {"id2label": {0: "neg", 1: "pos", 2: "mid"}}),
    # mean pooling, every bias on, global layers every 2nd, tanh-GELU, SiLU in the head, multi-label
    "mean": ("ModernBertForSequenceClassification",
             {"id2label": {0: "a", 1: "b"}, "classifier_pooling": "mean", "attention_bias": True, "mlp_bias": True,
              "norm_bias": True, "classifier_bias": True, "global_attn_every_n_layers": 2,
              "hidden_activation": "gelu_pytorch_tanh", "classifier_activation": "silu",
              "problem_type": "multi_label_classification"}),
    "one-label": ("ModernBertForSequenceClassification", {"num_labels": 1}),
    "token": ("ModernBertForTokenClassification",
              {"id2label": {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}}),
}


def save(directory: Path, head: str, seed: int = 0, **overrides):
    """A random ModernBERT with ``head`` (HEADS) saved by save_pretrained; the model itself (SDPA attention, the
    reference), in eval mode."""
    cls, fields = HEADS[head]
    config = transformers.ModernBertConfig(**{**SIZES, **(fields or {}), **overrides})
    config._attn_implementation = "sdpa"
    model = getattr(transformers, cls)(config)
    randomize(model, seed=seed).save_pretrained(directory)
    return model


def modernbert_bpe() -> Tokenizer:
    """ModernBERT's tokenizer.json layout: byte-level BPE (GPT-NeoX's), [UNK] [CLS] [SEP] [PAD] [MASK] added, the
    [CLS] $A [SEP] ($B [SEP]) template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS + SPM_CORPUS + TEXTS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return backend


def modernbert_directory(directory: Path, head: str, seed: int = 0, **overrides) -> Path:
    """A random ModernBERT with ``head`` and its kind of tokenizer, both saved by transformers."""
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=modernbert_bpe(), **SPECIALS,
                                                     model_input_names=["input_ids", "attention_mask"])
    tokenizer.save_pretrained(directory)
    save(directory, head, seed, vocab_size=len(tokenizer), **overrides)
    return directory
