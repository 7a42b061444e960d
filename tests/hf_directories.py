"""Hugging Face model directories as `transformers` writes them, for the tests that import, serve or train on them.

The GPT-2 directory: a random GPT2LMHeadModel and a byte-level BPE trained here in GPT-2's layout (<|endoftext|>
last), both through save_pretrained. The BERT directories: a WordPiece tokenizer trained here (lower-casing,
accents stripped, the [CLS] a [SEP] b [SEP] template) and a BertForSequenceClassification or a headless BertModel,
which ``sentence_transformers_layout`` lays out as sentence-transformers does (max pooling, Normalize). The OPUS-MT
directory: a random MarianMTModel, SentencePiece models trained here (one per side) and vocab.json laid out as
OPUS-MT's (</s> 0, <unk> 1, the pieces, <pad> last, a language code), and a generation_config.json that bans the
pad token and forces EOS at the limit, as OPUS-MT's do.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import sentencepiece
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.hf_compare import randomize

transformers = pytest.importorskip("transformers")

EOT = "<|endoftext|>"
CORPUS = ["def add(x, y):\n    return x + y\n", "the quick brown fox jumps over the lazy dog", "print('hello')",
          "for i in range(10):\n    total += i\n"] * 20
TEXTS = ["The quick brown fox", "Élan vital, déjà vu", "print('hello')"]
PAIRS = [["the fox", "jumps over the dog"], ["Hello", "WORLD"]]
LABELS = ["negative", "neutral", "positive"]
BERT_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                 "mask_token": "[MASK]"}

SPM_CORPUS = ["the file could not be opened", "no se pudo abrir el archivo", "Grüße aus Köln, déjà vu",
              "日本語のテキスト", "emoji 😀 and 👍🏽", "copy %s files into {name}", "print('hello world')"] * 30
FRAGMENTS = ["the", "file", "Köln", "déjà", "日本", "語", "😀", "👍🏽", "%s", "{name}", "  ", "\t", "zebra",
             "quartz", "ü", "e\u0301", "!", "?", "hello", "ÿǅ"]
MARIAN_PAD = 60  # after every piece of either side


def strings(count: int = 300) -> list[str]:
    """Texts with accents, CJK, emoji and whitespace runs, for comparing tokenizers."""
    rng = random.Random(0)
    return ["".join(rng.choice(FRAGMENTS) + rng.choice(["", " ", "  "]) for _ in range(rng.randint(1, 8)))
            for _ in range(count)]


def gpt2_directory(directory: Path) -> Path:
    """A random GPT-2 and its tokenizer, as transformers saves them."""
    tokenizer = byte_level_bpe(directory)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=eot, eos_token_id=eot)
    randomize(transformers.GPT2LMHeadModel(config), seed=5, eos_id=eot, eos_boost=2.5).save_pretrained(directory)
    return directory


def llama_directory(directory: Path) -> Path:
    """A random LlamaForCausalLM (grouped-query attention, untied head) and a byte-level BPE tokenizer (as SmolLM2's
    and Qwen's are), as transformers saves them."""
    tokenizer = byte_level_bpe(directory)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=eot, eos_token_id=eot,
                                      tie_word_embeddings=False)
    randomize(transformers.LlamaForCausalLM(config), seed=5, eos_id=eot, eos_boost=2.5).save_pretrained(directory)
    return directory


def byte_level_bpe(directory: Path) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained on CORPUS with <|endoftext|> last, saved into ``directory``."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet,
                                                            show_progress=False))
    backend.add_special_tokens([EOT])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOT, eos_token=EOT,
                                                     unk_token=EOT)
    tokenizer.save_pretrained(directory)
    return tokenizer


def bert_directory(directory: Path, head: bool) -> Path:
    """A random BERT (BertForSequenceClassification, or a headless BertModel) with a WordPiece tokenizer."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(CORPUS + TEXTS, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=list(BERT_SPECIALS.values()), show_progress=False))
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, model_input_names=["input_ids", "token_type_ids", "attention_mask"], **BERT_SPECIALS)
    tokenizer.save_pretrained(directory)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                                     pad_token_id=tokenizer.pad_token_id, id2label=dict(enumerate(LABELS)),
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(config) if head else transformers.BertModel(config)
    randomize(model, seed=7).save_pretrained(directory)
    return directory


def sentence_transformers_layout(directory: Path) -> Path:
    """modules.json, 1_Pooling/config.json (max pooling) and 2_Normalize, as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": True, "pooling_mode_mean_sqrt_len_tokens": False}))
    (directory / "2_Normalize").mkdir()
    return directory


def train_spm(text_seed: int) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SPM_CORPUS[text_seed:]), model_writer=model,
                                             vocab_size=56, character_coverage=0.98,
                                             hard_vocab_limit=False, minloglevel=2)
    return model.getvalue()


def opus_mt_tokenizer(directory: Path, separate_vocabs: bool = False) -> Path:
    """source.spm, target.spm and vocab.json (and target_vocab.json) as OPUS-MT ships them."""
    directory.mkdir(parents=True)
    sides = {"source.spm": train_spm(0), "target.spm": train_spm(3)}
    for name, proto in sides.items():
        (directory / name).write_bytes(proto)

    def vocab(proto: bytes, drop_every: int) -> dict[str, int]:
        spm = sentencepiece.SentencePieceProcessor(model_proto=proto)
        pieces = [spm.id_to_piece(i) for i in range(3, spm.get_piece_size())][::drop_every]  # some pieces missing
        ordered = {piece: i for i, piece in enumerate(dict.fromkeys(["</s>", "<unk>", ">>es<<", *pieces]))}
        fillers = {f"\u2581filler{i}": i for i in range(len(ordered), MARIAN_PAD)}  # ids without gaps, as OPUS-MT's
        return ordered | fillers | {"<pad>": MARIAN_PAD}  # one pad id for both sides, as a Marian config has one

    (directory / "vocab.json").write_text(json.dumps(vocab(sides["source.spm"], 1 if not separate_vocabs else 2)))
    config = {"separate_vocabs": separate_vocabs, "unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>"}
    if separate_vocabs:
        (directory / "target_vocab.json").write_text(json.dumps(vocab(sides["target.spm"], 1)))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def opus_mt_directory(directory: Path, **overrides) -> Path:
    """A random OPUS-MT-like translator: EOS 0, the pad id also the decoder start, a final_logits_bias (MarianConfig
    ``overrides``)."""
    opus_mt_tokenizer(directory)
    config = transformers.MarianConfig(**{
        "vocab_size": MARIAN_PAD + 1, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
        "max_position_embeddings": 64, "pad_token_id": MARIAN_PAD, "eos_token_id": 0,
        "decoder_start_token_id": MARIAN_PAD, "dropout": 0.0, **overrides})
    model = randomize(transformers.MarianMTModel(config), seed=2, eos_id=0, eos_boost=2.0)
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(
        {"bad_words_ids": [[MARIAN_PAD]], "forced_eos_token_id": 0, "decoder_start_token_id": MARIAN_PAD,
         "eos_token_id": 0, "pad_token_id": MARIAN_PAD, "max_length": 64, "num_beams": 4}))
    return directory


def with_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A word-level tokenizer.json over the model's ids, which load_hf_checkpoint needs beside the weights, declared
    as taken as written (transformers' GPT2Tokenizer / BertTokenizer, which a model_type picks otherwise, rebuild a
    BPE / WordPiece pipeline and would not read a word-level file)."""
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w1")).save(
        str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory
