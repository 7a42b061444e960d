"""Tokenizer files as the Llama family ships them, trained here with `tokenizers` (nothing downloaded): byte-level
BPE (GPT-2's pre-tokenizer, SmolLM2's single digits, Qwen2's regex split and NFC), SentencePiece-converted BPE with
byte fallback as transformers' LlamaConverter writes it (Llama 2's legacy normalizer or a Metaspace pre-tokenizer),
a Unigram (and XLM-R's, with sentencepiece's Precompiled normalizer), and the encoders' BERT WordPiece and RoBERTa
byte-level BPE; ``write_directory`` lays one out with tokenizer_config.json and config.json."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from model.config import CausalLMConfig
from model.hf.tokenizer import load_tokenizer
from model.hf.tokenizer_classes import QWEN2_SPLIT
from model.tokenizer import Tokenizer as OurTokenizer
from tests.hf_directories import CORPUS, SPM_CORPUS

LLAMA_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CHAT_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def sentencepiece_bpe(legacy: bool, prefix: bool = True) -> Tokenizer:
    """BPE with byte fallback as transformers' LlamaConverter writes it: <unk> <s> </s>, the 256 <0xXX> pieces, then
    the merged pieces; Llama 2's legacy normalizer (Prepend ▁, spaces -> ▁) or a Metaspace pre-tokenizer."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(CORPUS + SPM_CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    data = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(data["vocab"], key=data["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in data["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if legacy:
        backend.normalizer = normalizers.Sequence([*([normalizers.Prepend("▁")] if prefix else []),
                                                   normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first" if prefix else "never", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return backend


def byte_level_bpe(qwen: bool = False, digits: bool = False) -> Tokenizer:
    """Byte-level BPE: GPT-2's pre-tokenizer or Qwen2's regex split and NFC. ``digits``: SmolLM2's single-digit
    split is added after training, over a vocabulary that merges digits ("10"), so that reading it or not (as
    transformers 5's GPT2Tokenizer does not) gives different ids."""
    backend = Tokenizer(models.BPE())
    if qwen:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.train_from_iterator(CORPUS + SPM_CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    if digits:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         backend.pre_tokenizer])
    return backend


def unigram() -> Tokenizer:
    """A Unigram with a Metaspace pre-tokenizer and decoder (T5's, XLM-R's layout)."""
    backend = Tokenizer(models.Unigram())
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(CORPUS + SPM_CORPUS, trainers.UnigramTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False))
    return backend


def wordpiece(lowercase: bool, strip_accents: bool | None) -> Tokenizer:
    """BERT's WordPiece (BertNormalizer with ``lowercase`` / ``strip_accents``, "##" pieces, [CLS] a [SEP] (b [SEP]));
    characters outside the training texts are [UNK]."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=strip_accents)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(CORPUS + SPM_CORPUS, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return backend


def roberta_bpe() -> Tokenizer:
    """RoBERTa's byte-level BPE: <s> <pad> </s> <unk> first, <mask> last, <s> a </s> (</s> b </s>) with offsets
    trimmed of the leading space."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS + SPM_CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    backend.add_special_tokens(["<mask>"])
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True,
                                                          add_prefix_space=False)
    return backend


def sentencepiece_unigram() -> Tokenizer:
    """A Unigram as XLM-R's tokenizer.json has it (transformers' XLMRobertaConverter): trained by sentencepiece with
    its nmt_nfkc rules (a Precompiled normalizer, then runs of spaces made one), <s> <pad> </s> <unk> first and
    <mask> last, a Metaspace pre-tokenizer and decoder, <s> a </s> (</s> b </s>)."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2

    written = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS + SPM_CORPUS), model_writer=written,
                                   vocab_size=200, hard_vocab_limit=False, model_type="unigram",
                                   normalization_rule_name="nmt_nfkc", num_threads=1, minloglevel=2)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(written.getvalue())
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0),
             *((p.piece, p.score) for p in proto.pieces[3:]), ("<mask>", 0.0)]  # sentencepiece's <unk> <s> </s> out
    backend = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    backend.normalizer = normalizers.Sequence([normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap),
                                               normalizers.Replace(Regex(" {2,}"), " ")])
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")])
    return backend


def with_tool(backend: Tokenizer, post: processors.PostProcessor | None = None) -> Tokenizer:
    """``backend`` with a non-special added token (and a template)."""
    backend.add_tokens([AddedToken("<|tool|>", special=False, normalized=False)])
    if post is not None:
        backend.post_processor = post
    return backend


def write_directory(directory: Path, backend: Tokenizer, settings: dict, model_type: str) -> Path:
    """tokenizer.json, tokenizer_config.json (the special tokens and ``settings``) and a config.json naming
    ``model_type``."""
    directory.mkdir(parents=True)
    backend.save(str(directory / "tokenizer.json"))
    specials = CHAT_SPECIALS if backend.token_to_id("<|im_end|>") is not None else LLAMA_SPECIALS
    (directory / "tokenizer_config.json").write_text(json.dumps({**specials, **settings}))
    (directory / "config.json").write_text(json.dumps({"model_type": model_type,
                                                       "vocab_size": backend.get_vocab_size()}))
    return directory


def load(directory: Path) -> OurTokenizer:
    """``directory``'s tokenizer as model.hf loads it."""
    size = json.loads((directory / "config.json").read_text())["vocab_size"]
    return load_tokenizer(directory, CausalLMConfig(vocab_size=size, pad_id=0, bos_id=1, eos_id=2))
