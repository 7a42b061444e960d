"""The shapes people serve on CPUs, as random-weight Hugging Face directories that every engine reads.

:func:`build` makes one shape's files once and keeps them in a cache folder (``~/.cache/tserve/bench-shapes``
by default), reused by later runs: ``<shape>/hf`` (config.json, model.safetensors and a tokenizer, as
``save_pretrained`` writes them: ours loads it with ``model.checkpoint.load_checkpoint``, HF with
``from_pretrained``), ``<shape>/ct2`` (CTranslate2's ``TransformersConverter`` of the seq2seq ones and of the
Llama-style decoders), ``<shape>/gguf`` (llama.cpp's converter of the Llama-style decoders: benchmarks/gguf.py) and
``<shape>/onnx`` (a classifier, BERT's or XLM-R's, exported with ``torch.onnx.export`` with Optimum's inputs, fused
by onnxruntime's transformer optimizer as Optimum does, and its ``quantize_dynamic`` int8 copy). A folder whose
``VERSION`` is not :data:`BUILD_VERSION` is rebuilt; every product is written beside its place and renamed into it.

Weights are transformers' own initialisation (normal, std 0.02; a padding embedding row zero) from a fixed
seed; OPUS-MT also gets a random ``final_logits_bias``. The tokenizers are tiny but their vocabularies have
the model's size (filler tokens): load_checkpoint needs one, and CTranslate2 takes its vocabulary from it (XLM-R's: a
SentencePiece-style Unigram of 250,002 pieces as its tokenizer.json lays them out). The
Llama-style decoders' byte-level BPE is trained (it has merges: llama.cpp's GGUF needs them). Issue 39's seq2seq
shapes, ``nllb-200-distilled-600m`` and ``flan-t5-base``, take their configs and tokenizers from
benchmarks/seq2seq_shapes.py; a multilingual one names its target language in :attr:`Shape.forced_first`.
The benchmark feeds token ids (random, no special ids) to every engine, so it measures model compute,
not tokenization. ``tiny=True`` gives the same architecture at toy sizes, for the test. The encoders
(:data:`ENCODERS`, benchmarks/encoder_compare.py): ``xlm-roberta-base``, a one-label cross-encoder (bge-reranker-base's
config), and ``distilbert-base`` with a 9-label token head (NER: benchmarks/ner_compare.py).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import seq2seq_shapes
from benchmarks.floor import Dims

logger = logging.getLogger("benchmarks.shapes")

BUILD_VERSION = "1"  # bump when what build() writes changes: cached folders of another version are rebuilt
DEFAULT_CACHE = Path.home() / ".cache" / "tserve" / "bench-shapes"
SEED = 0
EOT = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SPM_CORPUS = ["the file could not be opened", "a quick brown fox jumps over the lazy dog",
              "copy the files into the folder", "print hello world", "translate this sentence"] * 20


@dataclass(frozen=True)
class Shape:
    """One served shape: its transformers class and config fields, and the sizes its floor needs."""

    name: str
    family: str  # ours: "seq2seq", "classifier" or "causal_lm"
    architecture: str  # the transformers class
    config: dict[str, Any]  # its config.json fields (everything else at transformers' defaults)
    dims: Dims
    gguf_pre: str = ""  # a Llama-style decoder llama.cpp runs: the pre-tokenizer its real checkpoint's GGUF names
    job: str = ""  # an encoder of benchmarks/encoder_compare.py: "rerank" (a one-label head) or "entities" (NER)
    forced_first: str = ""  # a multilingual translator's target language: the token every translation starts with

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]


def _marian(vocab: int, d: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    """OPUS-MT's config (Helsinki-NLP/opus-mt-en-de): swish, scaled embeddings, EOS 0, the pad id last; no forced
    EOS (the benchmark fixes every length with min_new_tokens, and CTranslate2 has no such rule)."""
    return dict(vocab_size=vocab, decoder_vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers,
                encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                decoder_ffn_dim=ffn, activation_function="swish", scale_embedding=True, max_position_embeddings=512,
                pad_token_id=vocab - 1, eos_token_id=0, decoder_start_token_id=vocab - 1, forced_eos_token_id=None,
                share_encoder_decoder_embeddings=True, tie_word_embeddings=True, dropout=0.0)


def _bert(vocab: int, d: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                intermediate_size=ffn, max_position_embeddings=512, pad_token_id=0,
                id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1},
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _xlm_roberta(vocab: int, d: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    """A cross-encoder on XLM-RoBERTa (BAAI/bge-reranker-base's config): one label, positions from pad + 1, one token
    type, <s> 0, <pad> 1, </s> 2."""
    return dict(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                intermediate_size=ffn, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=1, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)


def _distilbert(vocab: int, d: int, layers: int, heads: int, ffn: int, labels: int) -> dict[str, Any]:
    """DistilBERT with a token-classification head of ``labels`` BIO labels (an NER checkpoint's); its heads under
    the common name (DistilBertConfig maps it to n_heads), which the ONNX export reads."""
    names = ["O", *(f"{p}-{kind}" for kind in ("PER", "ORG", "LOC", "MISC") for p in "BI")][:labels]
    return dict(vocab_size=vocab, dim=d, n_layers=layers, num_attention_heads=heads, hidden_dim=ffn,
                max_position_embeddings=512,
                pad_token_id=0, id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
                dropout=0.0, attention_dropout=0.0)


def _gpt2(vocab: int, d: int, layers: int, heads: int) -> dict[str, Any]:
    return dict(vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads, n_positions=1024,
                bos_token_id=vocab - 1, eos_token_id=vocab - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _llama(vocab: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int, theta: float, eps: float,
           **extra: Any) -> dict[str, Any]:
    """A Llama-style decoder's config (LlamaConfig / Qwen2Config fields): GQA, head_dim d / heads, SwiGLU, tied head,
    <|endoftext|> (the last id) as BOS and EOS."""
    return dict(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d // heads, rms_norm_eps=eps,
                rope_theta=theta, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=vocab - 1,
                eos_token_id=vocab - 1, **extra)


def _smollm2(vocab: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int) -> dict[str, Any]:
    """HuggingFaceTB/SmolLM2-135M's config (LlamaForCausalLM)."""
    return _llama(vocab, d, layers, heads, kv_heads, ffn, theta=100000.0, eps=1e-5)


def _qwen2(vocab: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int) -> dict[str, Any]:
    """Qwen/Qwen2.5-0.5B's config (Qwen2ForCausalLM: biases on q/k/v, no sliding window)."""
    return _llama(vocab, d, layers, heads, kv_heads, ffn, theta=1000000.0, eps=1e-6, use_sliding_window=False)


SHAPES = {
    "opus-mt": Shape("opus-mt", "seq2seq", "MarianMTModel", _marian(58101, 512, 6, 8, 2048), Dims(512, 2048, 58101, 6)),
    "bert-base": Shape("bert-base", "classifier", "BertForSequenceClassification", _bert(30522, 768, 12, 12, 3072),
                       Dims(768, 3072, 30522, 12)),
    "gpt2-small": Shape("gpt2-small", "causal_lm", "GPT2LMHeadModel", _gpt2(50257, 768, 12, 12),
                        Dims(768, 3072, 50257, 12)),
    "xlm-roberta-base": Shape("xlm-roberta-base", "classifier", "XLMRobertaForSequenceClassification",
                              _xlm_roberta(250002, 768, 12, 12, 3072), Dims(768, 3072, 250002, 12), job="rerank"),
    "distilbert-base": Shape("distilbert-base", "classifier", "DistilBertForTokenClassification",
                             _distilbert(30522, 768, 6, 12, 3072, 9), Dims(768, 3072, 30522, 6), job="entities"),
    "smollm2-135m": Shape("smollm2-135m", "causal_lm", "LlamaForCausalLM", _smollm2(49152, 576, 30, 9, 3, 1536),
                          Dims(576, 1536, 49152, 30, kv_width=3 * 64, ffn_matrices=3), gguf_pre="smollm"),
    "qwen2.5-0.5b": Shape("qwen2.5-0.5b", "causal_lm", "Qwen2ForCausalLM", _qwen2(151936, 896, 24, 14, 2, 4864),
                          Dims(896, 4864, 151936, 24, kv_width=2 * 64, ffn_matrices=3), gguf_pre="qwen2"),
    "nllb-200-distilled-600m": Shape("nllb-200-distilled-600m", "seq2seq", "M2M100ForConditionalGeneration",
                                     seq2seq_shapes.nllb(256206, 1024, 12, 16, 4096), Dims(1024, 4096, 256206, 12),
                                     forced_first=seq2seq_shapes.NLLB_TARGET),
    "flan-t5-base": Shape("flan-t5-base", "seq2seq", "T5ForConditionalGeneration",
                          seq2seq_shapes.t5(32128, 768, 12, 12, 64, 2048), Dims(768, 2048, 32128, 12, ffn_matrices=3)),
}
TINY = {  # the same architectures at toy sizes: the test's
    "opus-mt": Shape("opus-mt", "seq2seq", "MarianMTModel", _marian(301, 32, 2, 4, 64), Dims(32, 64, 301, 2)),
    "bert-base": Shape("bert-base", "classifier", "BertForSequenceClassification", _bert(300, 32, 2, 4, 64),
                       Dims(32, 64, 300, 2)),
    "gpt2-small": Shape("gpt2-small", "causal_lm", "GPT2LMHeadModel", _gpt2(300, 32, 2, 4), Dims(32, 128, 300, 2)),
    "xlm-roberta-base": Shape("xlm-roberta-base", "classifier", "XLMRobertaForSequenceClassification",
                              _xlm_roberta(300, 32, 2, 4, 64) | {"initializer_range": 0.1},  # scores that differ
                              Dims(32, 64, 300, 2), job="rerank"),
    "distilbert-base": Shape("distilbert-base", "classifier", "DistilBertForTokenClassification",
                             _distilbert(300, 32, 2, 4, 64, 9), Dims(32, 64, 300, 2), job="entities"),
    "smollm2-135m": Shape("smollm2-135m", "causal_lm", "LlamaForCausalLM", _smollm2(400, 64, 2, 4, 2, 96),
                          Dims(64, 96, 400, 2, kv_width=32, ffn_matrices=3), gguf_pre="smollm"),
    "qwen2.5-0.5b": Shape("qwen2.5-0.5b", "causal_lm", "Qwen2ForCausalLM", _qwen2(400, 64, 2, 4, 2, 96),
                          Dims(64, 96, 400, 2, kv_width=32, ffn_matrices=3), gguf_pre="qwen2"),
    "nllb-200-distilled-600m": Shape("nllb-200-distilled-600m", "seq2seq", "M2M100ForConditionalGeneration",
                                     seq2seq_shapes.nllb(300, 32, 2, 4, 64), Dims(32, 64, 300, 2),
                                     forced_first=seq2seq_shapes.NLLB_TARGET),
    "flan-t5-base": Shape("flan-t5-base", "seq2seq", "T5ForConditionalGeneration",
                          seq2seq_shapes.t5(300, 32, 2, 4, 8, 64), Dims(32, 64, 300, 2, ffn_matrices=3)),
}
DECODERS = [name for name, spec in SHAPES.items() if spec.gguf_pre]  # benchmarks/decoder_compare.py's shapes
ENCODERS = [name for name, spec in SHAPES.items() if spec.job]  # benchmarks/encoder_compare.py's shapes
XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R's first ids (<mask> is its last)


@dataclass(frozen=True)
class ShapeFiles:
    """Where one shape's files are."""

    shape: Shape
    root: Path

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def ct2(self) -> Path:
        return self.root / "ct2"

    @property
    def gguf(self) -> Path:
        return self.root / "gguf"

    @property
    def onnx(self) -> Path:
        return self.root / "onnx" / "model.onnx"

    @property
    def onnx_int8(self) -> Path:
        return self.root / "onnx" / "model-int8.onnx"


def shape(name: str, tiny: bool = False) -> Shape:
    return (TINY if tiny else SHAPES)[name]


def build(name: str, cache: Path = DEFAULT_CACHE, tiny: bool = False) -> ShapeFiles:
    """The HF directory of shape ``name`` under ``cache``, made now unless a finished one of this version is there."""
    spec = shape(name, tiny)
    root = cache / (f"{name}-tiny" if tiny else name)
    version = root / "VERSION"
    if root.is_dir() and (not version.is_file() or version.read_text().strip() != BUILD_VERSION):
        logger.info("%s: cached files of another build version: rebuilding", root)
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    version.write_text(BUILD_VERSION + "\n")
    files = ShapeFiles(spec, root)
    _product(files.hf, lambda tmp: _hf_directory(spec, tmp))
    return files


def ct2_directory(files: ShapeFiles) -> Path | None:
    """CTranslate2's conversion of the seq2seq shape or a Llama-style decoder (None when ctranslate2 is not
    installed)."""
    try:
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        return None
    with warnings.catch_warnings():  # MarianTokenizer recommends sacremoses, which ids need not
        warnings.simplefilter("ignore", UserWarning)
        _product(files.ct2, lambda tmp: TransformersConverter(str(files.hf)).convert(str(tmp), force=True))
    return files.ct2


def onnx_models(files: ShapeFiles) -> tuple[Path, Path] | None:
    """The classifier as ONNX, fused by onnxruntime's transformer optimizer, and its dynamic int8 copy (None when
    onnxruntime or onnx is not installed)."""
    try:
        import onnx  # noqa: F401 (quantize_dynamic needs it)
        import onnxruntime  # noqa: F401
    except ImportError:
        return None
    _product(files.onnx.parent, lambda tmp: _onnx_export(files, tmp))
    return files.onnx, files.onnx_int8


def _product(path: Path, make: Callable[[Path], object]) -> None:
    """Make ``path`` with ``make(tmp)`` into a sibling folder, then rename it into place (kept if already there)."""
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("building %s ...", path)
    make(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another run finished it first
        shutil.rmtree(tmp, ignore_errors=True)


def _hf_directory(spec: Shape, directory: Path) -> None:
    import transformers

    directory.mkdir(parents=True)
    config = getattr(transformers, spec.architecture).config_class(**spec.config)
    torch.manual_seed(SEED)
    model = getattr(transformers, spec.architecture)(config).eval()
    if spec.family == "seq2seq" and spec.architecture != "MarianMTModel":
        seq2seq_shapes.write_tokenizer(spec.architecture, spec.vocab, directory)
        seq2seq_shapes.own_head(model)
    elif spec.family == "seq2seq":
        with torch.no_grad():  # a bias that counts: the logits path must add it (OPUS-MT's hold trained values)
            model.final_logits_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(SEED))
        _marian_tokenizer(directory, spec.vocab)
    elif spec.architecture.startswith("XLMRoberta"):
        _unigram_tokenizer(spec.vocab).save_pretrained(directory)
    elif spec.family == "classifier":
        _wordpiece_tokenizer(spec.vocab).save_pretrained(directory)
    else:
        _byte_bpe_tokenizer(spec.vocab, trained=bool(spec.gguf_pre)).save_pretrained(directory)
    if spec.gguf_pre:  # biases (Qwen2's q/k/v) that count: transformers initialises them to zero
        with torch.no_grad():
            generator = torch.Generator().manual_seed(SEED)
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0, 0.02, generator=generator)
    model.save_pretrained(directory)
    if spec.architecture == "MarianMTModel":  # OPUS-MT's rule (its pad id never generated), without its length defaults
        pad = spec.vocab - 1
        (directory / "generation_config.json").write_text(json.dumps(
            {"bad_words_ids": [[pad]], "decoder_start_token_id": pad, "eos_token_id": 0, "pad_token_id": pad}))


def _marian_tokenizer(directory: Path, vocab_size: int) -> None:
    """source.spm, target.spm (one tiny SentencePiece model) and a vocab.json of ``vocab_size`` ids laid out as
    OPUS-MT's: </s> 0, <unk> 1, the pieces, fillers, <pad> last."""
    import sentencepiece

    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SPM_CORPUS), model_writer=proto, vocab_size=40,
                                             hard_vocab_limit=False, minloglevel=2)
    for name in ("source.spm", "target.spm"):
        (directory / name).write_bytes(proto.getvalue())
    spm = sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue())
    pieces = [spm.id_to_piece(i) for i in range(3, spm.get_piece_size())]
    vocab = {p: i for i, p in enumerate(dict.fromkeys(["</s>", "<unk>", *pieces]))}
    vocab |= {f"\u2581filler{i}": i for i in range(len(vocab), vocab_size - 1)} | {"<pad>": vocab_size - 1}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"separate_vocabs": False, "unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>"}))


