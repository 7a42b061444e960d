"""The AVX-512 decode-attention kernel against a float64 reference, and where it is used."""

import copy

import pytest
import torch
import torch.nn.functional as F

from model import native
from model.attention import QUERY_BLOCK, blocked_sdpa, decode_attention, encoder_rows
from model.decoding import GenerationConfig
from model.fast_step import plan_for
from model.generation import generate_causal, generate_seq2seq
from tests.model.conftest import random_ids, tiny_causal_lm, tiny_classifier, tiny_seq2seq

kernel = native.kernels()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the C++ decode-attention kernel does not run here")
needs_avx512 = pytest.mark.skipif(kernel is None or not kernel.has_avx512(), reason="the encoder kernel needs AVX-512")


def _reference(q, k, v, mask):
    scores = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v.double()


def _cache_slices(b, h, t, dh, capacity=40, seed=0):
    """K/V as a decoder reads them: the first t positions of preallocated (B, H, capacity, Dh) buffers."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(b, h, capacity, dh, generator=g) * 2 for _ in range(2))
    return k[:, :, :t], v[:, :, :t]


@needs_kernel
@pytest.mark.parametrize(("b", "h", "tq", "t", "dh"), [(1, 8, 1, 1, 64), (3, 4, 1, 37, 64), (2, 2, 4, 33, 8),
                                                       (5, 3, 1, 17, 24), (1, 1, 16, 40, 128), (2, 8, 3, 16, 100)])
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_equals_the_float64_reference(b, h, tq, t, dh, masked, vector_bits):
    q = torch.randn(b, h, tq, dh)
    k, v = _cache_slices(b, h, t, dh)
    mask = None
    if masked:  # ragged rows: row i sees its first t - i keys
        lengths = torch.arange(t, t - b, -1).clamp(min=1)
        mask = (torch.arange(t) < lengths[:, None]).view(b, 1, 1, t)
    got = kernel.decode_attention(q, k, v, mask)
    assert got.shape == (b, h, tq, dh)
    assert got.transpose(1, 2).is_contiguous()  # laid out (B, Tq, H, Dh): merging the heads is a view
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_per_query_masks_and_a_query_with_nothing_to_see(vector_bits):
    q = torch.randn(2, 2, 3, 16)
    k, v = _cache_slices(2, 2, 5, 16)
    mask = torch.rand(2, 2, 3, 5) > 0.4
    mask[0, 1, 2] = False  # this query may attend to nothing
    got = kernel.decode_attention(q, k, v, mask)
    assert torch.equal(got[0, 1, 2], torch.zeros(16))
    live = mask.any(-1)
    torch.testing.assert_close(got[live].double(), _reference(q, k, v, mask)[live], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_bad_inputs_raise():
    q, (k, v) = torch.randn(1, 2, 1, 16), _cache_slices(1, 2, 4, 16)
    with pytest.raises(RuntimeError, match="decode attention"):
        kernel.decode_attention(q.double(), k.double(), v.double(), None)
    with pytest.raises(RuntimeError, match="decode attention"):  # KV heads that do not divide the query heads
        kernel.decode_attention(torch.randn(1, 3, 1, 16), k, v, None)
    with pytest.raises(RuntimeError, match="decode attention"):
        kernel.decode_attention(q, k, v, torch.ones(1, 1, 1, 3, dtype=torch.bool))


def test_other_inputs_take_sdpa():
    """float64, autograd and long query blocks are SDPA's; results equal SDPA exactly there."""
    q, (k, v) = torch.randn(1, 2, 20, 16), _cache_slices(1, 2, 20, 16)
    assert torch.equal(decode_attention(q, k, v, None), F.scaled_dot_product_attention(q, k, v))
    q64, k64, v64 = q[:, :, :1].double(), k.double(), v.double()
    assert torch.equal(decode_attention(q64, k64, v64, None), F.scaled_dot_product_attention(q64, k64, v64))
    qg = q[:, :, :1].clone().requires_grad_()
    decode_attention(qg, k, v, None).sum().backward()
    assert qg.grad is not None


