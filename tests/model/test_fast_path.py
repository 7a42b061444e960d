"""The fast paths equal the general ones: uniform-length KV cache, int8 weights, fused int8 q/k/v, LoRA on int8."""

import copy

import pytest
import torch
import torch.nn.functional as F

from model import int8_kernel
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq
from model.int8_linear import Int8Linear
from model.kv_cache import KVCache
from model.lora import AdapterError, LoRAConfig, add_adapter, delete_adapter, merge_adapter, use_adapters
from model.quantize import QuantizeError, mode_for, quantize_int8
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_classifier, tiny_seq2seq

SOURCES = [[9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21], [22, 23, 24, 25, 26]]
GREEDY = GenerationConfig(max_new_tokens=10)
BEAM = GenerationConfig(strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=8)
# |int8 - fp32| logits relative to the largest fp32 logit: d_model 32 and 7-bit activations make the tiny
# models coarse (measured 2-5%; the trained default models lose < 1% of their metric, docs/benchmarks.md).
INT8_LOGIT_TOL = 0.1


def _not_uniform(cache: KVCache) -> KVCache:
    cache.uniform = False
    return cache


def _force_general_path(monkeypatch) -> None:
    """Every cache takes the per-row path (masks, indexed writes, zeroed tails)."""
    empty = KVCache.empty.__func__
    monkeypatch.setattr(KVCache, "empty", classmethod(lambda cls, *a, **kw: _not_uniform(empty(cls, *a, **kw))))


@pytest.mark.parametrize("config", [GREEDY, BEAM], ids=["greedy", "beam"])
def test_uniform_cache_path_equals_the_per_row_path(config, monkeypatch):
    lm, mt = tiny_causal_lm().double(), tiny_seq2seq().double()
    prompts = [s[:4] for s in SOURCES]  # equal lengths: the cache stays uniform
    fast = (generate_causal(lm, prompts, config), generate_seq2seq(mt, SOURCES, config))
    _force_general_path(monkeypatch)
    general = (generate_causal(lm, prompts, config), generate_seq2seq(mt, SOURCES, config))
    for got, want in zip(fast, general, strict=True):
        assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in want]
        assert [h.score for hs in got for h in hs] == pytest.approx([h.score for hs in want for h in hs], abs=1e-6)


def test_uniform_decode_needs_no_mask_and_ragged_prefill_is_not_uniform():
    model = tiny_causal_lm()
    cache = model.new_cache(2, 8)
    model.prefill(random_ids(2, 3), torch.tensor([3, 3]), cache)
    assert cache.uniform and cache.begin_step(1)[1] is None
    ragged = model.new_cache(2, 8)
    model.prefill(random_ids(2, 3), torch.tensor([3, 1]), ragged)
    assert not ragged.uniform and ragged.begin_step(1)[1] is not None


def test_a_uniform_step_positions_are_the_lengths_and_outlive_end_step():
    model = tiny_causal_lm()
    cache = model.new_cache(2, 8)
    model.prefill(random_ids(2, 3), torch.tensor([3, 3]), cache)
    positions, _ = cache.begin_step(1)
    assert positions.tolist() == [[3], [3]] and cache.write_positions is positions
    cache.end_step(1)
    assert positions.tolist() == [[3], [3]] and cache.lengths.tolist() == [4, 4]  # end_step made new lengths


def test_a_rotary_step_embeds_as_the_module_and_a_hook_on_the_table_still_sees_it():
    """decode_step takes a rotary model's token rows by one torch.embedding (Embeddings.for_step): the same
    logits as through Embeddings.forward; a forward hook on the token table makes the step call the modules."""
    model = tiny_causal_lm(positions="rope", scale_embeddings=False)
    prompt, tokens = random_ids(2, 3), torch.tensor([5, 7])

    def step() -> torch.Tensor:
        cache = model.new_cache(2, 8)
        model.prefill(prompt, torch.tensor([3, 3]), cache)
        return model.decode_step(tokens, cache)

    with torch.inference_mode():
        fast = step()
        seen = []
        handle = model.embed.tokens.register_forward_hook(lambda _m, args, _out: seen.append(args[0].tolist()))
        hooked = step()
        handle.remove()
    assert torch.equal(fast, hooked)
    assert seen[-1] == [[5], [7]]  # the step's own call (the prompt's came first)


def test_unpadded_sources_need_no_cross_attention_mask():
    model = tiny_seq2seq().double()
    with torch.no_grad():
        _, equal = model.start(torch.tensor([SOURCES[0], SOURCES[3][:4]]), capacity=4)
        assert equal.cross.attention_mask is None
        padded = torch.tensor([SOURCES[0] + [model.config.pad_id], SOURCES[3]])
        _, ragged = model.start(padded, capacity=4)
        assert ragged.cross.attention_mask is ragged.cross.mask and not bool(ragged.cross.mask.all())
        # The unmasked step equals one through the all-True mask.
        tokens = torch.tensor([5, 6])
        masked = copy.deepcopy(equal)
        masked.cross.attention_mask = masked.cross.mask
        assert torch.allclose(model.decode_step(tokens, equal), model.decode_step(tokens, masked), atol=1e-12)


