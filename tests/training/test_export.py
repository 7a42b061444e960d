"""`python -m training export --to hf`: the exports load in `transformers` (and CTranslate2) and agree with ours.

Tiny models with a real tokenizer and random seeded weights (LayerNorms included, so a wrongly permuted
or transposed tensor shows); logits must agree to 1e-4 and greedy/beam outputs token for token.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.causal_lm import CausalLM
from model.checkpoint import load_checkpoint, save_checkpoint
from model.classifier import TransformerClassifier
from model.config import CausalLMConfig, ClassifierConfig, Seq2SeqConfig
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.layers import sinusoidal_table
from model.seq2seq import Seq2SeqTransformer
from model.tokenizer import Tokenizer, pad_batch
from tests.hf_compare import ATOL, DECODINGS, MAX_NEW, assert_varied, best_tokens, decoding, randomize, strip
from training.export import ExportError, export_hf
from training.export.marian import permutation

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "copy %s files into {name}",
    "this is a small test of the exporter and the lazy dog jumps over the quick brown fox again",
    "print %d lines",
]
CORPUS = [*SOURCES, "une phrase en français, avec des accents: été, déjà", "numbers 12345 and symbols #@!"] * 4
TEXTS = ["hello world", "the lazy fox jumps", "copy %s into {name}", "été déjà vu", "new words: zebra quartz 日本"]
SIZES = dict(d_model=32, n_heads=4, d_ff=64, dropout=0.0, max_len=64)
MARIAN = dict(positions="sinusoidal", norm="post", activation="relu", scale_embeddings=True, tie_embeddings=True)
GPT2 = dict(positions="learned", norm="pre", activation="gelu_tanh", scale_embeddings=False)
BERT = dict(positions="learned", norm="post", activation="gelu", scale_embeddings=False, embedding_norm=True)
LABELS = ["negative", "neutral", "positive"]


def fit_reversal(model: Seq2SeqTransformer, tokenizer: Tokenizer, steps: int = 60) -> Seq2SeqTransformer:
    """Teach SOURCES -> their words reversed, so greedy/beam outputs vary and some end in EOS within MAX_NEW.

    (Random post-LN encoder-decoders with tied embeddings repeat one token forever.)
    """
    sources = tokenizer.encode_batch(SOURCES, add_eos=True)  # served (and trained) sources end in </s>
    targets = tokenizer.encode_batch([" ".join(s.split()[::-1]) for s in SOURCES])
    src, _ = pad_batch(sources, tokenizer.pad_id)
    tgt_in, _ = pad_batch([[tokenizer.bos_id, *t] for t in targets], tokenizer.pad_id)
    tgt_out, _ = pad_batch([[*t, tokenizer.eos_id] for t in targets], -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt_out.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(CORPUS, vocab_size=300, min_frequency=1)


def _save(root: Path, name: str, model: torch.nn.Module, tokenizer: Tokenizer, **kwargs) -> Path:
    return save_checkpoint(root / name, model, tokenizer, **kwargs)


@pytest.fixture(scope="module")
def seq2seq(tokenizer, tmp_path_factory):
    """(our model, checkpoint dir, export dir) for the paper's configuration."""
    root = tmp_path_factory.mktemp("seq2seq")
    config = Seq2SeqConfig(
        vocab_size=tokenizer.vocab_size, n_encoder_layers=2, n_decoder_layers=2, max_src_len=64, **SIZES, **MARIAN
    )
    torch.manual_seed(0)
    model = fit_reversal(randomize(Seq2SeqTransformer(config), seed=1), tokenizer)
    ckpt = _save(root, "ckpt", model, tokenizer)
    return model, ckpt, export_hf(ckpt, root / "hf")


