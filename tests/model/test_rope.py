"""Rotary positions (model/rope.py, model/hf/rope.py) against transformers' own computation.

transformers computes the inverse frequencies and the angles in float32 (even in a float64 model), so ours are
checked bit for bit against ``ROPE_INIT_FUNCTIONS`` and ``LlamaRotaryEmbedding`` rather than against float64;
partial rotary (no Llama-family importer of transformers' partial models here yet) against a float64 formula.
End to end, a tiny LlamaForCausalLM per scaling type: logits past the original length, a cached decode step by
step (dynamic and longrope change frequencies mid-generation; earlier keys keep theirs), greedy generate() on a
left-padded batch.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from model.config import CausalLMConfig, ModelConfigError
from model.generation import generate_causal
from model.hf import HFImportError, load_hf_model
from model.hf.rope import rope_fields
from model.rope import Rotary, inverse_frequencies
from tests.hf_compare import ATOL, best_tokens, decoding, randomize
from tests.model.test_hf_llama import LLAMA, PROMPTS, hf_greedy, hf_model, save_llama

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding  # noqa: E402

ORIGINAL = 16  # max_position_embeddings of the end-to-end models: prompts and outputs go past it
HEAD_DIM = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 4},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 8,
                    "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 0.5, "truncate": False},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.5, 2.0, 3.0, 5.0],
                 "original_max_position_embeddings": ORIGINAL // 2},
}


def hf_config(scaling: dict, **overrides) -> transformers.LlamaConfig:
    fields = {**LLAMA, "max_position_embeddings": ORIGINAL, **overrides}
    return transformers.LlamaConfig(**fields, rope_parameters={**scaling, "rope_theta": 500.0})


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
def test_frequencies_and_attention_factor_equal_transformers(scaling, partial):
    """Bit for bit, at the initial length, at and past the original one (an int64 tensor too, as dynamic gets)."""
    hidden = int(LLAMA["hidden_size"] / partial)  # rotary width 8 either way: longrope's 4 factors fit
    config = hf_config({**scaling, "partial_rotary_factor": partial}, hidden_size=hidden)
    ours = rope_fields(config.to_dict(), config.head_dim)
    rotary_dim = ours["rotary_dim"] or config.head_dim
    assert rotary_dim == HEAD_DIM and (ours["rotary_dim"] is None) == (partial == 1.0)
    # Phi-3's default rotary reads partial_rotary_factor (Llama's rotates whole heads), as the other types do
    init = ROPE_INIT_FUNCTIONS.get(scaling["rope_type"], Phi3RotaryEmbedding.compute_default_rope_parameters)
    for seq_len in (None, ORIGINAL, ORIGINAL + 1, 100, torch.tensor(100)):
        expected, attention = init(config, None, seq_len=seq_len)
        inv_freq, factor = inverse_frequencies(rotary_dim, ours["rope_theta"], ours["rope_scaling"], seq_len)
        assert torch.equal(inv_freq, expected) and factor == attention, (seq_len, inv_freq, expected)


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
def test_cos_sin_equal_llama_rotary_embedding_at_every_length(scaling):
    """transformers' module (attention factor, dynamic_rope_update), fresh per call: its state is one call's."""
    config = hf_config(scaling)
    ours = Rotary(HEAD_DIM, **_rotary_kwargs(config)).to(torch.bfloat16)  # frequencies stay float32
    for length in (3, ORIGINAL, ORIGINAL + 1, 40):
        positions = torch.stack([torch.arange(length), torch.arange(length).clamp(max=5)])  # rows differ
        cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)
        assert all(map(torch.equal, ours.cos_sin(positions), (cos, sin))), length


def _rotary_kwargs(config: transformers.PretrainedConfig) -> dict:
    fields = rope_fields(config.to_dict(), HEAD_DIM)
    return {"theta": fields["rope_theta"], "scaling": fields["rope_scaling"], "rotary_dim": fields["rotary_dim"]}


def test_partial_rotary_rotates_the_first_features_and_passes_the_rest():
    """Float64 reference of the formula: pairs (i, i + R/2) of the first R features turn by position * theta^(-2i/R).
    Our angles are float32 (as transformers'), which bounds the difference at ~1e-5 for positions up to 40."""
    head_dim, rotary_dim, theta = 12, 8, 500.0
    x = torch.randn(2, 3, 41, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(41)[None]
    ours = Rotary(head_dim, theta, rotary_dim=rotary_dim)(x, positions)
    half = rotary_dim // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angles = positions[0, :, None].double() * inv  # (T, R/2)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:rotary_dim]
    expected = torch.cat((first * cos - second * sin, second * cos + first * sin, x[..., rotary_dim:]), dim=-1)
    assert (ours - expected).abs().max() < 1e-5
    assert torch.equal(ours[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
def test_scaled_llama_equals_transformers_past_the_original_length(tmp_path, scaling):
    # dynamic grows past max_position_embeddings (our limit: 3 x 16); the others' originals are below it
    max_positions = ORIGINAL if scaling["rope_type"] == "dynamic" else 2 * ORIGINAL
    directory = save_llama(tmp_path / "llama", seed=3, eos_boost=0.0, max_position_embeddings=max_positions,
                           rope_parameters={**scaling, "rope_theta": 500.0})
    for dtype, tolerance in ((torch.float64, 1e-5), (torch.float32, ATOL)):  # rope in float32 bounds float64
        ours, config = load_hf_model(directory, dtype)
        hf = hf_model(directory, dtype)
        for length in (ORIGINAL // 2, 42):  # within and past dynamic's and longrope's original lengths
            ids = torch.tensor([(PROMPTS[1] * 6)[:length]])
            with torch.no_grad():
                diff = (ours(ids) - hf(input_ids=ids).logits).abs().max()
            assert diff < tolerance, (length, dtype, float(diff))
    assert (config.rope_scaling or {"rope_type": "default"})["rope_type"] == scaling["rope_type"]
    assert config.max_len == (3 * ORIGINAL if scaling["rope_type"] == "dynamic" else max_positions)
    # cached, token by token past the original length: dynamic / longrope frequencies change mid-way and the keys
    # already cached keep the ones they were written with, as in transformers' cache
    tokens = (PROMPTS[1] * 4)[:24]
    cache = ours.new_cache(1, 32)
    with torch.no_grad():
        logits = ours.prefill(torch.tensor([tokens[:6]]), torch.tensor([6]), cache)
        out = hf(input_ids=torch.tensor([tokens[:6]]), use_cache=True)
        for token in tokens[6:]:
            assert (logits - out.logits[:, -1]).abs().max() < ATOL
            logits = ours.decode_step(torch.tensor([token]), cache)
            out = hf(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    # greedy generate() of a left-padded batch (prompts of 3 and 7 tokens, 12 new: past every original length)
    ours_config, hf_kwargs = decoding("greedy")
    prompts = [PROMPTS[0], PROMPTS[1]]
    assert best_tokens(generate_causal(ours, prompts, ours_config)) == hf_greedy(directory, prompts, hf_kwargs)


CONFIG_JSON = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}


@pytest.mark.parametrize(
    "hf",
    [
        {"rope_theta": 1e4},
        {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 5e5},  # files before rope_parameters
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16,
                             "rope_theta": 300.0}},  # factor from the lengths
        {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 300.0}},  # original = max
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32, "rope_theta": 5e5}},
        {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                             "rope_theta": 1e4}, "original_max_position_embeddings": 8},  # Phi-3 keeps it outside
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "partial_rotary_factor": 0.5},
    ],
)
def test_rope_fields_read_configs_as_transformers_standardizes_them(hf):
    raw = {**CONFIG_JSON, **hf}
    config = transformers.LlamaConfig(**json.loads(json.dumps(raw)))
    ours = rope_fields(raw, 8)
    rope_type = config.rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS.get(rope_type, Phi3RotaryEmbedding.compute_default_rope_parameters)
    expected, attention = init(config, None)
    inv_freq, factor = inverse_frequencies(ours["rotary_dim"] or 8, ours["rope_theta"], ours["rope_scaling"])
    assert torch.equal(inv_freq, expected) and factor == attention
    CausalLMConfig(positions="rope", d_model=32, n_heads=4, **ours)  # our config accepts what the reader gives


