"""The Llama family's decoders (model/hf/llama.py, mistral.py, qwen2.py, qwen3.py, phi3.py, gemma3.py) against
`transformers` itself.

Each architecture and config variant is a random tiny model saved by transformers (RMSNorm gains random, so
Gemma's (1 + w) differs from Llama's w): logits equal to transformers' over a sequence several times longer than
a sliding window of 4, greedy decoding of a left-padded batch token for token (prompts and outputs longer than the
window), cached decoding equal to uncached and to speculative decoding (verify steps of several tokens), beam-4
equal to generate(num_beams=4) on a few variants, configs that round-trip through JSON, and what we cannot express
refused by name. Decoding runs on model.fast_step's C++ step where it implements every field of the config
(model.native_support.unsupported), on the PyTorch blocks otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.build import build_model
from model.config import CausalLMConfig
from model.generation import generate_causal
from model.hf import HFImportError, load_hf_model
from model.speculative import SpeculativeConfig
from tests.hf_compare import ATOL, best_tokens, decoding, randomize, strip

transformers = pytest.importorskip("transformers")

VOCAB, EOS, WINDOW = 96, 2, 4
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
# model_type -> (config class, model class, the fields every variant of it has)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # 3 layers, every second one global: local, global, local
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"num_hidden_layers": 3, "head_dim": 8,
                                                              "sliding_window": WINDOW, "sliding_window_pattern": 2,
                                                              "query_pre_attn_scalar": 6, "tie_word_embeddings": True}),
}
QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}  # layer 1 windowed
VARIANTS = {  # id -> (model_type, overrides)
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-gqa": ("llama", {}),
    "llama-mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama-head_dim-12-biases": ("llama", {"head_dim": 12, "attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500.0}),
    "mistral-window": ("mistral", {}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),
    "mistral-mqa-tied": ("mistral", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-window-tied": ("qwen2", {**QWEN_WINDOW, "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-bias-window-head_dim-12": ("qwen3", {**QWEN_WINDOW, "attention_bias": True, "head_dim": 12}),
    "phi3": ("phi3", {}),
    "phi3-partial-window": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": WINDOW}),
    "gemma3": ("gemma3_text", {}),
    "gemma3-linear-untied": ("gemma3_text", {"tie_word_embeddings": False, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
}
BEAM_VARIANTS = ["mistral-window", "qwen3-bias-window-head_dim-12", "gemma3-linear-untied"]
PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [7], [90, 3, 3, 12, 60]]


def save(directory: Path, variant: str, seed: int = 3, eos_boost: float = 1.0) -> Path:
    """The random model of ``variant`` (VARIANTS), saved by transformers into ``directory``."""
    model_type, overrides = VARIANTS[variant]
    config_class, model_class, fields = ARCHITECTURES[model_type]
    config = getattr(transformers, config_class)(**{**TINY, **fields, **overrides})
    model = getattr(transformers, model_class)(config)
    randomize(model, seed=seed, eos_id=EOS, eos_boost=eos_boost).save_pretrained(directory)
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def hf_generate(directory: Path, prompts: list[list[int]], kwargs: dict) -> list[list[int]]:
    """generate() on a left-padded batch of ``prompts``: each row's new tokens up to EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_model(directory).generate(input_ids=ids, attention_mask=mask, pad_token_id=EOS, **kwargs)
    return [strip(seq, width, EOS) for seq in out.tolist()]


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_equals_transformers(tmp_path, variant):
    directory = save(tmp_path / variant, variant)
    ids = torch.tensor([PROMPTS[1] * 6])  # 42 positions, ten windows
    # transformers computes RMSNorm and the rotary angles in float32 even in a float64 model, which bounds float64
    # (Gemma's seven norms a layer, q/k norms included, cast to float32 and back: ~1e-5 off)
    float64 = 5e-5 if VARIANTS[variant][0] == "gemma3_text" else 1e-5
    for dtype, tolerance in ((torch.float32, ATOL), (torch.float64, float64)):
        ours, config = load_hf_model(directory, dtype)
        with torch.no_grad():
            diff = (ours(ids) - hf_model(directory, dtype)(input_ids=ids).logits).abs().max()
        assert diff < tolerance, (dtype, float(diff))
    assert config.extended and config.eos_id == EOS
    ours, _ = load_hf_model(directory)
    ours_config, hf_kwargs = decoding("greedy")
    mine = best_tokens(generate_causal(ours, PROMPTS, ours_config))
    assert mine == hf_generate(directory, PROMPTS, hf_kwargs)
    assert mine == best_tokens(generate_causal(ours, PROMPTS, ours_config, use_cache=False))
    assert max(len(p) + len(m) for p, m in zip(PROMPTS, mine, strict=True)) > 3 * WINDOW


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_the_uncached_forward(tmp_path, variant):
    """Prefill of a right-padded batch then one token per step: each step's logits equal the full forward's."""
    ours, _ = load_hf_model(save(tmp_path / variant, variant))
    rows = [list(PROMPTS[1]), list(PROMPTS[0])]
    width = max(map(len, rows))
    cache = ours.new_cache(len(rows), 32)
    with torch.no_grad():
        ids = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])
        logits = ours.prefill(ids, torch.tensor([len(r) for r in rows]), cache)
        for _ in range(3 * WINDOW):
            for row, got in zip(rows, logits, strict=True):
                assert (got - ours(torch.tensor([row]))[0, -1]).abs().max() < ATOL
            nxt = logits.argmax(-1)
            rows = [r + [int(t)] for r, t in zip(rows, nxt, strict=True)]
            logits = ours.decode_step(nxt, cache)


