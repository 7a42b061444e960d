"""The static decode step (model.static_step: static buffers, padded batch sizes, the step a CUDA graph captures)
gives today's tokens: generation through it equals model.generation's, on the PyTorch path (decode kernels off)."""

import pytest
import torch

from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.lora import LoRAConfig, add_adapter, wrap_heads
from model.seq2seq import Seq2SeqTransformer
from model.static_generation import generate_causal_static, generate_seq2seq_static
from model.static_step import StaticDecoder, padded_size
from model.tokenizer import pad_batch
from tests.model.conftest import tiny_causal_lm, tiny_seq2seq
from tests.model.helpers import PROMPTS, eos_friendly

CONFIGS = [
    GenerationConfig(strategy="greedy", max_new_tokens=12),
    GenerationConfig(strategy="sample", seed=7, top_k=10, temperature=0.9, max_new_tokens=12),
    GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=10),
]
LLAMA = dict(positions="rope", norm_type="rms", ffn="gated", activation="silu", bias=False, n_kv_heads=2,
             tie_embeddings=False)
CAUSAL = {"gpt2": {}, "llama": LLAMA, "window": {**LLAMA, "sliding_window": 3}}  # window: Mistral's local layers
SEQ2SEQ = {"marian": {}, "t5-bias": {"positions": "relative"}}  # T5's relative position bias over the static cache


@pytest.fixture(autouse=True)
def pytorch_path(kernel_options):
    """TSERVE_DECODE_KERNELS=off: the eager reference and the static step both take PyTorch ops, as on a GPU."""
    kernel_options(decode_kernels=False)


def _same(static, eager):
    assert [[h.tokens for h in hyps] for hyps in static] == [[h.tokens for h in hyps] for hyps in eager]
    for s, e in zip(static, eager, strict=True):
        for a, b in zip(s, e, strict=True):
            assert abs(a.score - b.score) < 1e-4 and a.finish_reason == b.finish_reason


@pytest.mark.parametrize("rows, size", [(1, 1), (2, 2), (3, 4), (5, 8), (33, 64), (64, 64)])
def test_rows_pad_up_to_the_next_captured_size(rows, size):
    assert padded_size(rows) == size
    with pytest.raises(ValueError, match="largest captured batch size 8"):
        padded_size(9, (1, 2, 4, 8))


@pytest.mark.parametrize("family", list(CAUSAL))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.strategy)
def test_causal_static_step_gives_todays_tokens(family, config):
    model = eos_friendly(tiny_causal_lm(**CAUSAL[family]))
    prompts = PROMPTS[:3]  # 3 rows (9 beams) padded to 4 (16); rows leave as they finish: smaller sizes
    decoder = StaticDecoder(model, rows=len(prompts) * config.rows_per_input, capacity=32)
    static = generate_causal_static(model, decoder, prompts, config)
    _same(static, generate_causal(model, prompts, config))
    assert len(decoder.built) > 1 or config.strategy == "beam"  # several padded sizes ran


def _add_adapter(model, name: str, seed: int) -> None:
    """A LoRA adapter on q, v and fc1 with a random B (the tiny Llama's logits are small: B of std 4)."""
    add_adapter(model, name, LoRAConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "fc1")), seed=seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B") and name in m.lora_B:
                m.lora_B[name].weight.normal_(std=4.0)


def test_per_row_adapters_and_a_new_adapter_rebuild_only_what_needs_it():
    model = tiny_causal_lm(**LLAMA)
    _add_adapter(model, "a", 0)
    _add_adapter(model, "b", 1)
    config = GenerationConfig(max_new_tokens=8)
    decoder = StaticDecoder(model, rows=4, capacity=24, sizes=(4,))
    rows = ["a", None, "b", "a"]
    _same(generate_causal_static(model, decoder, PROMPTS, config, rows), generate_causal(model, PROMPTS, config, rows))
    assert decoder.builds == 1
    other = ["b", "a", None, None]  # other rows, same adapters: the built step serves them
    _same(generate_causal_static(model, decoder, PROMPTS, config, other),
          generate_causal(model, PROMPTS, config, other))
    assert decoder.builds == 1
    _add_adapter(model, "c", 2)  # the stacked adapters change: the step is rebuilt on its next use
    rows = ["c", "a", None, "b"]
    _same(generate_causal_static(model, decoder, PROMPTS, config, rows), generate_causal(model, PROMPTS, config, rows))
    assert decoder.builds == 2
    base = [None] * 4  # no row with an adapter: a runner without the adapters' GEMMs
    _same(generate_causal_static(model, decoder, PROMPTS, config, base), generate_causal(model, PROMPTS, config, base))
    assert decoder.built == [(4, False, 1), (4, True, 1)] and decoder.builds == 3
    alone = generate_causal(model, PROMPTS, config)
    assert [h[0].tokens for h in alone] != [h[0].tokens for h in generate_causal(model, PROMPTS, config, rows)]