@pytest.mark.parametrize(
    ("hf", "says"),
    [
        ({"rope_parameters": {"rope_type": "proportional"}}, "rope type 'proportional' is not supported"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope type 'su' is not supported"),
        ({"rope_parameters": {"rope_type": "linear"}}, r"needs \['factor'\]"),
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
         "short_factor must be a list of 4"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
        ({"partial_rotary_factor": 0.375}, "odd rotary width"),
        ({"rope_theta": -1.0}, "rope_theta=-1.0"),
    ],
)
def test_rope_fields_refuse_what_we_cannot_compute_by_name(hf, says):
    with pytest.raises(HFImportError, match=says):
        rope_fields({**CONFIG_JSON, **hf}, 8)


def test_rope_fields_per_layer_type_and_aliases():
    nested = {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert rope_fields(nested, 8, layer_type="sliding_attention") == {
        "rope_theta": 1e4, "rope_scaling": None, "rotary_dim": None}
    assert rope_fields(nested, 8, layer_type="full_attention")["rope_scaling"] == {"rope_type": "linear",
                                                                                  "factor": 8.0}
    phi = {"rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
           "original_max_position_embeddings": 16, "max_position_embeddings": 64}
    scaling = rope_fields(phi, 8, aliases={"su": "longrope"})["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and scaling["factor"] == 4.0


def test_configs_keep_rope_fields_and_old_rope_scale_loads_as_linear():
    config = CausalLMConfig(positions="rope", d_model=32, n_heads=4, rotary_dim=4,
                            rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8})
    assert CausalLMConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    old = {**CausalLMConfig(positions="rope").to_dict(), "rope_scale": 4.0}
    del old["rope_scaling"], old["rotary_dim"]
    assert CausalLMConfig.from_dict(old).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    for bad, says in [({"rope_scaling": {"rope_type": "ntk"}}, "rope_type 'ntk'"),
                      ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}}, r"unknown keys \['beta'\]"),
                      ({"rotary_dim": 5}, "even"), ({"rotary_dim": 10}, "rotary_dim"),
                      ({"positions": "learned", "rotary_dim": 4}, 'need positions="rope"')]:
        with pytest.raises(ModelConfigError, match=says):
            CausalLMConfig(**{"positions": "rope", "d_model": 32, "n_heads": 4, **bad})
    assert math.isclose(Rotary(8, 10.0, {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 8}).attention_factor,
                        0.1 * math.log(4.0) + 1)