def test_concat_of_reordered_uniform_caches_never_reads_their_unset_tails():
    """select() leaves a uniform cache's tail unset; rows of another length joining it must not see it."""
    model = tiny_causal_lm().double()
    ids = random_ids(3, 6)
    caches = []
    for b, length in enumerate((2, 5)):
        cache = model.new_cache(1, 16)
        model.prefill(ids[b: b + 1, :length], torch.tensor([length]), cache)
        cache.select(torch.tensor([0, 0]))  # duplicate: the tails of the new buffers are uninitialised
        for buf in cache.keys + cache.values:
            buf[:, :, length:] = float("nan")  # what uninitialised memory may hold
        caches.append(cache)
    joined = KVCache.concat(caches)
    assert not joined.uniform
    out = model.decode_step(torch.tensor([7, 8, 9, 10]), joined)
    for row, (b, length) in enumerate([(0, 2), (0, 2), (1, 5), (1, 5)]):
        nxt = torch.tensor([[7, 8, 9, 10][row]])
        alone = model(torch.cat([ids[b: b + 1, :length], nxt[None]], dim=1))[0, -1]
        assert torch.isfinite(out[row]).all() and (out[row] - alone).abs().max() < 1e-10


@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("index", [[2, 0, 1, 1], [0, 1, 2, 3], [3, 3, 0, 2], [1, 0, 3, 2]])
def test_same_size_reorder_in_place_equals_a_gather(index, kernels, kernel_options):
    """Beams reordered in place (only moved rows copied, sources read before any write) = index_select, by the
    kernels' copy (where they run) and by tensor ops."""
    kernel_options(decode_kernels=kernels == "on")
    cache = KVCache.empty(2, 4, 2, 3, 10, "cpu", torch.float64)
    for buf in cache.keys + cache.values:
        buf.copy_(torch.randn_like(buf))
    cache.max_length, cache.lengths = 6, torch.full((4,), 6)
    before = [buf.clone() for buf in cache.keys + cache.values]
    index = torch.tensor(index)
    cache.select(index)
    for old, new in zip(before, cache.keys + cache.values, strict=True):
        assert torch.equal(new[:, :, :6], old[:, :, :6].index_select(0, index))
        assert torch.isfinite(new).all()



@pytest.mark.parametrize("kernels", ["on", "off"])
def test_a_reorder_with_tails_copies_only_the_positions_that_may_differ(kernels, kernel_options):
    """With a search's tails (row 0 may differ from its new parent in its last 2 positions), the moved row gets
    the parent's last 2 positions and keeps its own before (the search vouches they hold the same tokens);
    rows that stay are untouched."""
    kernel_options(decode_kernels=kernels == "on")
    cache = KVCache.empty(1, 3, 2, 3, 10, "cpu", torch.float64)
    for buf in cache.keys + cache.values:
        buf.copy_(torch.randn_like(buf))
    cache.max_length, cache.lengths = 6, torch.full((3,), 6)
    before = [buf.clone() for buf in cache.keys + cache.values]
    cache.select(torch.tensor([1, 1, 2]), tails=torch.tensor([2, 0, 0]))
    for old, new in zip(before, cache.keys + cache.values, strict=True):
        assert torch.equal(new[0, :, 4:6], old[1, :, 4:6]) and torch.equal(new[0, :, :4], old[0, :, :4])
        assert torch.equal(new[1:], old[1:])


# ---- int8 ------------------------------------------------------------------------------------------


def _fit(model: torch.nn.Module, loss_fn, steps: int = 150) -> torch.nn.Module:
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = loss_fn(model)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained_mt():
    """A tiny seq2seq taught to reverse its source, so greedy outputs are confident (no near-ties)."""
    src = random_ids(32, 6, seed=5)
    tgt = src.flip(1)
    bos, eos = torch.ones(32, 1, dtype=torch.long), torch.full((32, 1), 2)

    def loss(model):
        logits = model(src, torch.cat([bos, tgt], 1))
        return F.cross_entropy(logits.flatten(0, 1), torch.cat([tgt, eos], 1).flatten())

    return _fit(tiny_seq2seq(), loss)


@pytest.fixture(scope="module")
def trained_lm():
    """A tiny causal LM taught to count up (id + 1), so greedy continuations are confident."""
    ids = (random_ids(32, 1, seed=6) + torch.arange(12)) % 33 + 7

    def loss(model):
        return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    return _fit(tiny_causal_lm(), loss)


def _int8(model):
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    return quantized