@pytest.mark.parametrize("family", ["causal", "seq2seq"])
def test_beams_keep_their_rows_adapters(family):
    model = tiny_causal_lm() if family == "causal" else tiny_seq2seq()
    _add_adapter(model, "a", 0)
    _add_adapter(model, "b", 1)
    config, rows = CONFIGS[2], ["a", None, "b", "a"]
    decoder = StaticDecoder(model, rows=len(PROMPTS) * config.rows_per_input, capacity=24, source_capacity=12)
    static, eager = (generate_causal_static, generate_causal) if family == "causal" else (generate_seq2seq_static,
                                                                                          generate_seq2seq)
    _same(static(model, decoder, PROMPTS, config, rows), eager(model, PROMPTS, config, rows))
    assert decoder.builds == 1


@pytest.mark.parametrize("family", list(SEQ2SEQ))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.strategy)
def test_seq2seq_static_step_gives_todays_tokens(family, config):
    model = eos_friendly(tiny_seq2seq(tie_embeddings=False, **SEQ2SEQ[family]))
    decoder = StaticDecoder(model, rows=len(PROMPTS) * config.rows_per_input, capacity=16, source_capacity=12)
    _same(generate_seq2seq_static(model, decoder, PROMPTS, config), generate_seq2seq(model, PROMPTS, config))
    assert decoder.builds > 0


def test_what_the_buffers_do_not_hold_decodes_eagerly():
    model = tiny_causal_lm()
    config = GenerationConfig(max_new_tokens=30)
    decoder = StaticDecoder(model, rows=2, capacity=16, sizes=(1, 2))
    _same(generate_causal_static(model, decoder, PROMPTS, config), generate_causal(model, PROMPTS, config))
    assert decoder.builds == 0  # 4 rows > 2, 7 + 30 positions > 16: the eager path
    wrap_heads(model, {"lm_head": model.lm_head})  # an adapter's head copies: rows routed on the host
    decoder = StaticDecoder(model, rows=4, capacity=32)
    config = GenerationConfig(max_new_tokens=8)
    _same(generate_causal_static(model, decoder, PROMPTS, config), generate_causal(model, PROMPTS, config))
    assert not decoder.holds_model() and decoder.builds == 0


def _started(model, prompts):
    """An eagerly started cache of ``prompts`` (a causal LM's prefill, a translator's encoder and BOS)."""
    ids, lengths = pad_batch(prompts, model.config.pad_id)
    if isinstance(model, Seq2SeqTransformer):
        return model.start(ids, capacity=1)[1]
    cache = model.new_cache(len(prompts), capacity=ids.shape[1])
    model.prefill(ids, lengths, cache)
    return cache


@pytest.mark.parametrize("family", [*CAUSAL, *SEQ2SEQ])
def test_verification_steps_give_the_eager_logits_and_decode_on(family):
    """A fed token and a draft a row (3 and 6 tokens: padded to widths 4 and 8) through the static step give the eager
    verify_step's logits; rejected positions truncated, the rows decode on as the eager cache's do."""
    model = (tiny_causal_lm(**CAUSAL[family]) if family in CAUSAL
             else tiny_seq2seq(tie_embeddings=False, **SEQ2SEQ[family]))
    prompts = PROMPTS[:3]
    decoder = StaticDecoder(model, rows=4, capacity=32, source_capacity=12)
    with torch.inference_mode():
        eager, static = _started(model, prompts), _started(model, prompts)
        for t, kept in ((3, 1), (6, 4)):
            draws = torch.Generator().manual_seed(t)
            fed = torch.randint(3, model.config.vocab_size, (len(prompts), t), generator=draws)
            assert decoder.refusal(static, t) is None
            torch.testing.assert_close(decoder.verify(fed, static, [None] * 3), model.verify_step(fed, eager),
                                       atol=1e-5, rtol=1e-5)
            for cache in (eager, static):  # rows accept different lengths of their drafts
                cache.truncate(cache.lengths - torch.tensor([t - kept, 0, t - 1]))
        fed = torch.tensor([5, 6, 7])
        torch.testing.assert_close(decoder.decode(fed, static, [None] * 3), model.decode_step(fed, eager),
                                   atol=1e-5, rtol=1e-5)
    assert {width for _, _, width in decoder.built} == {1, 4, 8}
