"""The Llama-style decoder shapes of `python -m benchmarks.compare` (benchmarks/decoder_compare.py): their sizes are
the checkpoints', and at toy sizes every engine gives HF's greedy tokens (CTranslate2 and llama.cpp where installed;
llama.cpp's beam search, written in benchmarks/llama_cpp_worker.py, gives HF's beam-4 tokens too)."""

import importlib.util

import pytest
import torch
import transformers

from benchmarks import decoder_compare, llama_cpp_peer, shapes
from benchmarks.cells import Cell
from benchmarks.shape_engines import hf_generate, hf_greedy_reference, load_engines, ours_tokens, random_ids

# the sizes: layers, d_model, heads, KV heads, head_dim, FFN, vocabulary, rope theta, q/k/v bias
SIZES = {"smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, 1e5, False),
         "qwen2.5-0.5b": (24, 896, 14, 2, 64, 4864, 151936, 1e6, True)}


@pytest.mark.parametrize("name", shapes.DECODERS)
def test_a_decoder_shape_has_its_checkpoints_sizes_and_its_floor_counts_them(name):
    spec = shapes.shape(name)
    config = getattr(transformers, spec.architecture).config_class(**spec.config)
    layers, d, heads, kv_heads, head_dim, ffn, vocab, theta, bias = SIZES[name]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (layers, d, heads, kv_heads, head_dim,
                                                                             ffn, vocab)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == theta
    with torch.device("meta"):  # the parameter count without allocating it
        model = getattr(transformers, spec.architecture)(config)
    per_layer = sum(p.numel() for n, p in model.named_parameters() if ".layers.0." in n and n.endswith("weight")
                    and "norm" not in n)
    assert per_layer == spec.dims.self_attn + spec.dims.ffn  # the weights the floor reads per layer and step
    assert any(".layers.0.self_attn.q_proj.bias" in n for n, _ in model.named_parameters()) == bias


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = tmp_path_factory.mktemp("shapes")
    return {name: shapes.build(name, cache, tiny=True) for name in shapes.DECODERS}


@pytest.mark.parametrize("name", shapes.DECODERS)
def test_ours_gives_hfs_greedy_tokens_on_a_tiny_decoder_shape(tiny, name):
    engines = load_engines(tiny[name], [1])
    inputs = random_ids(engines.files.shape, 3, 12, seed=7)
    reference, _ = hf_greedy_reference(engines.hf, inputs, 8)
    assert ours_tokens(engines.ours, inputs, 1, 8) == reference
    assert ours_tokens(engines.ours, inputs[:1], 4, 8)[0] == hf_generate(engines.hf, inputs[:1], 4, 8)[0, 12:].tolist()


@pytest.mark.parametrize("name", shapes.DECODERS)
def test_the_peers_give_hfs_tokens_on_a_tiny_decoder_shape(tiny, name):
    if not importlib.util.find_spec("ctranslate2") or llama_cpp_peer.environment() is None:
        pytest.skip("needs ctranslate2 and the llama.cpp benchmark environment (benchmarks/llama_cpp_setup.sh)")
    engines = load_engines(tiny[name], [1])
    started = decoder_compare.start_peers(tiny[name], [1], decoder_compare.TINY)
    try:
        rows = decoder_compare.check_outputs(engines, started, 8)
        llama = started.llama["llama.cpp F32", 1]
        inputs = random_ids(engines.files.shape, 1, 12, seed=8)
        beam = llama.tokens(inputs.tolist(), 4, 8)[0]
    finally:
        started.close()
    assert [row[0] for row in rows] == ["ours", "ours int8", "ours bf16", "CT2 fp32", "CT2 int8", "llama.cpp F32",
                                        "llama.cpp Q8_0"]
    assert all(row[2].startswith("same (3 inputs") for row in rows if row[0] in ("ours", "CT2 fp32",
                                                                                  "llama.cpp F32")), rows
    assert not engines.excluded
    assert beam == hf_generate(engines.hf, inputs, 4, 8)[0, 12:].tolist()


def test_the_2x_hf_target_is_retired_where_hf_runs_above_half_the_floor():
    """Issue 40's rule: twice HF's rate is not asked for in a cell where HF already reads more than half the floor."""
    cells = [Cell("causal_lm", label, 1, 1, 32, seconds={"ours@1": 1.0, "HF@1": 1.5}) for label in ("greedy p32",
                                                                                                 "greedy p512")]
    share = {("greedy p32", 1, "HF"): 0.3, ("greedy p512", 1, "HF"): 0.6}
    table = decoder_compare.targets_table(cells, share).splitlines()[2:]
    rows = {(row[0], row[1]): row[3] for row in ([c.strip() for c in line.strip("|").split("|")] for line in table)}
    assert rows["ours fp32 >= 2x HF", "greedy p32 b1"] == "MISSED"  # 1.5x, HF at 30% of the floor
    assert rows["ours fp32 >= 2x HF", "greedy p512 b1"].startswith("retired (HF at 60% of the floor)")
