"""The encoder shapes of `python -m benchmarks.compare` (benchmarks/encoder_compare.py): their sizes are the
checkpoints', and at toy size every engine scores the rerank pairs and tags the NER tokens as HF does (ONNX Runtime
where installed)."""

import importlib.util

import pytest
import torch
import transformers

from benchmarks import compare, encoder_compare, ner_compare, shapes
from benchmarks.shape_engines import load_engines, quantized

# the sizes: layers, d_model, heads, FFN, vocabulary, max positions, labels
SIZES = {"xlm-roberta-base": (12, 768, 12, 3072, 250002, 514, 1),
         "distilbert-base": (6, 768, 12, 3072, 30522, 512, 9)}
HAS_ORT = bool(importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnx"))


@pytest.mark.parametrize("name", shapes.ENCODERS)
def test_an_encoder_shape_has_its_checkpoints_sizes_and_its_floor_counts_them(name):
    spec = shapes.shape(name)
    config = getattr(transformers, spec.architecture).config_class(**spec.config)
    layers, d, heads, ffn, vocab, positions, labels = SIZES[name]
    fields = ("n_layers", "dim", "n_heads", "hidden_dim") if name == "distilbert-base" else \
        ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")
    assert [getattr(config, f) for f in fields] == [layers, d, heads, ffn]
    assert (config.vocab_size, config.max_position_embeddings, config.num_labels) == (vocab, positions, labels)
    with torch.device("meta"):  # the parameter count without allocating it
        model = getattr(transformers, spec.architecture)(config)
    per_layer = sum(p.numel() for n, p in model.named_parameters() if "layer.0." in n and n.endswith("weight")
                    and "norm" not in n.lower())
    assert per_layer == spec.dims.self_attn + spec.dims.ffn  # the weights the floor reads per layer
    assert spec.dims.layers == layers and spec.dims.vocab == vocab


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    files = shapes.build("xlm-roberta-base", tmp_path_factory.mktemp("shapes"), tiny=True)
    return load_engines(files, [1])


def test_every_engine_scores_the_padded_pairs_of_a_tiny_reranker_as_hf(reranker):
    """Ours (the service's pad_batch and forward) and ONNX Runtime fp32 give HF's one-label logits on pairs of
    different lengths across two chunks; int8's follow them."""
    grid = encoder_compare.TINY_GRIDS["xlm-roberta-base"]
    pairs = encoder_compare.rerank_pairs(reranker.files.shape, 40, grid, seed=3)
    assert len({len(ids) for ids, _ in pairs}) > 1 and len(pairs) > encoder_compare.CHUNK
    got = {engine: scorer(pairs) for engine, scorer in encoder_compare.scorers(reranker, 1).items()}
    assert set(got) == {"ours", "ours int8", "ours bf16", "HF", *(["ORT fp32", "ORT int8"] if HAS_ORT else [])}
    reference = got.pop("HF")
    assert reference.shape == (40,) and reference.std() > 1e-3  # scores that tell the pairs apart
    alone = encoder_compare.hf_scorer(reranker)  # each pair by itself: chunks' order and padding undone
    assert (torch.cat([alone([pair]) for pair in pairs]) - reference).abs().max() < 1e-5
    for engine, logits in got.items():
        if quantized(engine):
            assert encoder_compare.correlation_with(logits, reference) > 0.95, engine
        else:
            assert (logits - reference).abs().max() < 1e-5, engine
    rows = encoder_compare.check_outputs(reranker, {40: pairs}, 1)
    assert not reranker.excluded and [row[0] for row in rows] == list(got)


@pytest.fixture(scope="module")
def tagger(tmp_path_factory):
    files = shapes.build("distilbert-base", tmp_path_factory.mktemp("shapes"), tiny=True)
    return load_engines(files, [1])


def test_every_engine_gives_hf_token_logits_of_a_tiny_ner_model_on_padded_texts(tagger):
    """Ours (the service's pad_batch and token_logits) and ONNX Runtime fp32 give HF's per-token logits on texts of
    different lengths across two chunks, each row trimmed to its tokens; int8's keep most of HF's labels."""
    lengths = [16, 5, *range(6, 16)] * 3 + [9]
    texts = ner_compare.make_texts(tagger, lengths, seed=3)
    assert len(texts.rows) > ner_compare.CHUNK and [len(r) for r in texts.rows] == lengths
    got = {engine: torch.cat(scorer(texts.rows)) for engine, scorer in ner_compare.scorers(tagger, 1).items()}
    assert set(got) == {"ours", "ours int8", "ours bf16", "HF", *(["ORT fp32", "ORT int8"] if HAS_ORT else [])}
    reference = got.pop("HF")
    alone = ner_compare.hf_scorer(tagger)  # each text by itself: chunks' order and padding undone
    assert (torch.cat([alone([row])[0] for row in texts.rows]) - reference).abs().max() < 1e-5
    labels = len(tagger.files.shape.config["id2label"])
    assert reference.shape == (sum(lengths), labels) and reference.argmax(-1).unique().numel() > 1
    for engine, logits in got.items():
        if quantized(engine):
            assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9, engine
        else:
            assert (logits - reference).abs().max() < 1e-5, engine
    rows = ner_compare.check_outputs(tagger, {"padded": texts.rows}, 1)
    assert not tagger.excluded and [row[0] for row in rows] == list(got)


def test_the_rerank_and_ner_comparisons_run_end_to_end(tmp_path):
    cache = tmp_path / "cache"
    out = tmp_path / "rerank.md"
    compare.main(["--shape", "xlm-roberta-base", "--tiny", "--quick", "--threads", "1", "--cache", str(cache),
                  "--out", str(out)])
    report = out.read_text()
    results = report.split("### Results (pairs/s", 1)[1].split("###", 1)[0]
    assert "rerank 4 docs | 4 |" in results and "rerank 40 docs | 40 |" in results
    assert "ours fp32 >= 1.5x HF" in report and "MISMATCH" not in report
    assert "the floor's" in report.split("### Targets", 1)[1]  # the 40-document cell stands in for 64
    header, _, *rows = [line.split(" | ") for line in report.split("### Floor", 1)[1].splitlines()
                        if line.startswith("| ")]
    bf16 = header.index("ours bf16 % of floor")  # held against a bf16 floor (benchmarks.floor's bf16 GEMM rate)
    assert rows and all(row[bf16].endswith("%") for row in rows)
    ner = tmp_path / "ner.md"
    compare.main(["--shape", "distilbert-base", "--tiny", "--quick", "--threads", "1", "--cache", str(cache),
                  "--out", str(ner)])
    report = ner.read_text()
    results = report.split("### Results (texts/s", 1)[1].split("###", 1)[0]
    assert all(f"NER batch {n} | {n} |" in results for n in ner_compare.TINY_GRIDS["distilbert-base"].batches)
    assert "ours fp32 >= 1.5x HF" in report and "MISMATCH" not in report and "Entity aggregation" in report
    assert "ours int8 % of floor" in report.split("### Floor", 1)[1]