@pytest.mark.parametrize("kernel", ["kernel", "fbgemm"])
def test_int8_logits_close_and_greedy_outputs_equal(trained_mt, trained_lm, kernel, kernel_options):
    if kernel == "kernel" and int8_kernel.kernel() is None:
        pytest.skip("our int8 kernel does not run here")
    kernel_options(int8_kernel=kernel)
    mt8, lm8 = _int8(trained_mt), _int8(trained_lm)
    assert {m.backend for m in mt8.modules() if isinstance(m, Int8Linear)} == {kernel}
    assert all(type(m) is not torch.nn.Linear for m in mt8.modules())
    src, tgt = random_ids(4, 6, seed=5)[:, :6], random_ids(4, 5, seed=9)
    ids = random_ids(4, 8, seed=6)
    with torch.inference_mode():
        for got, want in ((mt8(src, tgt), trained_mt(src, tgt)), (lm8(ids), trained_lm(ids))):
            assert (got - want).abs().max() < INT8_LOGIT_TOL * want.abs().max()
    sources = random_ids(6, 6, seed=5).tolist()
    assert [h[0].tokens for h in generate_seq2seq(mt8, sources, GREEDY)] == \
        [h[0].tokens for h in generate_seq2seq(trained_mt, sources, GREEDY)]
    prompts = [[9, 10, 11], [20], [30, 31, 32, 33]]
    assert [h[0].tokens for h in generate_causal(lm8, prompts, GREEDY)] == \
        [h[0].tokens for h in generate_causal(trained_lm, prompts, GREEDY)]
    if kernel == "kernel":  # per-row activation scales: a sentence decodes alone as it does in its batch
        assert [h[0].tokens for h in generate_seq2seq(mt8, sources, GREEDY)] == \
            [generate_seq2seq(mt8, [s], GREEDY)[0][0].tokens for s in sources]


def test_fused_int8_qkv_equals_separate_projections(trained_mt):
    fused = _int8(trained_mt)
    separate = copy.deepcopy(fused)
    for layer in separate.encoder.layers:
        layer.self_attn._qkv_of = ()
    for layer in separate.decoder.layers:
        layer.self_attn._qkv_of = ()
    assert fused.encoder.layers[0].self_attn.fused and not separate.encoder.layers[0].self_attn.fused
    assert fused.decoder.layers[0].cross_attn.qkv_proj is None  # cross-attention projects q and k/v apart
    src, tgt = random_ids(3, 6), random_ids(3, 4, seed=2)
    with torch.inference_mode():
        assert (fused(src, tgt) - separate(src, tgt)).abs().max() < 1e-5
    assert [h[0].tokens for h in generate_seq2seq(fused, SOURCES, BEAM)] == \
        [h[0].tokens for h in generate_seq2seq(separate, SOURCES, BEAM)]


def test_lora_on_int8_adds_the_float_delta_and_unfuses_while_attached(trained_mt):
    model = _int8(trained_mt)
    attn = model.decoder.layers[0].self_attn
    add_adapter(model, "a", LoRAConfig(r=4, target_modules=("q_proj", "v_proj")), seed=1)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B["a"].weight.normal_(std=0.05)
    assert isinstance(attn.q_proj.base, Int8Linear) and not attn.fused
    x = torch.randn(2, 3, 32)
    with torch.inference_mode(), use_adapters(model, "a"):
        want = attn.q_proj.base(x) + attn.q_proj.lora_B["a"](attn.q_proj.lora_A["a"](x)) * attn.q_proj.scaling["a"]
        assert (attn.q_proj(x) - want).abs().max() < 1e-6
        with_adapter = generate_seq2seq(model, SOURCES, GREEDY, adapters="a")
    base = generate_seq2seq(model, SOURCES, GREEDY)
    assert [h[0].tokens for h in with_adapter] != [h[0].tokens for h in base]
    with pytest.raises(AdapterError, match="quantised"):
        merge_adapter(model, "a")
    delete_adapter(model, "a")
    assert attn.fused  # back to the modules the fused projection was built from


def test_quantize_refuses_a_merged_adapter_and_parses_modes():
    model = tiny_seq2seq()
    add_adapter(model, "m", LoRAConfig(r=2), seed=0)
    merge_adapter(model, "m")
    with pytest.raises(QuantizeError, match="merged"):
        quantize_int8(model)
    assert mode_for("int8", "x") == "int8" and mode_for("none,mt=int8", "mt") == "int8"
    assert mode_for("none,mt=int8", "lm") == "none" and mode_for("", "lm") == "none"
    with pytest.raises(QuantizeError, match="int4"):
        mode_for("mt=int4", "mt")


def test_classifier_last_layer_on_cls_only_equals_the_full_encoder(norm):
    model = tiny_classifier(norm=norm).double()
    ids = random_ids(3, 7)
    ids[1, 4:] = 0  # padding
    full, _ = model.encode(ids)
    cls, _ = model.encode(ids, cls_only=True)
    assert cls.shape == (3, 1, 32) and (cls[:, 0] - full[:, 0]).abs().max() < 1e-10
    logits = model.classifier(model.pool(full))
    assert (model(ids) - logits).abs().max() < 1e-10