@pytest.mark.parametrize("t", [QUERY_BLOCK + 1, 2 * QUERY_BLOCK, 3 * QUERY_BLOCK + 7])
@pytest.mark.parametrize("window", [None, 20])
def test_long_query_blocks_attend_in_blocks_as_sdpa_over_the_whole(t, window):
    """A causal prefill of more than QUERY_BLOCK queries (left-padded rows, grouped K/V, a sliding window) run in
    query blocks, each against the keys its mask shows, equals the float64 reference, and SDPA over the whole where
    a query sees nothing (a padded row's)."""
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(3, h, t, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    pos = torch.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    pads = torch.tensor([0, 5, t - 3])
    mask = mask[None, None] & (pos >= pads[:, None])[:, None, None, :]  # (B, 1, Tq, Tk): padded keys hidden
    ours = blocked_sdpa(q, k, v, mask)
    expected = _reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask)
    seen = mask.any(-1, keepdim=True).expand_as(ours)
    assert torch.allclose(ours[seen], expected[seen], atol=1e-12)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(ours, whole, atol=1e-12, equal_nan=True)


@needs_kernel
def test_decoding_with_the_kernel_equals_decoding_with_sdpa(kernel_options):
    """Greedy and beam outputs (padded batches: masks in self- and cross-attention) do not change."""
    torch.manual_seed(0)
    lm, mt = tiny_causal_lm().eval(), tiny_seq2seq().eval()
    prompts = [[9, 10, 11], [20], [30, 31, 32, 33, 34]]
    sources = random_ids(4, 7, seed=3).tolist()
    sources[1] = sources[1][:3]
    configs = [GenerationConfig(max_new_tokens=6), GenerationConfig(strategy="beam", num_beams=3, max_new_tokens=6)]

    def outputs():
        return [[h[0].tokens for h in generate_causal(lm, prompts, c)] + [h[0].tokens for h in
                generate_seq2seq(mt, sources, c)] for c in configs]

    with_kernel = outputs()
    kernel_options(decode_kernels=False)
    assert outputs() == with_kernel


@needs_kernel
def test_short_sentences_attend_with_the_kernel_and_match_the_float64_reference(kernel_options, monkeypatch):
    """The layers of an encoder over up to 16 tokens (padded rows, the [CLS]-only last layer; the path of rows with
    adapters, which the C++ forward does not take) attend with our kernel; their logits equal the float64 model's
    and those of the same model without our kernels."""
    model = tiny_classifier().eval()
    ids = random_ids(3, 12, seed=5)
    ids[1, 7:] = model.config.pad_id
    reference = copy.deepcopy(model).double()(ids)
    plan_for(model.encoder).native = None  # the layers themselves
    calls = []
    counted = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *args: calls.append(args[0].shape) or counted(*args))
    with torch.inference_mode():
        got = model(ids)
    assert len(calls) == model.config.n_layers and calls[-1][2] == 1  # every layer; the last for [CLS] alone
    torch.testing.assert_close(got.double(), reference, rtol=0, atol=1e-5)
    kernel_options(decode_kernels=False)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), got, rtol=0, atol=1e-5)