def _wordpiece_tokenizer(vocab_size: int):
    """A BERT WordPiece tokenizer of ``vocab_size`` tokens: the specials, characters, then fillers."""
    import string

    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = list(dict.fromkeys([*BERT_SPECIALS, *chars, *(f"##{c}" for c in chars)]))
    tokens += [f"w{i}" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    cls, sep = tokens.index("[CLS]"), tokens.index("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    names = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), BERT_SPECIALS, strict=True))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, model_input_names=["input_ids", "token_type_ids", "attention_mask"], **names)


def _unigram_tokenizer(vocab_size: int):
    """An XLM-R-style SentencePiece Unigram of ``vocab_size`` tokens as its tokenizer.json lays it out: <s> <pad> </s>
    <unk>, characters, fillers, <mask> last; NFKC, Metaspace, the ``<s> A </s> </s> B </s>`` template."""
    import string

    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = list(dict.fromkeys(["\u2581", *string.ascii_lowercase, *(f"\u2581{c}" for c in string.ascii_lowercase)]))
    pieces += [f"\u2581w{i}" for i in range(vocab_size - len(XLMR_SPECIALS) - len(pieces) - 1)]
    vocab = [(t, 0.0) for t in XLMR_SPECIALS] + [(p, -1.0 - i / len(pieces)) for i, p in enumerate(pieces)]
    backend = Tokenizer(models.Unigram(vocab + [("<mask>", 0.0)], unk_id=XLMR_SPECIALS.index("<unk>")))
    backend.add_special_tokens([*XLMR_SPECIALS, "<mask>"])
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", cls_token="<s>", pad_token="<pad>", eos_token="</s>",
        sep_token="</s>", unk_token="<unk>", mask_token="<mask>", model_input_names=["input_ids", "attention_mask"])


def _byte_bpe_tokenizer(vocab_size: int, trained: bool = False):
    """A GPT-2 byte-level BPE of ``vocab_size`` tokens (the 256 bytes, fillers, <|endoftext|> last); no merges, or
    (``trained``) the bytes and merges of a BPE trained on a small corpus before the fillers."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tokens, merges = _trained_bpe() if trained else (sorted(pre_tokenizers.ByteLevel.alphabet()), [])
    taken = set(tokens)
    fillers = (f for f in (f"\u0120w{i}" for i in range(vocab_size)) if f not in taken)
    tokens += itertools.islice(fillers, vocab_size - 1 - len(tokens))
    tokens.append(EOT)
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOT, eos_token=EOT, unk_token=EOT)


def _trained_bpe() -> tuple[list[str], list[tuple[str, str]]]:
    """The tokens (by id: the 256 bytes first) and merges of a byte-level BPE trained on SPM_CORPUS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(SPM_CORPUS, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return sorted(model["vocab"], key=model["vocab"].get), merges


def _onnx_export(files: ShapeFiles, directory: Path) -> None:
    """torch.onnx.export of HF's eager-attention graph (the one onnxruntime's fusions recognise), fused by
    ``onnxruntime.transformers.optimizer`` (Attention, EmbedLayerNormalization, SkipLayerNormalization, BiasGelu),
    then ``quantize_dynamic`` (int8 weights, per-tensor, onnxruntime's defaults) of the fused graph."""
    root = logging.getLogger()  # onnxruntime's optimizer and quantizer log every node, and advice, to it
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        _export_fuse_quantize(files, directory)
    finally:
        root.setLevel(level)


def _export_fuse_quantize(files: ShapeFiles, directory: Path) -> None:
    import onnx
    import transformers
    from onnxruntime.quantization import quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    directory.mkdir(parents=True)
    spec = files.shape
    model = getattr(transformers, spec.architecture).from_pretrained(files.hf, attn_implementation="eager").eval()
    ids = torch.randint(5, spec.vocab - 1, (2, 16), generator=torch.Generator().manual_seed(SEED))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # a padded row, so that the exported graph keeps the mask's path
    ids[1, -4:] = spec.config["pad_token_id"]
    inputs = onnx_inputs(spec)
    raw = directory / "exported.onnx"
    logits = {0: "batch", 1: "sequence"} if spec.job == "entities" else {0: "batch"}
    torch.onnx.export(model, (ids, mask, torch.zeros_like(ids))[: len(inputs)], str(raw), dynamo=False,
                      input_names=inputs, output_names=["logits"], opset_version=17,
                      dynamic_axes={**{name: {0: "batch", 1: "sequence"} for name in inputs}, "logits": logits})
    fused = optimize_model(str(raw), model_type="bert", num_heads=files.shape.config["num_attention_heads"],
                           hidden_size=files.shape.dims.d_model)
    stats = {k: v for k, v in fused.get_fused_operator_statistics().items() if v}
    fused.save_model_to_file(str(directory / files.onnx.name))
    (directory / "fusions.json").write_text(json.dumps(stats))
    raw.unlink()
    quantize_dynamic(directory / files.onnx.name, directory / files.onnx_int8.name,  # the fused ops' outputs float
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def onnx_inputs(spec: Shape) -> list[str]:
    """The exported graph's inputs, as Optimum's export names them: token types only where the model has two."""
    two_types = spec.config.get("type_vocab_size", 2) > 1 and not spec.architecture.startswith("DistilBert")
    return ["input_ids", "attention_mask", "token_type_ids"][: 3 if two_types else 2]


def onnx_fusions(files: ShapeFiles) -> dict[str, int]:
    """The fused operators onnxruntime's optimizer put in the classifier's graph."""
    path = files.onnx.parent / "fusions.json"
    return json.loads(path.read_text()) if path.is_file() else {}


__all__ = ["DECODERS", "DEFAULT_CACHE", "ENCODERS", "SHAPES", "Shape", "ShapeFiles", "build", "ct2_directory",
           "onnx_fusions", "onnx_inputs", "onnx_models", "shape"]
