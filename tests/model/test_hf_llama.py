"""LlamaForCausalLM directories (model/hf/llama.py) as our causal LM: what is Llama's own beyond the family's shared
checks (tests/model/test_hf_decoders.py: logits, greedy, beam, cached, speculative, per config variant).

Greedy decoding of a left-padded batch equal to transformers' on the C++ step (tests/model/test_llama_native.py
compares it with the PyTorch path), what we cannot express refused by name, configs that round-trip and old ones
that keep the original blocks, the exporters' refusal, and an imported checkpoint that reloads alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.config import CausalLMConfig
from model.generation import generate_causal
from model.hf import HFImportError, load_hf_model
from tests.hf_compare import assert_varied, best_tokens, decoding, randomize, strip
from tests.hf_directories import with_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB, EOS = 96, 2
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [7], [90, 3, 3, 12, 60], [11, 22]]


def save_llama(directory: Path, seed: int = 0, eos_boost: float = 1.0, **overrides) -> Path:
    config = transformers.LlamaConfig(**{**LLAMA, **overrides})
    randomize(transformers.LlamaForCausalLM(config), seed=seed, eos_id=EOS, eos_boost=eos_boost).save_pretrained(
        directory)
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def hf_greedy(directory: Path, prompts: list[list[int]], kwargs: dict) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS] * (width - len(p)) + p for p in prompts])  # left padding, as generate() wants
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_model(directory).generate(input_ids=ids, attention_mask=mask, pad_token_id=EOS, **kwargs)
    return [strip(seq, width, EOS) for seq in out.tolist()]


def test_llama_greedy_on_a_batch_equals_transformers_on_the_fast_path(tmp_path):
    directory = save_llama(tmp_path / "llama", seed=5, eos_boost=2.5, num_key_value_heads=2)
    ours, _ = load_hf_model(directory)
    assert ours.decoder.native  # the decode plan (and the C++ step where the kernels run) takes these blocks
    ours_config, hf_kwargs = decoding("greedy")
    mine = best_tokens(generate_causal(ours, PROMPTS, ours_config))
    assert mine == hf_greedy(directory, PROMPTS, hf_kwargs)
    assert_varied(mine)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"pretraining_tp": 2}, "pretraining_tp=2 is not supported"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope type 'mrope' is not supported"),
        ({"rope_parameters": {"rope_type": "mrope", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'mrope'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_llama_config_fields_we_cannot_express_are_refused_by_name(tmp_path, overrides, says):
    directory = save_llama(tmp_path / "llama")
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters", None) if "rope_scaling" in overrides else None
    (directory / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(HFImportError, match=says):
        load_hf_model(directory)


def test_llama_configs_round_trip_and_old_configs_keep_the_original_blocks(tmp_path):
    _, config = load_hf_model(save_llama(tmp_path / "llama", num_key_value_heads=2, head_dim=12))
    again = CausalLMConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.extended and again.kv_heads == 2 and again.head_dim == 12
    old = {k: v for k, v in CausalLMConfig().to_dict().items()
           if k not in ("norm_type", "rope_theta", "rope_scale", "n_kv_heads", "head_size", "ffn", "ffn_bias")}
    assert not CausalLMConfig.from_dict(old).extended  # a config.json saved before these fields


def test_exporters_refuse_llama_blocks_by_name():
    from training.export import ExportError, check_exportable

    config = CausalLMConfig(positions="learned", pad_id=0, norm_type="rms")  # GPT-2's fields but RMSNorm
    with pytest.raises(ExportError, match="extended=True"):
        check_exportable(config)


def test_an_imported_llama_checkpoint_reloads_with_the_same_logits(tmp_path):
    """`python -m training import --from hf` writes our checkpoint (the new config fields in its config.json)."""
    from model.checkpoint import load_checkpoint
    from tests.service.fixtures import run_training

    directory = with_tokenizer(save_llama(tmp_path / "llama", num_key_value_heads=2, head_dim=12), VOCAB)
    run_training("import", "--from", "hf", str(directory), "--out", str(tmp_path / "ckpt"))
    checkpoint = load_checkpoint(tmp_path / "ckpt", device="cpu", dtype=torch.float32)
    ours, _ = load_hf_model(directory)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(checkpoint.model(ids), ours(ids)) and checkpoint.config.extended
