"""Random RoBERTa, XLM-RoBERTa and DistilBERT models saved by `transformers` itself, alone or in a directory with a
tokenizer trained here (RoBERTa's byte-level BPE, an XLM-R-style Unigram, BERT's WordPiece for DistilBERT), and
each of them and BERT as a *ForTokenClassification (head "token").

Shared by the import tests (tests/model/test_hf_encoders.py) and the served ones (tests/service/test_hf_models.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.hf_compare import randomize
from tests.hf_directories import CORPUS, SPM_CORPUS, TEXTS
from tests.hf_tokenizers import roberta_bpe, wordpiece

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, max_position_embeddings=40)
BERT_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# architecture -> (config class, headless class, head class, pad id, config fields)
ARCHITECTURES = {
    "roberta": ("RobertaConfig", "RobertaModel", "RobertaForSequenceClassification", 1,
                {**BERT_SIZES, "type_vocab_size": 1, "max_position_embeddings": 42}),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForSequenceClassification", 1,
                    {**BERT_SIZES, "type_vocab_size": 1, "max_position_embeddings": 42, "layer_norm_eps": 1e-5}),
    "distilbert": ("DistilBertConfig", "DistilBertModel", "DistilBertForSequenceClassification", 0,
                   dict(dim=32, n_layers=2, n_heads=4, hidden_dim=48, dropout=0.0, attention_dropout=0.0,
                        seq_classif_dropout=0.0)),
}
# the token classification heads (head "token"), BERT's among them
TOKEN_HEADS = {"bert": "BertForTokenClassification", "roberta": "RobertaForTokenClassification",
               "xlm-roberta": "XLMRobertaForTokenClassification", "distilbert": "DistilBertForTokenClassification"}
ENCODERS = {"bert": ("BertConfig", "BertModel", "BertForSequenceClassification", 0, BERT_SIZES), **ARCHITECTURES}
# head -> config fields (None: the headless model)
HEADS = {
    "token": {"id2label": {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}},
    "model": None,
    "single": {"id2label": {0: "neg", 1: "pos", 2: "mid"}},
    "multi": {"id2label": {0: "toxic", 1: "spam", 2: "rude"}, "problem_type": "multi_label_classification"},
    "regression": {"num_labels": 2, "problem_type": "regression"},
    "one-label": {"num_labels": 1},
}
XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R's first ids


def save(directory: Path, architecture: str, head: str, seed: int = 0, **overrides):
    """A random model of ``architecture`` (ENCODERS) with ``head`` saved by save_pretrained; the model itself, in
    eval mode."""
    config_cls, model_cls, head_cls, pad, fields = ENCODERS[architecture]
    head_cls = TOKEN_HEADS[architecture] if head == "token" else head_cls
    head_fields = HEADS[head]
    config = getattr(transformers, config_cls)(**{**SIZES, "pad_token_id": pad, **fields, **(head_fields or {}),
                                                  **overrides})
    model = getattr(transformers, model_cls if head_fields is None else head_cls)(config)
    randomize(model, seed=seed).save_pretrained(directory)
    return model


def encoder_directory(directory: Path, architecture: str, head: str, seed: int = 0) -> Path:
    """A random model of ``architecture`` with its kind of tokenizer, both saved by transformers (the tokenizer as
    PreTrainedTokenizerFast: its tokenizer.json as written)."""
    backend, specials = _tokenizer(architecture)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **specials,
                                                     model_input_names=["input_ids", "attention_mask"])
    tokenizer.save_pretrained(directory)
    save(directory, architecture, head, seed, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    return directory


def xlmr_unigram() -> Tokenizer:
    """A SentencePiece-style Unigram as XLM-R's tokenizer.json lays it out: <s> <pad> </s> <unk> first, NFKC,
    Metaspace, the <s> a </s> (</s> b </s>) template."""
    backend = Tokenizer(models.Unigram())
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(CORPUS + SPM_CORPUS + TEXTS, trainers.UnigramTrainer(
        vocab_size=150, special_tokens=XLMR_SPECIALS, unk_token="<unk>", show_progress=False))
    backend.add_special_tokens(["<mask>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return backend


def _tokenizer(architecture: str) -> tuple[Tokenizer, dict[str, str]]:
    if architecture in ("bert", "distilbert"):
        return wordpiece(lowercase=True, strip_accents=None), {
            "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
            "mask_token": "[MASK]"}
    roles = {"bos_token": "<s>", "cls_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "sep_token": "</s>",
             "unk_token": "<unk>", "mask_token": "<mask>"}
    return (roberta_bpe() if architecture == "roberta" else xlmr_unigram()), roles
