"""The int8 rerank's speed levers keep outputs: fc1's activation inside the int8 GEMM, and a padded batch scored in
groups of rows by length (model.classifier.length_groups)."""

import pytest
import torch

from model import int8_kernel
from model.classifier import length_groups
from model.fast_step import ENCODER_CHUNK_TOKENS
from model.int8_linear import Int8Linear
from model.kernel_layers import activate
from model.quantize import quantize_int8
from tests.model.conftest import tiny_classifier

kernel, why_not = int8_kernel.available()
needs_kernel = pytest.mark.skipif(kernel is None, reason=f"int8 kernel unavailable here: {why_not}")


@needs_kernel
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
# rows: a tile of 4 and remainders; outputs: partial blocks of 16 and groups of 4 blocks
@pytest.mark.parametrize(("rows", "out", "inp"), [(1, 37, 70), (5, 80, 130), (70, 200, 96)])
def test_the_activation_in_the_gemm_equals_the_pass_after_it(activation, rows, out, inp):
    torch.manual_seed(0)
    layer = Int8Linear(torch.randn(out, inp) * 0.05, torch.randn(out))
    x = torch.randn(rows, inp) * 3
    with torch.inference_mode():
        assert torch.equal(layer.activated(x, activation), activate(layer(x), activation))


@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_length_groups_cover_every_row_once_and_drop_only_padding(tokens):
    lengths = torch.tensor([3, 40, 17, 1, 40, 25, 9, 33] * 6)
    ids = torch.zeros(len(lengths), 40, dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, :n] = 7
    groups = length_groups(ids, 0, tokens)
    rows = torch.cat([r for r, _ in groups])
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for r, width in groups:
        assert width == int(lengths[r].max()) and (len(r) * width <= tokens or len(r) == 1)
    assert [w for _, w in groups] == sorted(w for _, w in groups)


def _padded_batch(pad: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """48 rows of 2-40 tokens right-padded to 40: more tokens than one group holds."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 41, (48,), generator=g).tolist()
    lengths[0] = 40
    ids = torch.full((48, 40), pad, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(7, 40, (n,), generator=g)
    segments = (torch.arange(40) >= 10).long().expand(48, -1) * (ids != pad)
    return ids, segments, lengths


@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=needs_kernel)])
@pytest.mark.parametrize("config", [dict(), dict(norm="post", positions="learned", position_offset=2, pad_id=1),
                                    dict(head_pooling="mean", pooler=True)])
def test_a_padded_batch_scores_and_embeds_each_row_as_alone(int8, config):
    model = tiny_classifier(type_vocab_size=2, **config)
    if int8:
        quantize_int8(model)
    ids, segments, lengths = _padded_batch(model.config.pad_id)
    assert len(length_groups(ids, model.config.pad_id, ENCODER_CHUNK_TOKENS)) > 1
    with torch.inference_mode():
        batch = model(ids, segments)
        alone = torch.cat([model(ids[r: r + 1, :n], segments[r: r + 1, :n]) for r, n in enumerate(lengths)])
        torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)
        for pooling in ("cls", "mean", "max"):
            batch = model.embed_texts(ids, segments, pooling)
            alone = torch.cat([model.embed_texts(ids[r: r + 1, :n], segments[r: r + 1, :n], pooling)
                               for r, n in enumerate(lengths)])
            torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)
