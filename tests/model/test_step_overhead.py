"""What a decoding step skips to save time keeps its outputs: the rotary table, the plan's check, host finish codes."""

import pytest
import torch

from model import decoding
from model.decoding import GenerationConfig
from model.fast_step import plan_for
from model.rope import Rotary
from tests.model.conftest import tiny_causal_lm
from tests.model.test_decoding import EOS, ToyLM, generate

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, None), (80, 40), (50, None)])
def test_cos_sin_from_the_table_are_the_bits_cos_sin_computes(scaling, head_dim, rotary_dim):
    rotary = Rotary(head_dim, 10000.0, scaling, rotary_dim)
    cpu = torch.device("cpu")
    for start in [*range(0, 300, 7), 255, 256, 511, 700, 1500]:  # the table grows past 256 and 512
        for tokens in (1, 3):
            table = rotary.cos_sin_from(start, tokens, cpu)
            computed = rotary.cos_sin(torch.arange(start, start + tokens)[None])
            assert all(t.is_contiguous() and torch.equal(t, c) for t, c in zip(table, computed, strict=True)), start


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_positions_dependent_frequencies_keep_no_table(rope_type):
    scaling = {"rope_type": rope_type, "factor": 2.0, "original_max_position_embeddings": 64}
    if rope_type == "longrope":
        scaling |= {"short_factor": [1.0] * 16, "long_factor": [2.0] * 16}
    assert Rotary(32, 10000.0, scaling).cos_sin_from(0, 1, torch.device("cpu")) is None


def test_another_models_assignment_keeps_the_plan_and_a_later_swap_still_rebuilds_it():
    lm, other = tiny_causal_lm(), tiny_causal_lm()
    plan = plan_for(lm.decoder)
    other.decoder.layers[0].ffn.fc1 = torch.nn.Linear(other.decoder.layers[0].ffn.fc1.in_features,
                                                      other.decoder.layers[0].ffn.fc1.out_features)
    assert plan_for(lm.decoder) is plan  # compared again, still current
    assert plan_for(lm.decoder) is plan  # nothing assigned since: not compared
    fc2 = lm.decoder.layers[1].ffn.fc2
    fc2.weight = torch.nn.Parameter(fc2.weight.detach().clone())  # a new Parameter: the parameter hook counts it
    assert plan_for(lm.decoder) is not plan
    spare = torch.nn.Linear(fc2.in_features, fc2.out_features)  # built before the plan compares again
    plan = plan_for(lm.decoder)
    lm.decoder.layers[1].ffn.fc2 = spare  # no Parameter registered now: the module hook alone counts the swap
    assert plan_for(lm.decoder) is not plan


CONFIGS = {
    "eos": GenerationConfig(max_new_tokens=12, eos_token_id=EOS),
    "min_and_stop_tokens": GenerationConfig(max_new_tokens=12, min_new_tokens=3, eos_token_id=EOS,
                                            stop_token_ids=(4,)),
    "logprobs": GenerationConfig(max_new_tokens=9, eos_token_id=EOS, logprobs=2),
    "sampled": GenerationConfig(strategy="sample", max_new_tokens=10, eos_token_id=EOS, num_return_sequences=3,
                                seed=5),
}


@pytest.mark.parametrize("stop", [False, True], ids=["no_stop_fn", "stop_fn"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("prompts", [[1], [0, 3, 5, 1, 2]], ids=["one", "five"])
def test_finish_codes_on_the_host_are_the_tensor_ones(monkeypatch, config, stop, prompts):
    calls: list[list[tuple[int, list[int]]]] = [[], []]

    def results(index: int):
        def stop_fn(row: int, tokens: list[int]) -> bool:
            calls[index].append((row, list(tokens)))
            return len(tokens) >= 2 and tokens[-1] == tokens[-2] + 1

        return generate(ToyLM(vocab=7, seed=3, eos_slope=0.3), prompts, config, stop_fn if stop else None)

    host = results(0)
    monkeypatch.setattr(decoding, "_HOST_ROWS", 0)
    assert results(1) == host
    assert calls[0] == calls[1]
    assert {h.finish_reason for hyps in host for h in hyps} - {"length"}  # some row ends before the limit
