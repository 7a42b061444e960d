"""CUDA graphs of the static decode step (model.static_step) against eager decoding on the GPU: identical tokens in
float32, in bfloat16 identical up to a tie (tests/cuda/conftest.py). Greedy, seeded sampling and beam search, GPT-2
and Llama-style causal LMs (rotary, grouped-query attention), the encoder-decoder, rows with mixed LoRA adapters
and an adapter loaded between two runs (the graph is re-captured). GPU only: the same logic without capture runs
on the CPU in tests/model/test_static_step.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model.decoding import GenerationConfig
from model.lora import LoRAConfig, add_adapter
from model.static_generation import generate_causal_static, generate_seq2seq_static
from model.static_step import StaticDecoder
from tests.cuda.conftest import FAMILIES, Target, assert_same_tokens
from tests.helpers import gather_queued
from tests.model.conftest import tiny_causal_lm
from tests.model.helpers import PROMPTS, eos_friendly
from tests.service.conftest import LM, MT, ask, assert_same, running_engine
from tests.service.test_speculative import NGRAM, REPEATING
from tests.service.test_static_batching import CASES, fields_for, static_steps

CONFIGS = {"greedy": GenerationConfig(max_new_tokens=12),
           "sample": GenerationConfig(strategy="sample", seed=7, top_k=10, max_new_tokens=12),
           "beam": GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=10)}
LLAMA = dict(positions="rope", norm_type="rms", ffn="gated", activation="silu", bias=False, n_kv_heads=2)
GRAPH_TARGETS = [pytest.param(Target("cuda", dtype), id=f"cuda-{name}", marks=pytest.mark.cuda)
                 for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))]


def _model(family: str, target: Target) -> torch.nn.Module:
    make = tiny_causal_lm if family == "llama" else FAMILIES[family][0]
    return target.place(eos_friendly(make(tie_embeddings=False, **(LLAMA if family == "llama" else {}))))


def _generate(model, decoder, config, adapters=None):
    if decoder.cache.cross is not None:
        return generate_seq2seq_static(model, decoder, PROMPTS, config, adapters)
    return generate_causal_static(model, decoder, PROMPTS, config, adapters)


def _assert_same(target: Target, model, family: str, got: list, want: list) -> None:
    family = "causal_lm" if family == "llama" else family
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        logits_at = FAMILIES[family][2](model, prompt)
        for a, b in zip(g, w, strict=True):
            assert_same_tokens(target, a.tokens, b.tokens, model.config.eos_id, logits_at)


@pytest.mark.parametrize("strategy", list(CONFIGS))
@pytest.mark.parametrize("family", ["causal_lm", "llama", "seq2seq"])
@pytest.mark.parametrize("target", GRAPH_TARGETS)
def test_graphs_give_the_eager_tokens(target, family, strategy):
    model, config = _model(family, target), CONFIGS[strategy]
    rows = len(PROMPTS) * config.rows_per_input
    graphed = StaticDecoder(model, rows=rows, capacity=32, graphs=True, source_capacity=16)
    eager = StaticDecoder(model, rows=rows, capacity=32, graphs=False, source_capacity=16)
    got, want = _generate(model, graphed, config), _generate(model, eager, config)
    assert graphed.builds > 0 and graphed.captured == len(graphed.built)
    _assert_same(target, model, family, got, want)
    again = _generate(model, graphed, config)  # replays only: nothing captured again
    assert graphed.builds == len(graphed.built)
    _assert_same(target, model, family, again, want)


@pytest.mark.parametrize("target", GRAPH_TARGETS)
def test_graphs_with_mixed_adapters_recapture_after_a_new_adapter(target):
    model = _model("llama", target)
    lora = LoRAConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "fc1"))

    def add(name: str, seed: int) -> None:
        add_adapter(model, name, lora, seed=seed)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "lora_B") and name in m.lora_B:
                    m.lora_B[name].weight.normal_(std=4.0)

    add("a", 0)
    add("b", 1)
    config = CONFIGS["greedy"]
    graphed = StaticDecoder(model, rows=4, capacity=32, graphs=True, sizes=(4,))
    eager = StaticDecoder(model, rows=4, capacity=32, graphs=False, sizes=(4,))
    rows = ["a", None, "b", "a"]
    _assert_same(target, model, "llama", _generate(model, graphed, config, rows), _generate(model, eager, config, rows))
    add("c", 2)
    rows = ["c", "b", None, "a"]
    _assert_same(target, model, "llama", _generate(model, graphed, config, rows), _generate(model, eager, config, rows))
    assert graphed.builds == 2


@pytest.mark.cuda
@pytest.mark.parametrize("model", [LM, MT])
def test_the_served_running_batch_on_graphs_gives_the_eager_tokens(models_dir, adapters_dir, model):
    """The engine's continuous batching with TSERVE_CUDA_GRAPHS=lazy on the GPU (float32): mixed strategies and
    adapters, n-gram drafts verified at padded widths, more rows than the largest size at first (eager steps), then
    graph replays: the tokens of the same engine without graphs."""
    cases = [*CASES, (REPEATING, dict(max_new_tokens=16, speculative=NGRAM))]

    async def serve(graphs: str):
        async with running_engine(models_dir, adapters_dir, device="cuda", cuda_graphs=graphs, cuda_graph_sizes="1,2,4",
                                  prefix_cache_mb=0) as engine:
            worker = engine.get(model)
            results = await gather_queued(worker, [worker.generate(ask(text, **fields_for(params, model)), f"r{i}")
                                                   for i, (text, params) in enumerate(cases)])
            return results, static_steps(engine, model, "static"), worker.info.static_step

    graphed, steps, info = asyncio.run(serve("lazy"))
    eager, _, _ = asyncio.run(serve("off"))
    for got, want in zip(graphed, eager, strict=True):
        assert_same(got, want)
    assert steps > 0 and info["graphs"] is True and info["built"]
