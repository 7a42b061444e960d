"""The seq2seq shapes of issue 39 in `python -m benchmarks.compare` (benchmarks/shape_compare.py): their sizes are the
checkpoints', and at toy size every engine gives HF's tokens with NLLB's forced target language (CTranslate2 through
its ``target_prefix``, where installed): greedy on three inputs, and the same work (tokens per row) in beam 4."""

import importlib.util

import pytest
import torch
import transformers

from benchmarks import compare, seq2seq_profile, shape_compare, shapes
from benchmarks.shape_engines import (
    check_decoding,
    ct2_decode,
    ct2_pieces,
    hf_decode,
    hf_generate,
    load_engines,
    ours_decode,
    ours_tokens,
    quantized,
    random_ids,
)
from model import beam_search, logits
from model.checkpoint import load_checkpoint

# the checkpoints' sizes: encoder + decoder layers, d_model, heads, FFN, vocabulary, gated FFN, tied head
SIZES = {"nllb-200-distilled-600m": (12, 12, 1024, 16, 4096, 256206, False, True),
         "flan-t5-base": (12, 12, 768, 12, 2048, 32128, True, False)}
HAS_CT2 = importlib.util.find_spec("ctranslate2") is not None


@pytest.mark.parametrize("name", shape_compare.ISSUE_39)
def test_a_seq2seq_shape_has_its_checkpoints_sizes_and_its_floor_counts_them(name):
    spec = shapes.shape(name)
    config = getattr(transformers, spec.architecture).config_class(**spec.config)
    encoder, decoder, d, heads, ffn, vocab, gated, tied = SIZES[name]
    with torch.device("meta"):  # the parameter count without allocating it
        model = getattr(transformers, spec.architecture)(config)
    if spec.architecture.startswith("T5"):
        assert (config.num_layers, config.num_decoder_layers, config.num_heads, config.d_kv) == (encoder, decoder,
                                                                                               heads, 64)
        assert config.is_gated_act == gated and config.scale_decoder_outputs == tied
        layer = "decoder.block.0."
    else:
        assert (config.encoder_layers, config.decoder_layers, config.encoder_attention_heads) == (encoder, decoder,
                                                                                                 heads)
        assert config.scale_embedding and config.activation_function == "relu" and config.tie_word_embeddings
        assert config.decoder_start_token_id == config.eos_token_id == 2
        layer = "decoder.layers.0."
    assert (config.d_model, config.vocab_size) == (d, vocab)
    weights = {n: p.numel() for n, p in model.named_parameters() if layer in n and n.endswith("weight")
               and "norm" not in n and "relative_attention_bias" not in n}
    cross_kv = ("encoder_attn.k", "encoder_attn.v", "EncDecAttention.k", "EncDecAttention.v")  # once per source
    per_step = sum(v for n, v in weights.items() if not any(k in n for k in cross_kv))
    assert per_step == spec.dims.self_attn + spec.dims.ffn + spec.dims.cross_decode  # what a decoding step reads
    assert max(v for n, v in weights.items() if "wo" in n or "fc2" in n) == ffn * d and spec.dims.vocab == vocab


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = tmp_path_factory.mktemp("shapes")
    engines = {name: load_engines(shapes.build(name, cache, tiny=True), [1]) for name in shape_compare.ISSUE_39}
    yield engines
    for loaded in engines.values():
        loaded.close()  # the CTranslate2 worker processes


@pytest.mark.parametrize("name", shape_compare.ISSUE_39)
def test_every_engine_gives_hfs_greedy_tokens_on_a_tiny_seq2seq_shape(tiny, name):
    """Ours fp32 (and CTranslate2 fp32) equal HF's greedy tokens, NLLB's starting with the target language; the
    forced token counts among the new tokens on every engine."""
    engines = tiny[name]
    assert (engines.forced is not None) == name.startswith("nllb")
    inputs = random_ids(engines.files.shape, 3, 8, seed=7)
    reference = hf_generate(engines.hf, inputs, 1, 6, **({"forced_bos_token_id": engines.forced}
                                                         if engines.forced is not None else {}))[:, 1:].tolist()
    assert ours_tokens(engines.ours, inputs, 1, 6, engines.forced) == reference
    if engines.forced is not None:
        assert {row[0] for row in reference} == {engines.forced}
    rows = check_decoding(engines, 8, 6)
    assert [row[0] for row in rows] == ["ours", "ours int8", "ours bf16",
                                        *(["CT2 fp32", "CT2 int8"] if HAS_CT2 else [])]
    assert all(row[2].startswith("same (3 inputs") for row in rows if not quantized(row[0])), rows
    assert not engines.excluded