@pytest.fixture(scope="module")
def causal(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("causal")
    config = CausalLMConfig(vocab_size=tokenizer.vocab_size, n_layers=2, layer_norm_eps=1e-6, **SIZES, **GPT2)
    model = randomize(CausalLM(config), seed=0, eos_boost=1.5)  # varied lengths after "<s>" prompts
    ckpt = _save(root, "ckpt", model, tokenizer)
    return model, ckpt, export_hf(ckpt, root / "hf")


@pytest.fixture(scope="module")
def classifier(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("classifier")
    config = ClassifierConfig(
        vocab_size=tokenizer.vocab_size, n_layers=2, num_labels=3, layer_norm_eps=1e-12, **SIZES, **BERT
    )
    model = randomize(TransformerClassifier(config), seed=3)
    ckpt = _save(root, "ckpt", model, tokenizer, labels=LABELS)
    return model, ckpt, export_hf(ckpt, root / "hf")


def _hf(cls_name: str, path: Path) -> torch.nn.Module:
    model, info = getattr(transformers, cls_name).from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


# ---- Marian -------------------------------------------------------------------------------------


def test_permutation_maps_our_positions_onto_marians_table():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    d = SIZES["d_model"]
    theirs = MarianSinusoidalPositionalEmbedding(SIZES["max_len"], d).create_weight()
    ours = sinusoidal_table(SIZES["max_len"], d)
    torch.testing.assert_close(ours[:, permutation(d)], theirs, atol=1e-6, rtol=0)
    assert not torch.allclose(ours, theirs, atol=1e-3)  # the layouts really differ


def test_marian_logits_match(seq2seq, tokenizer):
    model, _, out = seq2seq
    hf = _hf("MarianMTModel", out)
    src, _ = pad_batch(tokenizer.encode_batch(TEXTS), tokenizer.pad_id)
    tgt, _ = pad_batch([[tokenizer.bos_id, *ids] for ids in tokenizer.encode_batch(TEXTS[::-1])], tokenizer.pad_id)
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = hf(input_ids=src, attention_mask=(src != tokenizer.pad_id).long(), decoder_input_ids=tgt).logits
    assert (ours - theirs[..., :-1]).abs().max() < ATOL
    assert torch.isneginf(theirs[..., -1]).all()  # the row appended for CTranslate2 is never chosen


@pytest.mark.parametrize("strategy", DECODINGS)
def test_marian_generate_matches(seq2seq, tokenizer, strategy):
    """transformers' plain path, tokenizer(text) + generate(), gives what the service gives (sources + </s>)."""
    model, ckpt, out = seq2seq
    hf = _hf("MarianMTModel", out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours_config, hf_kwargs = decoding(strategy)
    texts = [*SOURCES, "new words: zebra quartz"]
    ours = best_tokens(generate_seq2seq(model, load_checkpoint(ckpt).encode_prompts(texts), ours_config))
    batch = hf_tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.generate(**batch, **hf_kwargs).tolist()
    assert [strip(seq, 1) for seq in theirs] == ours
    assert all(seq[0] == tokenizer.bos_id for seq in theirs)
    assert_varied(ours)


def test_ctranslate2_greedy_matches(seq2seq, tokenizer, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from ctranslate2.converters import TransformersConverter

    model, ckpt, out = seq2seq
    converted = TransformersConverter(str(out)).convert(str(tmp_path / "ct2"))
    translator = ctranslate2.Translator(converted, device="cpu", compute_type="float32")
    sources = load_checkpoint(ckpt).encode_prompts([*SOURCES, "new words: zebra quartz"])  # as the service does
    ours = best_tokens(generate_seq2seq(model, sources, GenerationConfig(max_new_tokens=MAX_NEW)))
    pieces = [[tokenizer.backend.id_to_token(i) for i in ids] for ids in sources]
    results = translator.translate_batch(pieces, beam_size=1, max_decoding_length=MAX_NEW)
    theirs = [[tokenizer.backend.token_to_id(t) for t in r.hypotheses[0]] for r in results]
    assert theirs == ours
    assert_varied(ours)


# ---- GPT-2 --------------------------------------------------------------------------------------


def test_gpt2_logits_match(causal, tokenizer):
    model, _, out = causal
    hf = _hf("GPT2LMHeadModel", out)
    ids, lengths = pad_batch(tokenizer.encode_batch(TEXTS), tokenizer.pad_id)
    real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]  # right padding: compare real positions
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(input_ids=ids, attention_mask=real.long()).logits
    assert (ours - theirs)[real].abs().max() < ATOL


@pytest.mark.parametrize("strategy", DECODINGS)
def test_gpt2_generate_matches(causal, tokenizer, strategy):
    """transformers' plain path, tokenizer(text) + generate(), gives what the service gives (<s> + prompt)."""
    model, ckpt, out = causal
    hf = _hf("GPT2LMHeadModel", out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours_config, hf_kwargs = decoding(strategy)
    ours = best_tokens(generate_causal(model, load_checkpoint(ckpt).encode_prompts(TEXTS), ours_config))
    batch = hf_tok(TEXTS, padding=True, return_tensors="pt")  # left-padded, as the export asks
    assert hf_tok.padding_side == "left" and set(batch) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        theirs = hf.generate(**batch, **hf_kwargs).tolist()
    assert [strip(seq, batch["input_ids"].shape[1]) for seq in theirs] == ours
    assert_varied(ours)


# ---- BERT ---------------------------------------------------------------------------------------


def test_bert_logits_match(classifier, tokenizer):
    model, _, out = classifier
    hf = _hf("BertForSequenceClassification", out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    firsts, seconds = TEXTS[:3], ["a second segment", "the fox", "{name}"]
    pairs = [tokenizer.encode_pair(a, b) for a, b in zip(firsts, seconds, strict=True)]
    ids, _ = pad_batch([p[0] for p in pairs], tokenizer.pad_id)
    segments, _ = pad_batch([p[1] for p in pairs], 0)
    batch = hf_tok(firsts, seconds, padding=True, return_tensors="pt")  # [CLS] a [SEP] b [SEP], segments 0/1
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["token_type_ids"], segments)
    with torch.no_grad():
        ours = model(ids, segments)
        theirs = hf(**batch).logits
    assert (ours - theirs).abs().max() < ATOL
    assert hf.config.id2label == dict(enumerate(LABELS)) and hf.config.label2id["neutral"] == 1


VARIANTS = [
    ("seq2seq", {**MARIAN, "tie_embeddings": False, "scale_embeddings": False, "bias": False, "activation": "gelu"}),
    ("seq2seq", {**MARIAN, "activation": "silu", "head_bias": True}),  # lm_head.bias -> final_logits_bias
    ("causal_lm", {**GPT2, "tie_embeddings": False, "bias": False, "activation": "relu"}),
    ("classifier", {**BERT, "bias": False, "activation": "gelu_tanh", "type_vocab_size": 0}),  # zero type row
]


def _both_logits(family: str, model: torch.nn.Module, hf: torch.nn.Module, tokenizer: Tokenizer):
    """Our logits and HF's on a right-padded batch of TEXTS (padding positions zeroed)."""
    seqs = tokenizer.encode_batch(TEXTS)
    if family == "classifier":
        ids, _ = pad_batch([tokenizer.encode_pair(t)[0] for t in TEXTS], tokenizer.pad_id)
        return model(ids), hf(input_ids=ids, attention_mask=(ids != tokenizer.pad_id).long()).logits
    ids, lengths = pad_batch(seqs, tokenizer.pad_id)
    real = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    if family == "causal_lm":
        return model(ids) * real[..., None], hf(input_ids=ids, attention_mask=real).logits * real[..., None]
    tgt, _ = pad_batch([[tokenizer.bos_id, *s] for s in seqs[::-1]], tokenizer.pad_id)
    return model(ids, tgt), hf(input_ids=ids, attention_mask=real, decoder_input_ids=tgt).logits[..., :-1]


@pytest.mark.parametrize(("family", "fields"), VARIANTS, ids=[f for f, _ in VARIANTS])
def test_other_exact_configs_export(family, fields, tokenizer, tmp_path):
    """Fields the architecture can express another way: untied heads, no biases (zeros), other activations,
    a head bias."""
    fields = {**SIZES, **fields, "vocab_size": tokenizer.vocab_size}
    if family == "seq2seq":
        model = Seq2SeqTransformer(Seq2SeqConfig(n_encoder_layers=1, n_decoder_layers=2, max_src_len=64, **fields))
    elif family == "causal_lm":
        model = CausalLM(CausalLMConfig(n_layers=2, **fields))
    else:
        model = TransformerClassifier(ClassifierConfig(n_layers=2, num_labels=3, **fields))
    randomize(model, seed=5)
    labels = LABELS if family == "classifier" else None
    out = export_hf(_save(tmp_path, "ckpt", model, tokenizer, labels=labels), tmp_path / "hf")
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    with torch.no_grad():
        ours, theirs = _both_logits(family, model, _hf(architecture, out), tokenizer)
    assert (ours - theirs).abs().max() < ATOL


# ---- tokenizer, refusals, CLI -------------------------------------------------------------------


@pytest.mark.parametrize("family", ["seq2seq", "causal", "classifier"])
def test_hf_tokenizer_encodes_and_decodes_likeours(family, tokenizer, request):
    out = request.getfixturevalue(family)[2]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id) == (0, 1, 2, 3)
    served = load_checkpoint(request.getfixturevalue(family)[1])
    for text in [*TEXTS, "  spaces  and\ttabs\n", "100% done, {0} left"]:
        ids = tokenizer.encode(text)
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
        wanted = served.encode_prompts([text])[0] if family != "classifier" else tokenizer.encode_pair(text)[0]
        assert hf_tok(text)["input_ids"] == wanted  # the template: what the service feeds the model
        assert hf_tok.decode(ids) == tokenizer.decode(ids) == text
        with_specials = [tokenizer.bos_id, *ids, tokenizer.eos_id]
        assert hf_tok.decode(with_specials, skip_special_tokens=True) == tokenizer.decode(with_specials)


def test_export_writes_hf_files(seq2seq, causal, classifier):
    for (_, _, out), architecture in (
        (seq2seq, "MarianMTModel"),
        (causal, "GPT2LMHeadModel"),
        (classifier, "BertForSequenceClassification"),
    ):
        assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
        for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (out / name).is_file(), name
    assert json.loads((seq2seq[2] / "generation_config.json").read_text())["decoder_start_token_id"] == 1
    assert not (classifier[2] / "generation_config.json").exists()


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("seq2seq", {"norm": "pre"}, "norm='pre' but MarianMTModel needs post-LN"),
        ("seq2seq", {"positions": "learned"}, "positions='learned' but MarianMTModel needs sinusoidal positions"),
        ("seq2seq", {"embedding_norm": True}, "embedding_norm=True but MarianMTModel needs no embedding LayerNorm"),
        ("seq2seq", {"layer_norm_eps": 1e-6}, "layer_norm_eps=1e-06 but MarianMTModel needs LayerNorm eps 1e-5"),
        ("causal_lm", {"norm": "post"}, "norm='post' but GPT2LMHeadModel needs pre-LN"),
        ("causal_lm", {"positions": "sinusoidal"}, "positions='sinusoidal' but GPT2LMHeadModel needs learned"),
        ("causal_lm", {"scale_embeddings": True}, "scale_embeddings=True but GPT2LMHeadModel needs unscaled"),
        ("classifier", {"embedding_norm": False}, "embedding_norm=False but BertForSequenceClassification needs"),
        ("classifier", {"norm": "pre"}, "norm='pre' but BertForSequenceClassification needs post-LN"),
        ("classifier", {"pooler": False}, "pooler=False but BertForSequenceClassification needs the dense + tanh"),
    ],
)
def test_mismatched_configs_are_refused(family, overrides, message, tokenizer, tmp_path):
    base = {"seq2seq": MARIAN, "causal_lm": GPT2, "classifier": BERT}[family]
    fields = {**SIZES, **base, **overrides, "vocab_size": tokenizer.vocab_size}
    if family == "seq2seq":
        model = Seq2SeqTransformer(Seq2SeqConfig(n_encoder_layers=1, n_decoder_layers=1, max_src_len=64, **fields))
    elif family == "causal_lm":
        model = CausalLM(CausalLMConfig(n_layers=1, **fields))
    else:
        model = TransformerClassifier(ClassifierConfig(n_layers=1, num_labels=3, **fields))
    ckpt = _save(tmp_path, "ckpt", model, tokenizer, labels=LABELS if family == "classifier" else None)
    with pytest.raises(ExportError, match=message.replace("+", r"\+")):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("architecture", "message"), [
    ("roberta", "position_offset=2 but BertForSequenceClassification needs positions counted from 0"),
    ("distilbert", "pooler_activation='relu' but BertForSequenceClassification needs the dense \\+ tanh pooler"),
], ids=["roberta", "distilbert"])
def test_imported_bert_likes_are_refused_by_name(architecture, message, tmp_path):
    """RoBERTa's offset positions and DistilBERT's ReLU pre_classifier are no BERT: refused, not exported wrong."""
    from tests.model.hf_encoders import encoder_directory
    from training.import_cmd import import_hf

    ckpt = import_hf(encoder_directory(tmp_path / "source", architecture, "single"), tmp_path / "ckpt")
    with pytest.raises(ExportError, match=message):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("activation", "problem_type"), [("softmax", "single_label_classification"),
                                                          ("sigmoid", "multi_label_classification"),
                                                          ("none", "regression")], ids=["softmax", "sigmoid", "none"])
