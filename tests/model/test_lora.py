"""LoRA equivalence tests on a tiny float64 model named like the real ones (layers.N.self_attn.q_proj, ...)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from model.lora import (
    AdapterError,
    LoRAConfig,
    adapter_names,
    add_adapter,
    clear_adapters,
    delete_adapter,
    mark_only_lora_trainable,
    merge_adapter,
    set_adapters,
    unmerge_adapter,
    use_adapters,
)
from model.lora_io import lora_state_dict
from model.lora_layers import LoRALinear
from tests.model.lora_toy import (
    ATTN,
    ROWS,
    D,
    assert_unchanged,
    inputs,
    randomize,
    run,
    snapshot,
    toy,
    with_adapters,
)

# ---- forward -------------------------------------------------------------------------------------


def test_zero_b_equals_base_exactly_and_keeps_base_parameters() -> None:
    model, base = toy(), toy()
    q_proj = model.layers[0].self_attn.q_proj
    add_adapter(model, "a", ATTN, seed=0)
    wrapped = model.layers[0].self_attn.q_proj
    assert isinstance(wrapped, LoRALinear) and wrapped.base is q_proj
    assert isinstance(model.head, nn.Linear) and not isinstance(model.head, LoRALinear)
    assert isinstance(model.layers[0].ffn.fc1, nn.Linear)  # not in ATTN's targets
    assert wrapped.lora_A["a"].weight.dtype == torch.float64 and not wrapped.lora_B["a"].weight.any()
    for dim in (2, 3):
        x = inputs(dim)
        assert torch.equal(run(model, x, "a"), base(x))
        assert torch.equal(run(model, x, None), base(x))


def test_forward_matches_naive_reference() -> None:
    model, base = with_adapters("a"), toy()
    layer = model.layers[0].self_attn.q_proj
    x = inputs(3)
    W, b = layer.base.weight, layer.base.bias
    A, B = layer.lora_A["a"].weight, layer.lora_B["a"].weight
    with torch.no_grad(), use_adapters(model, "a"):
        naive = x @ W.T + b + 3.0 * (x @ A.T) @ B.T
        torch.testing.assert_close(layer(x), naive, rtol=0, atol=1e-12)
    # Whole model: the same weights folded into a plain copy by hand.
    with torch.no_grad():
        for path, m in model.named_modules():
            if isinstance(m, LoRALinear):
                dense = base.get_submodule(path)
                dense.weight += m.scaling["a"] * m.lora_B["a"].weight @ m.lora_A["a"].weight
    for dim in (2, 3):
        torch.testing.assert_close(run(model, inputs(dim), "a"), base(inputs(dim)), rtol=0, atol=1e-10)
    assert not torch.allclose(run(model, x, "a"), run(model, x, None))


def test_seed_makes_init_reproducible() -> None:
    one, two, three = toy(), toy(), toy()
    for model, seed in ((one, 1), (two, 1), (three, 2)):
        add_adapter(model, "a", ATTN, seed=seed)
    sd1, sd2, sd3 = (lora_state_dict(m, "a") for m in (one, two, three))
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert not all(torch.equal(sd1[k], sd3[k]) for k in sd1)


@pytest.mark.parametrize("dim", [2, 3])
def test_mixed_batch_equals_each_row_alone(dim: int) -> None:
    model = with_adapters("a", "b")  # "b" targets v_proj/fc1/fc2, so modules mix adapters and gaps
    x = inputs(dim)
    mixed = run(model, x, ROWS)
    alone = torch.cat([run(model, x[i : i + 1], name) for i, name in enumerate(ROWS)])
    torch.testing.assert_close(mixed, alone, rtol=0, atol=1e-12)
    assert not torch.allclose(mixed[0], run(model, x, None)[0])
    set_adapters(model, ROWS)  # the non-context form the engine uses per decode step
    with torch.no_grad():
        torch.testing.assert_close(model(x), alone, rtol=0, atol=1e-12)
        with pytest.raises(AdapterError, match="4 rows but the input has 3"):
            model(x[:3])
    clear_adapters(model)
    assert torch.equal(run(model, x, None), model(x).detach())


def test_stacked_mixed_path_handles_ranks_scalings_and_in_place_changes() -> None:
    """Inference mixes adapters in two GEMMs over the concatenated A/B (model.lora._stacked_delta); it
    equals the per-group loop for adapters of different rank and alpha, and follows in-place edits,
    additions and removals of adapters."""
    model = with_adapters("a")
    add_adapter(model, "c", LoRAConfig(r=3, lora_alpha=7.0, target_modules=("q_proj", "fc2")), seed=5)
    randomize(model, "c", seed=9)
    rows = ["c", None, "a", "c", "a"]
    x = inputs(3, rows=5)
    alone = lambda: torch.cat([run(model, x[i : i + 1], n) for i, n in enumerate(rows)])  # noqa: E731
    torch.testing.assert_close(run(model, x, rows), alone(), rtol=0, atol=1e-12)
    with torch.enable_grad(), use_adapters(model, rows):  # autograd: the per-group loop
        torch.testing.assert_close(model(x).detach(), alone(), rtol=0, atol=1e-12)
    randomize(model, "c", seed=10)  # in place: the stacked copy must notice
    torch.testing.assert_close(run(model, x, rows), alone(), rtol=0, atol=1e-12)
    add_adapter(model, "d", LoRAConfig(r=2, lora_alpha=1.0, target_modules=("v_proj",)), seed=6)
    randomize(model, "d", seed=11)
    rows = ["d", "c", None, "a", "d"]
    torch.testing.assert_close(run(model, x, rows), alone(), rtol=0, atol=1e-12)
    delete_adapter(model, "c")
    rows = ["d", None, "a", "a", "d"]
    torch.testing.assert_close(run(model, x, rows), alone(), rtol=0, atol=1e-12)
    with torch.no_grad():  # a poisoned adapter still fails only its own rows
        next(m for m in model.modules() if isinstance(m, LoRALinear) and "d" in m.lora_B).lora_B["d"].weight.fill_(
            float("nan")
        )
    out = run(model, x, rows)
    assert torch.isnan(out[[0, 4]]).all()
    torch.testing.assert_close(out[1:4], alone()[1:4], rtol=0, atol=1e-12)


def test_uniform_sequence_takes_the_single_adapter_path() -> None:
    model = with_adapters("a")
    x = inputs(3)
    assert torch.equal(run(model, x, ["a"] * 4), run(model, x, "a"))
    assert torch.equal(run(model, x, [None] * 4), run(model, x, None))


def test_use_adapters_validates_nests_and_restores() -> None:
    model = with_adapters("a", "b")
    x = inputs(2)
    expected = {sel: run(model, x, sel) for sel in ("a", "b", None)}
    for bad, match in (
        (["a", "zzz"], "unknown adapter"),
        ("zzz", "unknown adapter"),
        ([], "non-empty"),
        (["a", 3], "non-empty"),
    ):
        with pytest.raises(AdapterError, match=match), use_adapters(model, bad):
            pytest.fail("body must not run")
    with torch.no_grad(), use_adapters(model, "a"):
        assert torch.equal(model(x), expected["a"])
        with use_adapters(model, "b"):
            assert torch.equal(model(x), expected["b"])
        with pytest.raises(RuntimeError), use_adapters(model, None):
            raise RuntimeError
        assert torch.equal(model(x), expected["a"])
    assert torch.equal(run(model, x, None), expected[None])
    with torch.no_grad():
        assert torch.equal(model(x), expected[None])


def test_dropout_applies_only_in_training() -> None:
    model = toy()
    add_adapter(model, "d", LoRAConfig(r=4, lora_dropout=0.5))
    randomize(model, "d", 0)
    x = inputs(3)
    reference = run(model, x, "d")
    model.train()
    assert not torch.allclose(run(model, x, "d"), reference)
    model.eval()
    assert torch.equal(run(model, x, "d"), reference)


# ---- adapter management ----------------------------------------------------------------------------


def test_several_adapters_delete_one_others_unaffected() -> None:
    model = with_adapters("a", "b", "c")
    x = inputs(3)
    before = {n: run(model, x, n) for n in ("a", "c", None)}
    assert adapter_names(model) == ["a", "b", "c"]
    with use_adapters(model, ["a", "b", None, None]), pytest.raises(AdapterError, match="selected"):
        delete_adapter(model, "b")
    delete_adapter(model, "b")
    assert adapter_names(model) == ["a", "c"]
    assert all(torch.equal(run(model, x, n), before[n]) for n in before)
    with pytest.raises(AdapterError, match="unknown adapter 'b'"):
        delete_adapter(model, "b")
    delete_adapter(model, "a")
    delete_adapter(model, "c")  # last adapter gone: plain Linears and the original state_dict keys again
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert model.state_dict().keys() == toy().state_dict().keys()
    assert torch.equal(model(x), before[None])


def test_add_adapter_rejects_bad_names_duplicates_and_no_match() -> None:
    model = with_adapters("a")
    snap = snapshot(model)
    for name in ("../x", ".", "..", "", "a/b", "x" * 65, "sp ace", 3):
        with pytest.raises(AdapterError, match="invalid adapter name"):
            add_adapter(model, name, ATTN)
    with pytest.raises(AdapterError, match="already exists"):
        add_adapter(model, "a", ATTN)
    with pytest.raises(AdapterError, match="no nn.Linear named"):
        add_adapter(model, "z", LoRAConfig(target_modules=("nope",)))
    assert_unchanged(model, snap)


def test_names_with_dots_and_module_dict_attributes_work() -> None:
    model = with_adapters("a")
    for name in ("v1.2", "train"):
        add_adapter(model, name, ATTN)
        randomize(model, name, 5)
    assert adapter_names(model) == ["a", "train", "v1.2"]
    lora_a = model.layers[0].self_attn.q_proj.lora_A
    assert list(lora_a.keys()) == list(lora_a) == [k for k, _ in lora_a.items()] == ["a", "v1.2", "train"]
    x = inputs(2, rows=3)
    mixed = run(model, x, ["v1.2", "train", "a"])
    alone = torch.cat([run(model, x[i : i + 1], n) for i, n in enumerate(["v1.2", "train", "a"])])
    torch.testing.assert_close(mixed, alone, rtol=0, atol=1e-12)
    assert "base_model.model.layers.0.self_attn.q_proj.lora_A.weight" in lora_state_dict(model, "v1.2")


def test_multihead_attention_out_proj_is_not_wrapped() -> None:
    model = nn.Sequential(nn.MultiheadAttention(D, 2))
    with pytest.raises(AdapterError, match="no nn.Linear named"):
        add_adapter(model, "a", LoRAConfig(target_modules=("out_proj",)))


# ---- merge -----------------------------------------------------------------------------------------


def test_merge_equals_unmerged_for_every_selection_and_unmerge_restores() -> None:
    model = with_adapters("a", "b")
    x = inputs(3)
    selections = ["a", "b", None, ROWS]
    before = [run(model, x, s) for s in selections]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    merge_adapter(model, "a")
    q_proj = model.layers[0].self_attn.q_proj
    assert q_proj.merged == "a"
    assert not torch.equal(q_proj.base.weight, weights["layers.0.self_attn.q_proj.base.weight"])
    assert model.layers[0].ffn.fc1.merged is None  # "a" does not target fc1
    for s, expected in zip(selections, before, strict=True):
        torch.testing.assert_close(run(model, x, s), expected, rtol=0, atol=1e-10)
    unmerge_adapter(model)
    unmerge_adapter(model)  # nothing merged: no-op
    assert dict(model.named_parameters()) == params  # same Parameter objects
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, weights[n], rtol=0, atol=1e-12)
    for s, expected in zip(selections, before, strict=True):
        torch.testing.assert_close(run(model, x, s), expected, rtol=0, atol=1e-12)


def test_merge_guards() -> None:
    model = with_adapters("a", "b")
    with torch.no_grad():
        model.layers[1].self_attn.v_proj.lora_B["b"].weight[0, 0] = float("inf")
    snap = snapshot(model)
    with pytest.raises(AdapterError, match="layers.1.self_attn.v_proj gives non-finite"):
        merge_adapter(model, "b")
    assert_unchanged(model, snap)
    assert all(m.merged is None for m in model.modules() if isinstance(m, LoRALinear))
    merge_adapter(model, "a")
    with pytest.raises(AdapterError, match="'a' is merged"):
        merge_adapter(model, "b", safe=False)
    with pytest.raises(AdapterError, match="merged"):
        delete_adapter(model, "a")
    with pytest.raises(AdapterError, match="merged"):
        mark_only_lora_trainable(model, "a")
    with pytest.raises(AdapterError, match="unknown adapter"):
        merge_adapter(model, "zzz")


# ---- training --------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapters", ["a", ["a", None, "b", "a"]])
def test_mark_only_lora_trainable_gives_grads_only_to_that_adapter(adapters) -> None:
    model = with_adapters("a", "b")
    trainable = mark_only_lora_trainable(model, "a")
    assert len(trainable) == 2 * 4 * 2  # A and B on 4 projections in 2 layers
    with use_adapters(model, adapters):
        model(inputs(3)).pow(2).sum().backward()
    ids = {id(p) for p in trainable}
    for name, p in model.named_parameters():
        if id(p) in ids:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name


# ---- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"r": 0},
        {"r": 2.0},
        {"r": True},
        {"lora_alpha": 0},
        {"lora_alpha": float("nan")},
        {"lora_dropout": 1.0},
        {"target_modules": ()},
        {"target_modules": "q_proj"},
        {"target_modules": ("q_proj", "")},
        {"bias": "all"},
        {"task_type": 3},
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(AdapterError, match=next(iter(kwargs))):
        LoRAConfig(**kwargs)


def test_peft_dict_round_trip() -> None:
    cfg = LoRAConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    assert cfg.target_modules == ("q_proj", "v_proj") and cfg.scaling == 2.0
    d = cfg.to_peft_dict()
    assert d["peft_type"] == "LORA" and d["target_modules"] == ["q_proj", "v_proj"] and not d["fan_in_fan_out"]
    assert LoRAConfig.from_peft_dict({**d, "some_future_key": 1}) == cfg
    assert json.loads(json.dumps(d)) == d
    for bad, match in (
        ({"r": "8"}, "r="),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"use_dora": True}, "unsupported"),
        ({"target_modules": "all-linear"}, "list of module names"),
        ({"lora_alpha": None}, "alpha"),
    ):
        with pytest.raises(AdapterError, match=match):
            LoRAConfig.from_peft_dict({**d, **bad})
    with pytest.raises(AdapterError, match="JSON object"):
        LoRAConfig.from_peft_dict([1])