def _prefixed_case(seed=0, layers=2, h=3, dh=24, block=4, t=5, tq=2, chains=((0, 1), (2,), (0, 1), ()), ragged=True):
    """Rows over shared blocks (by default: rows 0 and 2 read blocks (0, 1), row 1 reads (2,), row 3 none); the own
    keys are ragged (a mask per row) or causal alike (one mask for all rows). Returns the inputs and, per layer, the
    float64 attention over each row's blocks (in table order) followed by its own keys."""
    g = torch.Generator().manual_seed(seed)
    count = 1 + max(max(chain, default=0) for chain in chains)
    blocks = [torch.randn(layers, 2, h, block, dh, generator=g) for _ in range(count)]
    b = len(chains)
    q = torch.randn(b, h, tq, dh, generator=g)
    k, v = _cache_slices(b, h, t, dh, seed=seed + 1)
    if ragged:
        mask = (torch.arange(t) < torch.randint(1, t + 1, (b,), generator=g)[:, None]).view(b, 1, 1, t)
    else:
        mask = (torch.arange(t) <= torch.arange(t - tq, t)[:, None]).view(1, 1, tq, t)
    references = []
    for layer in range(layers):
        rows = []
        for row, chain in enumerate(chains):
            keys = torch.cat([*(blocks[i][layer, 0] for i in chain), k[row]], dim=1)[None]
            values = torch.cat([*(blocks[i][layer, 1] for i in chain), v[row]], dim=1)[None]
            own = mask[row if ragged else 0, 0]
            seen = torch.cat([torch.ones(tq, len(chain) * block, dtype=torch.bool), own.expand(tq, t)], dim=1)
            rows.append(_reference(q[row: row + 1], keys, values, seen[None, None]))
        references.append(torch.cat(rows))
    return blocks, chains, q, k, v, mask, references


@needs_kernel
def test_the_kernel_reads_each_rows_prefix_blocks_ahead_of_its_own_keys(vector_bits):
    blocks, chains, q, k, v, mask, references = _prefixed_case()
    table = torch.tensor([[0, 1], [2, -1], [0, 1], [-1, -1]])
    for layer, want in enumerate(references):
        got = kernel.decode_attention(q, k, v, mask, blocks, table, layer)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="names no block"):
        kernel.decode_attention(q, k, v, mask, blocks, torch.tensor([[0, 3]] * 4), 0)
    with pytest.raises(RuntimeError, match="layers, 2, H_kv, block, Dh"):
        kernel.decode_attention(q, k, v, mask, blocks, table, 2)


@pytest.mark.parametrize(("chains", "ragged"), [
    (((0, 1), (2,), (0, 1), ()), True),  # one chain shared by rows 0 and 2, another, none
    # multi-turn chat: each row its own history (chains of different lengths, some sharing a system prompt's
    # block 0), two rows of one chain apart, rows with none; each row reads only its own chain
    (((0, 1, 2), (3,), (), (0, 4), (0, 1, 2), (5, 6, 7, 8), ()), True),
    (((0, 1, 2), (0, 3), (0, 3), ()), False),  # a prefill of equal lengths: one causal mask for all rows
    (((1, 0),) * 3, False),  # one shared prefix
])
@pytest.mark.parametrize("tq", [2, 18])  # a decoding step's few queries (one GEMM per chain), a prefill's (SDPA)
def test_the_pytorch_prefix_path_equals_the_float64_reference(kernel_options, chains, ragged, tq):
    """The path without our kernel (other devices and dtypes, prefills) computes the same attention; on a float64
    input it is the reference to the last bits."""
    from model.shared_prefix import SharedPrefix

    blocks, chains, q, k, v, mask, references = _prefixed_case(seed=3, tq=tq, t=20, chains=chains, ragged=ragged)
    prefix = SharedPrefix.of_chains([[blocks[i] for i in chain] for chain in chains])
    kernel_options(decode_kernels=False)
    for layer, want in enumerate(references):
        torch.testing.assert_close(decode_attention(q, k, v, mask, prefix, layer).double(), want, rtol=1e-5, atol=1e-5)
    doubled = SharedPrefix.of_chains([[blocks[i].double() for i in chain] for chain in chains])
    got = decode_attention(q.double(), k.double(), v.double(), mask, doubled, 1)
    torch.testing.assert_close(got, references[1], rtol=1e-12, atol=1e-12)