@pytest.mark.parametrize("name", shape_compare.ISSUE_39)
def test_every_engine_does_the_same_beam_work_on_a_tiny_seq2seq_shape(tiny, name):
    """Beam 4 at batch 2: every engine returns exactly the new tokens asked for per input (the benchmark's work),
    and ours' best hypotheses are HF's."""
    engines = tiny[name]
    inputs = random_ids(engines.files.shape, 2, 8, seed=9)
    reference = hf_generate(engines.hf, inputs, 4, 5, **({"forced_bos_token_id": engines.forced}
                                                         if engines.forced is not None else {}))[:, 1:].tolist()
    assert ours_tokens(engines.ours, inputs, 4, 5, engines.forced) == reference
    runners = [ours_decode(engines.ours_int8, inputs, 4, 5, engines.forced), hf_decode(engines.hf, inputs, 4, 5,
                                                                                         engines.forced)]
    if HAS_CT2:
        runners.append(ct2_decode(engines.translators["fp32", 1], ct2_pieces(engines.files), inputs, 4, 5,
                                  engines.prefix))
    assert [run() for run in runners] == [[5, 5]] * len(runners)


@pytest.mark.parametrize("name", shape_compare.ISSUE_39)
def test_the_seq2seq_shape_comparison_runs_end_to_end(tmp_path, name):
    out = tmp_path / "report.md"
    compare.main(["--shape", name, "--tiny", "--quick", "--threads", "1", "--repeats", "1", "--cache",
                  str(tmp_path / "cache"), "--out", str(out)])
    report = out.read_text()
    results = report.split("### Results", 1)[1].split("###", 1)[0]
    assert f"{name} greedy | 1 |" in results and f"{name} beam 4 | 2 |" in results
    assert "MISMATCH" not in report and "ours fp32 >= 2x HF" in report.split("### Targets", 1)[1]
    assert ("ours int8 >= CT2 int8" in report) == HAS_CT2 and "ours % of floor" in report.split("### Floor", 1)[1]


def test_the_profile_splits_a_tiny_cell_and_names_the_decoders_path(tmp_path):
    common = ["--shape", "flan-t5-base", "--tiny", "--threads", "1", "--repeats", "1", "--cache", str(tmp_path)]
    native = seq2seq_profile.main([*common, "--beams", "4", "--batch", "2"])
    forced = seq2seq_profile.main([*common, "--pytorch-path"])
    rows = [line.split(" | ")[0].strip("| ") for line in native.splitlines() if line.startswith("| ")][1:]
    assert rows == ["whole cell (generate_seq2seq)", "encoder + cross K/V", "decoder layers, 64 steps",
                    "output head, 64 steps", "search: top-k, beams", "of which the logits' pass", "cache reorder",
                    "the rest"]
    assert "8 rows x 300" in native and ("the C++ decode step" in native) != ("LayerStack.forward" in native)
    assert "LayerStack.forward (PyTorch; --pytorch-path)" in forced


def test_the_profile_times_the_searchs_pass_over_the_logits_within_its_advance(tmp_path):
    files = shapes.build("flan-t5-base", tmp_path, tiny=True)
    checkpoint = load_checkpoint(files.hf, device="cpu")
    inputs = random_ids(files.shape, 2, 8, seed=0)
    with torch.inference_mode():
        parts = seq2seq_profile.cell_parts(checkpoint.model, lambda: ours_tokens(checkpoint, inputs, 4, 8), 1)
    assert 0 < parts["topk"] < parts["advance"] and parts["pick"] == parts["greedy"] == 0  # beam search only
    assert beam_search.fused_beam_top_k is logits.fused_beam_top_k  # the stopwatch put the module's function back


def test_the_profiles_stopwatch_times_methods_and_puts_them_back():
    class Part:
        def run(self) -> int:
            return 1

    part, original = Part(), Part.run
    with seq2seq_profile.Stopwatch({"class": (Part, "run"), "instance": (part, "run")}) as watch:
        assert part.run() == 1 and Part().run() == 1
        counted = dict(watch.seconds)
    assert counted["class"] > 0 and counted["instance"] > 0  # the instance's call ran through both wrappers
    assert Part.run is original and "run" not in vars(part)
