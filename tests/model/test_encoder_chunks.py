"""An encoder's large inference forward runs in chunks of rows (model/fast_step.ENCODER_CHUNK_TOKENS), with the
outputs of one forward; what must see every row at once takes one forward."""

import pytest
import torch

from model import fast_step, native
from model.lora import LoRAConfig, add_adapter, use_adapters
from tests.model.conftest import random_ids, tiny_classifier

LENGTH = 20  # past the C++ encoder's positions (lowered to 16 here): the layers run, and their forwards can be counted


@pytest.fixture(autouse=True)
def layers_past_16_tokens(monkeypatch):
    """Rows of LENGTH tokens take the layers, not the C++ encoder (which takes up to 64)."""
    if native.kernels() is not None:
        monkeypatch.setattr(native.kernels(), "MAX_ENCODE_TOKENS", 16)


class _Forwards:
    """Counts the encoder stack's forwards."""

    def __init__(self, stack: torch.nn.Module) -> None:
        self.calls = 0
        stack.register_forward_hook(self._count)

    def _count(self, *_) -> None:
        self.calls += 1


def _padded_ids(batch: int = 7):
    ids = random_ids(batch, LENGTH, seed=3)
    ids[1, 9:] = 0  # padded rows (pad id 0), in different chunks
    ids[batch - 1, 4:] = 0
    return ids


@pytest.fixture
def chunk_tokens(monkeypatch):
    return lambda tokens: monkeypatch.setattr(fast_step, "ENCODER_CHUNK_TOKENS", tokens)


def test_a_large_forward_runs_in_chunks_of_rows_with_the_outputs_of_one_forward(chunk_tokens):
    model, ids = tiny_classifier(), _padded_ids()
    forwards = _Forwards(model.encoder)
    with torch.inference_mode():
        chunk_tokens(10_000)
        whole_logits, (whole_hidden, _) = model(ids), model.encode(ids)
        assert forwards.calls == 2
        chunk_tokens(2 * LENGTH)  # two rows a chunk: 7 rows in 4 chunks
        logits, (hidden, maps) = model(ids), model.encode(ids)
    assert forwards.calls == 2 + 4 + 4
    assert maps == [{} for _ in model.encoder.layers]
    torch.testing.assert_close(logits, whole_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden, whole_hidden, rtol=0, atol=1e-6)
    assert hidden.shape == (7, LENGTH, model.config.d_model)


def test_a_row_longer_than_a_chunk_is_a_chunk_of_its_own(chunk_tokens):
    model, ids = tiny_classifier(), _padded_ids(3)
    forwards = _Forwards(model.encoder)
    chunk_tokens(LENGTH // 2)
    with torch.inference_mode():
        logits = model(ids)
        assert forwards.calls == 3
        torch.testing.assert_close(logits, torch.cat([model(ids[i:i + 1]) for i in range(3)]), rtol=0, atol=1e-6)


def test_attention_maps_per_row_adapters_and_autograd_take_one_forward(chunk_tokens):
    model, ids = tiny_classifier(), _padded_ids()
    add_adapter(model, "a", LoRAConfig(r=2, target_modules=["q_proj", "v_proj"]), seed=1)
    with torch.no_grad():  # a visible adapter: B starts at zero
        for p in model.parameters():
            if p.shape[-1] == 2 or p.shape[0] == 2:
                p.add_(0.1)
    forwards = _Forwards(model.encoder)
    chunk_tokens(2 * LENGTH)
    rows = ["a", None, "a", None, None, "a", "a"]
    with torch.inference_mode():
        _, maps = model.encode(ids, attention_weights=True)
        assert forwards.calls == 1 and all(m for m in maps)
        with use_adapters(model, rows):
            mixed = model(ids)
        assert forwards.calls == 2
        with use_adapters(model, "a"):  # one adapter for every row: chunks are fine
            adapted = model(ids)
        assert forwards.calls == 2 + 4
        base = model(ids)
        assert forwards.calls == 2 + 4 + 4
    assert (adapted - base).abs().max() > 1e-3  # the adapter changes the logits
    for i, name in enumerate(rows):
        torch.testing.assert_close(mixed[i], (adapted if name == "a" else base)[i], rtol=0, atol=1e-5)
    model(ids).sum().backward()  # autograd: one forward, gradients through every row
    assert forwards.calls == 2 + 4 + 4 + 1