def test_the_pytorch_prefix_path_computes_half_precision_in_float32(kernel_options):
    from model.shared_prefix import SharedPrefix

    blocks, chains, q, k, v, mask, references = _prefixed_case(seed=5)
    halves = [b.bfloat16() for b in blocks]
    prefix = SharedPrefix.of_chains([[halves[i] for i in chain] for chain in chains])
    got = decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, prefix, 0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), references[0], rtol=2e-2, atol=2e-2)


# ---- the encoder-attention kernel (model/kernels/encoder_attention.cpp) ----


@needs_avx512
@pytest.mark.parametrize(("b", "h", "t"), [(1, 12, 128), (3, 4, 37), (2, 2, 1), (4, 2, 200)])
@pytest.mark.parametrize("masked", ["none", "per row", "shared"])
def test_encoder_kernel_equals_the_float64_reference_on_fused_qkv_views(b, h, t, masked):
    qkv = torch.randn(b, t, 3 * h * 64, generator=torch.Generator().manual_seed(t))
    q, k, v = (x.view(b, t, h, 64).transpose(1, 2) for x in qkv.split(h * 64, -1))  # as split_qkv gives them
    mask = None
    if masked == "per row":
        mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
        for row in range(b):
            mask[row, ..., max(1, t - 5 * row):] = False  # right padding, each row its own length
    elif masked == "shared":
        mask = torch.ones(1, 1, 1, t, dtype=torch.bool)
        mask[..., t // 2 + 1:] = False
    got = kernel.encoder_attention(q, k, v, mask)
    assert got.shape == (b, h, t, 64) and got.transpose(1, 2).is_contiguous()  # merging the heads copies nothing
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


@needs_avx512
def test_a_row_that_sees_no_key_gets_zeros():
    q = torch.randn(2, 3, 8, 64)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    mask[1] = False
    got = kernel.encoder_attention(q, q, q, mask)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got[0].double(), _reference(q[:1], q[:1], q[:1], mask[:1])[0], rtol=1e-5, atol=1e-5)


@needs_avx512
def test_encoder_rows_take_the_kernel_and_give_sdpas_outputs():
    q, k, v = (torch.randn(3, 4, 40, 64, generator=torch.Generator().manual_seed(s)) for s in range(3))
    mask = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    mask[1, ..., 30:] = False
    assert encoder_rows(q, k, v, mask) and not encoder_rows(q, k, v, mask.expand(3, 1, 40, 40))  # a causal/window mask
    assert not encoder_rows(q[..., :32], k[..., :32], v[..., :32], mask)  # another head dim
    torch.testing.assert_close(blocked_sdpa(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               rtol=1e-5, atol=1e-5)


# The encoder-attention kernel's block edges (8-query blocks, 32-key score tiles).
def _fused(b, h, t, seed):
    """q, k, v (B, H, T, 64) as views of one fused projection, as split_qkv gives them."""
    qkv = torch.randn(b, t, 3 * h * 64, generator=torch.Generator().manual_seed(seed))
    return tuple(x.view(b, t, h, 64).transpose(1, 2) for x in qkv.split(h * 64, -1))


@needs_avx512
@pytest.mark.parametrize("t", [7, 8, 9, 16, 17, 31, 33, 48, 65])  # blocks of 8 queries; 16, 32 or 48 padded keys
def test_partial_query_blocks_and_key_tiles_equal_the_float64_reference(t):
    q, k, v = _fused(2, 3, t, seed=t)
    mask = torch.ones(2, 1, 1, t, dtype=torch.bool)
    mask[1, ..., max(1, t - 6):] = False
    torch.testing.assert_close(kernel.encoder_attention(q, k, v, mask).double(), _reference(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)


@needs_avx512
def test_a_querys_output_does_not_depend_on_its_block():
    q, k, v = _fused(1, 2, 37, seed=0)
    order = torch.randperm(37, generator=torch.Generator().manual_seed(1))
    got = kernel.encoder_attention(q, k, v, None)
    moved = kernel.encoder_attention(q[:, :, order].contiguous(), k, v, None)  # each query in another block slot
    assert torch.equal(moved, got[:, :, order])
