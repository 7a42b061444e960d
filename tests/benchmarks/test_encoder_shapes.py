"""The encoder shapes of `python -m benchmarks.compare` (benchmarks/encoder_compare.py): their sizes are the
checkpoints', and at toy size every engine scores the rerank pairs as HF does (ONNX Runtime where installed)."""

import importlib.util

import pytest
import torch
import transformers

from benchmarks import compare, encoder_compare, shapes
from benchmarks.shape_engines import load_engines

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
    assert set(got) == {"ours", "ours int8", "HF", *(["ORT fp32", "ORT int8"] if HAS_ORT else [])}
    reference = got.pop("HF")
    assert reference.shape == (40,) and reference.std() > 1e-3  # scores that tell the pairs apart
    for engine, logits in got.items():
        if "int8" in engine:
            assert encoder_compare.correlation_with(logits, reference) > 0.95, engine
        else:
            assert (logits - reference).abs().max() < 1e-5, engine
    rows = encoder_compare.check_outputs(reranker, {40: pairs}, 1)
    assert not reranker.excluded and [row[0] for row in rows] == list(got)


def test_the_rerank_comparison_runs_end_to_end_and_the_ner_shape_waits_for_its_head(tmp_path):
    cache = tmp_path / "cache"
    out = tmp_path / "rerank.md"
    compare.main(["--shape", "xlm-roberta-base", "--tiny", "--quick", "--threads", "1", "--cache", str(cache),
                  "--out", str(out)])
    report = out.read_text()
    results = report.split("### Results (pairs/s", 1)[1].split("###", 1)[0]
    assert "rerank 4 docs | 4 |" in results and "rerank 40 docs | 40 |" in results
    assert "ours fp32 >= 1.5x HF" in report and "MISMATCH" not in report
    assert "the floor's" in report.split("### Targets", 1)[1]  # the 40-document cell stands in for 64
    ner = tmp_path / "ner.md"
    compare.main(["--shape", "distilbert-base", "--tiny", "--cache", str(cache), "--out", str(ner)])
    assert "a later step" in ner.read_text() and not (cache / "distilbert-base-tiny").exists()
