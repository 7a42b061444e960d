"""Batched generation equals one-at-a-time, with and without the cache, with mixed LoRA adapters."""

import pytest
import torch

from model.decoding import GenerationConfig
from model.generation import InputTooLongError, generate_causal, generate_seq2seq, stop_strings, trim_stop
from model.lora import LoRAConfig, add_adapter
from tests.model.conftest import tiny_causal_lm, tiny_seq2seq
from tests.model.helpers import PROMPTS, eos_friendly

CONFIGS = [
    GenerationConfig(strategy="greedy", max_new_tokens=12),
    GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=10),
    GenerationConfig(strategy="sample", seed=7, top_k=10, temperature=0.9, max_new_tokens=12),
]


def _same(batched, alone):
    assert batched and len(batched) == len(alone)
    assert [h.tokens for h in batched] == [h.tokens for h in alone]
    for a, b in zip(batched, alone, strict=True):
        assert abs(a.score - b.score) < 1e-4 and a.finish_reason == b.finish_reason


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.strategy)
def test_causal_batched_equals_alone(config):
    model = eos_friendly(tiny_causal_lm(tie_embeddings=False))
    batched = generate_causal(model, PROMPTS, config)
    for i, prompt in enumerate(PROMPTS):
        alone_config = (
            config if config.seed is None else GenerationConfig(**{**config.__dict__, "seed": config.seed + i})
        )
        _same(batched[i], generate_causal(model, [prompt], alone_config)[0])


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: c.strategy)
def test_seq2seq_batched_equals_alone(config):
    model = eos_friendly(tiny_seq2seq(tie_embeddings=False))
    batched = generate_seq2seq(model, PROMPTS, config)
    for i, source in enumerate(PROMPTS):
        _same(batched[i], generate_seq2seq(model, [source], config)[0])


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: c.strategy)
def test_cached_generation_equals_recomputation(config):
    model = tiny_causal_lm().double()
    cached = generate_causal(model, PROMPTS, config)
    uncached = generate_causal(model, PROMPTS, config, use_cache=False)
    for a, b in zip(cached, uncached, strict=True):
        _same(a, b)


def test_beam_with_one_beam_equals_greedy():
    model = tiny_seq2seq()
    greedy = generate_seq2seq(model, PROMPTS, GenerationConfig(max_new_tokens=10))
    beam = generate_seq2seq(
        model, PROMPTS, GenerationConfig(strategy="beam", num_beams=1, length_penalty=0.0, max_new_tokens=10)
    )
    for g, b in zip(greedy, beam, strict=True):
        assert g[0].tokens == b[0].tokens and abs(g[0].logprob - b[0].logprob) < 1e-5


@pytest.mark.parametrize("generate,make", [(generate_causal, tiny_causal_lm), (generate_seq2seq, tiny_seq2seq)])
def test_mixed_adapter_batch_equals_each_row_alone(generate, make):
    model = make()
    for i, name in enumerate(("a", "b")):
        add_adapter(model, name, LoRAConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "fc1")), seed=i)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "lora_B") and name in m.lora_B:
                    m.lora_B[name].weight.normal_(std=0.5)
    rows = ["a", None, "b", "a"]
    config = GenerationConfig(strategy="beam", num_beams=2, max_new_tokens=8)
    batched = generate(model, PROMPTS, config, adapters=rows)
    changed = 0
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], config, adapters=rows[i])[0]
        _same(batched[i], alone)
        changed += generate(model, [prompt], config)[0][0].tokens != alone[0].tokens
    assert changed > 0  # the adapters really change some outputs


def test_input_limits_are_enforced():
    model = tiny_causal_lm()  # max_len 64
    with pytest.raises(InputTooLongError, match="maximum length 64"):
        generate_causal(model, [[9] * 60], GenerationConfig(max_new_tokens=10))
    with pytest.raises(ValueError, match="empty prompt"):
        generate_causal(model, [[]], GenerationConfig())


def test_trim_stop_cuts_at_first_stop_string():
    assert trim_stop("hello\n\nworld END x", ["END", "\n\n"]) == "hello"
    assert trim_stop("no stops here", ["END"]) == "no stops here"


def test_a_long_non_ascii_stop_string_is_found_when_each_byte_is_a_token():
    """stop_strings decodes enough tokens: a stop string of 12 characters spans 36 byte tokens here (the window
    once counted characters as tokens and missed it)."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    backend = BackendTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())},
                                          merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    stop = "日本語のテキストの終わり"  # 12 characters, 36 UTF-8 bytes
    tokens = backend.encode("prefix " + stop).ids
    assert len(tokens) == len(("prefix " + stop).encode())  # one token per byte
    stop_fn = stop_strings(backend, [stop])
    assert stop_fn(0, tokens) and not stop_fn(0, tokens[:-1])