@pytest.mark.parametrize("variant", VARIANTS)
def test_speculative_decoding_equals_greedy(tmp_path, variant):
    """n-gram drafts verified several tokens a step (masks of t queries over the window) change nothing."""
    ours, _ = load_hf_model(save(tmp_path / variant, variant))
    prompt = [PROMPTS[1] * 2]  # repeats: the drafter finds n-grams to propose
    config, _ = decoding("greedy")
    assert best_tokens(generate_causal(ours, prompt, config, speculative=SpeculativeConfig())) == best_tokens(
        generate_causal(ours, prompt, config))


@pytest.mark.parametrize("variant", BEAM_VARIANTS)
def test_beam_search_equals_transformers(tmp_path, variant):
    directory = save(tmp_path / variant, variant, seed=5, eos_boost=2.5)
    ours, _ = load_hf_model(directory)
    ours_config, hf_kwargs = decoding("beam")
    prompts = PROMPTS[:2]
    assert best_tokens(generate_causal(ours, prompts, ours_config)) == hf_generate(directory, prompts, hf_kwargs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_imported_configs_round_trip_through_json(tmp_path, variant):
    """What an imported checkpoint's config.json keeps builds the same model."""
    ours, config = load_hf_model(save(tmp_path / variant, variant))
    again = CausalLMConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    rebuilt = build_model(again).eval()
    rebuilt.load_state_dict(ours.state_dict())
    ids = torch.tensor([PROMPTS[1] * 3])
    with torch.no_grad():
        assert torch.equal(rebuilt(ids), ours(ids))


REFUSALS = [  # (variant, config.json fields, what the error says)
    ("mistral-window", {"pretraining_tp": 2}, "pretraining_tp=2 is not supported for Mistral"),
    ("mistral-window", {"sliding_window": 0}, "sliding_window=0 must be a positive integer"),
    ("qwen2-window-tied", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types must list one of"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported for Gemma 3"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"rope_parameters\['sliding_attention'\] with scaling"),
    ("gemma3", {"sliding_window": None}, "sliding_attention layers need a sliding_window"),
    ("phi3", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported for Phi-3"),
]


@pytest.mark.parametrize(("variant", "fields", "says"), REFUSALS)
def test_config_fields_we_cannot_express_are_refused_by_name(tmp_path, variant, fields, says):
    directory = save(tmp_path / variant, variant)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(HFImportError, match=says):
        load_hf_model(directory)


def test_gemma3_configs_written_before_rope_parameters_per_layer_type_load_alike(tmp_path):
    """Older Gemma 3 files: rope_theta / rope_scaling for the global layers, rope_local_base_freq for the local ones,
    sliding_window_pattern instead of layer_types."""
    directory = save(tmp_path / "gemma3", "gemma3")
    config = json.loads((directory / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    config |= {"rope_theta": 5000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
               "rope_local_base_freq": 100.0, "sliding_window_pattern": 2}
    (directory / "config.json").write_text(json.dumps(config))
    ours, ours_config = load_hf_model(directory)
    assert (ours_config.rope_theta, ours_config.rope_local_theta, ours_config.window_layers) == (
        5000.0, 100.0, [True, False, True])
    ids = torch.tensor([PROMPTS[1] * 6])
    with torch.no_grad():
        assert (ours(ids) - hf_model(directory)(input_ids=ids).logits).abs().max() < ATOL