def test_output_activation_exports_as_problem_type(activation, problem_type, tokenizer, tmp_path):
    """Multi-label and regression classifiers say so in config.json, and import back as they were."""
    config = ClassifierConfig(vocab_size=tokenizer.vocab_size, n_layers=1, num_labels=3, layer_norm_eps=1e-12,
                              output_activation=activation, **SIZES, **BERT)
    model = randomize(TransformerClassifier(config), seed=7)
    out = export_hf(_save(tmp_path, "ckpt", model, tokenizer, labels=LABELS), tmp_path / "hf")
    assert _hf("BertForSequenceClassification", out).config.problem_type == problem_type
    back = load_checkpoint(out, device="cpu")
    assert back.config.output_activation == activation
    ids, _ = pad_batch([tokenizer.encode_pair(t)[0] for t in TEXTS], tokenizer.pad_id)
    with torch.no_grad():
        assert (back.model(ids) - model(ids)).abs().max() < ATOL


def test_existing_output_is_not_overwritten_by_default(seq2seq, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty directory"):
        export_hf(seq2seq[1], out)
    assert (out / "keep.txt").read_text() == "mine"
    export_hf(seq2seq[1], out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_exports_and_reports_refusals(causal, tokenizer, tmp_path):
    model, ckpt, _ = causal
    done = _cli("export", "--model", str(ckpt), "--to", "hf", "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    hf = _hf("GPT2LMHeadModel", tmp_path / "hf")
    ids = torch.tensor([tokenizer.encode(TEXTS[0])])
    with torch.no_grad():
        assert (model(ids) - hf(input_ids=ids).logits).abs().max() < ATOL

    bad = _save(
        tmp_path, "bad", CausalLM(CausalLMConfig(vocab_size=tokenizer.vocab_size, n_layers=1, **SIZES)), tokenizer
    )
    refused = _cli("export", "--model", str(bad), "--to", "hf", "--out", str(tmp_path / "bad_hf"))
    assert refused.returncode == 1
    assert "error: positions='sinusoidal' but GPT2LMHeadModel needs learned positions" in refused.stderr
