"""The decode plan (model.fast_step) computes what LayerStack.forward computes, and follows module swaps."""

import copy

import pytest
import torch

from model.fast_step import _PLANS, plan_for, run_decoder
from model.kv_cache import CrossAttentionMemory, KVCache
from model.lora import LoRAConfig, add_adapter, set_adapters
from model.quantize import quantize_int8
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_seq2seq
from tests.model.helpers import causal_cache, decode, seq2seq_cache


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # caches filled under autograd cannot be deep-copied
        yield


def general(stack, x, mask, cache, memory_mask):
    return stack(x, mask, memory_mask=memory_mask, cache=cache)[0]


def assert_same(model, cache: KVCache, steps: int = 4, atol: float = 1e-12) -> None:
    tokens = [random_ids(cache.batch_size, 1, seed=s)[:, 0] for s in range(steps)]
    fast = decode(model, run_decoder, tokens, copy.deepcopy(cache))
    slow = decode(model, general, tokens, copy.deepcopy(cache))
    for f, s in zip(fast, slow, strict=True):
        torch.testing.assert_close(f, s, atol=atol, rtol=0)


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_plan_equals_the_layer_stack(norm, ragged):
    lm = tiny_causal_lm(norm=norm).double()
    assert_same(lm, causal_cache(lm, ragged))
    mt = tiny_seq2seq(norm=norm, activation="gelu").double()
    assert_same(mt, seq2seq_cache(mt, ragged))


def test_plan_is_reused_then_rebuilt_when_adapters_wrap_the_projections():
    lm = tiny_causal_lm().double()
    assert_same(lm, causal_cache(lm, False))
    plan = plan_for(lm.decoder)
    assert_same(lm, causal_cache(lm, False))
    assert plan_for(lm.decoder) is plan
    add_adapter(lm, "x", LoRAConfig(r=2, target_modules=("q_proj", "v_proj", "fc2")), seed=0)
    for name, p in lm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    set_adapters(lm, ["x", None, "x"])  # per-row: rows 0 and 2 use the adapter
    cache = causal_cache(lm, True)
    assert_same(lm, cache)
    assert plan_for(lm.decoder) is not plan
    tokens = [torch.tensor([20, 21, 22])]
    with_adapter = decode(lm, run_decoder, tokens, copy.deepcopy(cache))[0]
    set_adapters(lm, None)
    without = decode(lm, run_decoder, tokens, copy.deepcopy(cache))[0]
    assert not torch.allclose(with_adapter[0], without[0]) and torch.allclose(with_adapter[1], without[1])


def test_plan_follows_int8_quantisation_and_its_fused_projection():
    mt = tiny_seq2seq()
    assert_same(mt, seq2seq_cache(mt, True), atol=1e-5)  # float32: the plan's decode attention kernel vs SDPA
    before = plan_for(mt.decoder)
    quantize_int8(mt)
    assert all(layer.self_attn.fused for layer in mt.decoder.layers)
    cache = seq2seq_cache(mt, True)
    tokens = [random_ids(3, 1, seed=s)[:, 0] for s in range(3)]
    fast = decode(mt, run_decoder, tokens, copy.deepcopy(cache))
    assert _PLANS[mt.decoder] is not before and _PLANS[mt.decoder].layers[0].self_attn.qkv is not None
    slow = decode(mt, general, tokens, copy.deepcopy(cache))
    for f, s in zip(fast, slow, strict=True):
        torch.testing.assert_close(f, s, atol=1e-5, rtol=0)  # same int8 kernels; float32 sums


def test_training_mode_takes_the_general_path():
    lm = tiny_causal_lm(dropout=0.5).double().train()
    cache = causal_cache(lm, False)
    torch.manual_seed(0)
    x = decode(lm, run_decoder, [torch.tensor([9, 9, 9])], copy.deepcopy(cache))[0]
    torch.manual_seed(0)
    y = decode(lm, general, [torch.tensor([9, 9, 9])], copy.deepcopy(cache))[0]
    assert lm.decoder not in _PLANS
    torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_a_deep_copy_decodes_with_its_own_weights():
    """A plan is never copied with the model: the copy's in-place weight changes reach its decoding."""
    lm = tiny_causal_lm().double()
    cache = causal_cache(lm, False)
    tokens = [torch.tensor([20, 21, 22])]
    original = decode(lm, run_decoder, tokens, copy.deepcopy(cache))[0]
    twin = copy.deepcopy(lm)
    twin.decoder.layers[0].ffn.fc2.weight.mul_(3.0)
    fast = decode(twin, run_decoder, tokens, copy.deepcopy(cache))[0]
    slow = decode(twin, general, tokens, copy.deepcopy(cache))[0]
    torch.testing.assert_close(fast, slow, atol=1e-12, rtol=0)
    assert not torch.allclose(fast, original)
    torch.testing.assert_close(decode(lm, run_decoder, tokens, copy.deepcopy(cache))[0], original, atol=0, rtol=0)


def test_a_new_parameter_object_rebuilds_the_plan():
    lm = tiny_causal_lm().double()
    cache = causal_cache(lm, False)
    before = plan_for(lm.decoder)
    fc1 = lm.decoder.layers[1].ffn.fc1
    fc1.weight = torch.nn.Parameter(fc1.weight.detach() * -1.0)
    assert plan_for(lm.decoder) is not before
    assert_same(lm, cache)


@pytest.mark.parametrize(
    ("sources", "group"),
    [([0, 0, 0, 1, 1, 1], 3), ([5, 5, 2, 2], 2), ([0, 1, 2], 1), ([0, 0, 1], 1), ([0, 0, 1, 1, 1, 1], 2), ([4, 4], 2)],
)
def test_group_size_finds_equal_runs_of_one_source(sources, group):
    """Runs of g rows, each of one source (two runs may share a source: their rows are copies too)."""
    memory = CrossAttentionMemory([], [], torch.ones(len(sources), 1, 1, 3, dtype=torch.bool), torch.tensor(sources))
    assert memory.group_size == group


@pytest.mark.parametrize(
    ("sources", "leads"),
    [([0, 0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 4, 4, 6]), ([3, 1, 1], [0, 1, 1]), ([0, 0, 1, 1], None), ([0, 1, 2], None),
     ([7], None)],
)
def test_leads_name_each_runs_first_row_where_runs_differ_in_length(sources, leads):
    """Runs of one source of different lengths (requests of different beam widths): each row's run's first row; None
    where group_size's equal runs serve or every row is its own."""
    memory = CrossAttentionMemory([], [], torch.ones(len(sources), 1, 1, 3, dtype=torch.bool), torch.tensor(sources))
    got = memory.leads
    assert got.tolist() == leads if leads is not None else got is None


def test_beams_of_one_source_attend_to_one_copy_of_its_memory():
    """After beams expand each source to 3 rows, cross-attention reads one K/V row per source: same result."""
    mt = tiny_seq2seq().double()
    cache = seq2seq_cache(mt, True)
    cache.select(torch.arange(3).repeat_interleave(3))
    assert cache.cross.group_size == 3 and cache.batch_size == 9
    assert_same(mt, cache)