@pytest.mark.parametrize("rope", [{}, {"rope_type": "longrope", "short_factor": [1.0, 1.4],
                                       "long_factor": [2.0, 3.0]}], ids=["default", "longrope"])
def test_phi3_partial_rotary_equals_transformers(tmp_path, rope):
    """Phi-3's partial_rotary_factor (half of each head rotated, the rest passed through), longrope over it.

    generate() on Phi-3 discards its cache and recomputes the whole sequence when the batch's width first passes
    original_max_position_embeddings (model/rope.py: ours does not); a prompt already past it has nothing cached
    then, so a batch with one is compared."""
    fields = {**LLAMA, "max_position_embeddings": 4 * ORIGINAL, "original_max_position_embeddings": ORIGINAL,
              "pad_token_id": LLAMA["eos_token_id"], "partial_rotary_factor": 0.5}
    config = transformers.Phi3Config(**fields, rope_parameters={"rope_theta": 500.0, **rope} if rope else None)
    directory = tmp_path / "phi3"
    randomize(transformers.Phi3ForCausalLM(config), seed=4, eos_boost=0.0).save_pretrained(directory)
    ours, ours_config = load_hf_model(directory)
    assert ours_config.rotary_dim == HEAD_DIM // 2
    hf = hf_model(directory)
    for length in (ORIGINAL // 2, 42):
        ids = torch.tensor([(PROMPTS[1] * 6)[:length]])
        with torch.no_grad():
            diff = (ours(ids) - hf(input_ids=ids).logits).abs().max()
        assert diff < ATOL, (length, float(diff))
    ours_config, hf_kwargs = decoding("greedy")
    prompts = [PROMPTS[0], PROMPTS[1] * 3]  # 3 and 21 tokens
    assert best_tokens(generate_causal(ours, prompts, ours_config)) == hf_greedy(directory, prompts, hf_kwargs)
