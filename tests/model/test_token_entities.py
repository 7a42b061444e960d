"""model.token_entities against transformers' own token-classification pipeline: random BERT (with BERT's uncased and
cased WordPiece, GPT-2's byte-level BPE) and RoBERTa (its byte-level BPE) token classifiers saved by save_pretrained,
their tokenizers trained here. Our side reads our tokenizer's windows and offsets, and the same model's logits
(transformers computes them: the aggregation is what is under test); every strategy, whole texts and a long text in
overlapping windows."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from model.token_entities import STRATEGIES, Window, WordRules, aggregate, check_options, probabilities
from tests.hf_tokenizers import byte_level_bpe, load, roberta_bpe, wordpiece

transformers = pytest.importorskip("transformers")

LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
TEXTS = ["  Élan vital, déjà vu à Köln!  ", "the quick brown fox jumps over the lazy dog, the fox",
         "日本語のテキスト and 東京 (Tokyo)", "print('hello world'); x += 10... Ωmega",
         "Grüße aus Köln, e\u0301 combining", " "]
LONG = " ".join(TEXTS) + " the quick brown fox, the quick brown fox"
WINDOW, STRIDE = 16, 5  # model_max_length and stride of the windowed case
BERT_SPECIALS = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
SPECIALS = {"bert-uncased": BERT_SPECIALS, "bert-cased": BERT_SPECIALS,
            "roberta": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", sep_token="</s>", cls_token="<s>",
                            pad_token="<pad>", mask_token="<mask>"),
            "gpt2-bpe": dict(pad_token="<|endoftext|>", eos_token="<|endoftext|>")}
KINDS = {"bert-uncased": lambda: wordpiece(lowercase=True, strip_accents=True),
         "bert-cased": lambda: wordpiece(lowercase=False, strip_accents=None), "roberta": roberta_bpe,
         "gpt2-bpe": byte_level_bpe}  # GPT-2's byte-level BPE: no template, offsets keep the leading space
CASES = [(kind, strategy, stride) for kind in KINDS for strategy in STRATEGIES for stride in (None, STRIDE)
         if not (stride and strategy == "none")]  # the pipeline refuses a stride with "none": see test_options


def token_classifier(directory: Path, kind: str) -> Path:
    """A random RoBERTa (or else BERT) token classifier with 9 BIO labels and its tokenizer, as transformers saves
    them; the classifier scaled up, O favoured, so that tokens get confident and varied labels."""
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=KINDS[kind](), **SPECIALS[kind])
    tokenizer.save_pretrained(directory)
    common = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=130, pad_token_id=tokenizer.pad_token_id,
                  id2label=dict(enumerate(LABELS)), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    if kind == "roberta":
        model = transformers.RobertaForTokenClassification(transformers.RobertaConfig(**common))
    else:
        model = transformers.BertForTokenClassification(transformers.BertConfig(**common))
    with torch.no_grad():
        model.classifier.weight.normal_(0, 0.4, generator=torch.Generator().manual_seed(1))
        model.classifier.bias.zero_()
        model.classifier.bias[LABELS.index("O")] = 1.5
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("token_classifiers")
    return {kind: token_classifier(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def models(directories):
    return {kind: transformers.AutoModelForTokenClassification.from_pretrained(d).eval()
            for kind, d in directories.items()}


def ours(directory: Path, model, text: str, strategy: str, stride: int | None) -> tuple[list, list]:
    """Our entities of ``text`` (as the pipeline's dicts) and our windows."""
    tokenizer = load(directory)
    windows = tokenizer.encode_windows(text, WINDOW if stride is not None else None, stride or 0)
    probs = []
    for spans in windows:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([spans.ids])).logits[0].numpy()
        probs.append(Window.of(spans, probabilities(logits), tokenizer.unk_id))
    entities = aggregate(text, probs, model.config.id2label, WordRules.of(tokenizer), strategy)
    return [e.as_dict() for e in entities], windows


@pytest.mark.parametrize(("kind", "strategy", "stride"), CASES)
def test_entities_equal_the_pipelines(directories, models, kind, strategy, stride):
    directory, model = directories[kind], models[kind]
    extra = {"model_max_length": WINDOW} if stride is not None else {}
    hf = transformers.AutoTokenizer.from_pretrained(directory, **extra)
    pipe = transformers.pipeline("token-classification", model=model, tokenizer=hf, aggregation_strategy=strategy,
                                 **({"stride": stride} if stride is not None else {}))
    found = 0
    for text in TEXTS if stride is None else [LONG, TEXTS[0]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Tokenizer does not support real words" (byte-level BPE)
            expected = pipe(text)
        got, windows = ours(directory, model, text, strategy, stride)
        encoded = hf(text, truncation=stride is not None, return_overflowing_tokens=stride is not None,
                     stride=stride or 0, return_offsets_mapping=True)
        rows = {key: encoded[key] if stride is not None else [encoded[key]] for key in ("input_ids", "offset_mapping")}
        assert [w.ids for w in windows] == rows["input_ids"]
        assert [w.offsets for w in windows] == [[tuple(o) for o in row] for row in rows["offset_mapping"]]
        if text == LONG:
            assert len(windows) > 2
        assert [{k: v for k, v in e.items() if k != "score"} for e in got] == \
            [{k: v for k, v in e.items() if k != "score"} for e in expected], text
        np.testing.assert_allclose([e["score"] for e in got], [e["score"] for e in expected], atol=1e-5, rtol=0)
        found += len(got)
    assert found >= 5  # random weights that tag nothing would prove nothing


def test_options(directories, models):
    with pytest.raises(ValueError, match="stride"):
        transformers.pipeline("token-classification", model=models["roberta"],
                              tokenizer=str(directories["roberta"]), aggregation_strategy="none", stride=2)
    with pytest.raises(ValueError, match="stride"):
        check_options("none", stride=2)
    with pytest.raises(ValueError, match="aggregation_strategy"):
        check_options("mean")
    tokenizer = load(directories["roberta"])
    with pytest.raises(ValueError, match="stride"):
        tokenizer.encode_windows(LONG, max_length=WINDOW, stride=WINDOW - 2)  # 2 template tokens leave 14
    assert len(tokenizer.encode_windows(LONG, max_length=WINDOW, stride=WINDOW - 3)) > 2
    spans = tokenizer.encode_windows(TEXTS[1])[0]
    assert spans.ids == tokenizer.encode_templated([TEXTS[1]])[0]
    window = Window(spans.pieces, None, spans.special, [False] * len(spans.ids), np.eye(len(LABELS))[[0] * len(
        spans.ids)])
    rules = WordRules.of(tokenizer)
    with pytest.raises(ValueError, match="offsets"):
        aggregate(TEXTS[1], [window], dict(enumerate(LABELS)), rules, "first")
    ungrouped = aggregate(TEXTS[1], [window], dict(enumerate(LABELS)), rules, "none", ignore_labels=[])
    assert [(e.label, e.start, e.index) for e in ungrouped][:2] == [("O", None, 1), ("O", None, 2)]
