"""Tiny models shared by the model tests (float64 where the test compares numerics)."""

import contextlib
import dataclasses

import pytest
import torch

from model import native
from model.causal_lm import CausalLM
from model.classifier import TransformerClassifier
from model.config import CausalLMConfig, ClassifierConfig, Seq2SeqConfig
from model.cpu import kernel_tuning, this_cpu
from model.seq2seq import Seq2SeqTransformer

TINY = dict(vocab_size=40, d_model=32, n_heads=4, d_ff=64, dropout=0.0, max_len=64)


def tiny_causal_lm(**overrides) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(CausalLMConfig(**{**TINY, "n_layers": 2, **overrides})).eval()


def tiny_seq2seq(**overrides) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(
        Seq2SeqConfig(**{**TINY, "n_encoder_layers": 2, "n_decoder_layers": 2, "max_src_len": 64, **overrides})
    ).eval()


def tiny_classifier(**overrides) -> TransformerClassifier:
    torch.manual_seed(0)
    return TransformerClassifier(ClassifierConfig(**{**TINY, "n_layers": 2, "num_labels": 3, **overrides})).eval()


@pytest.fixture
def kernel_options():
    """Changes this process's kernel options for one test: ``kernel_options(packed_weights=False)``."""
    with contextlib.ExitStack() as changes:
        yield lambda **fields: changes.enter_context(native.using_options(**fields))


@pytest.fixture(params=["pre", "post"])
def norm(request) -> str:
    return request.param


def random_ids(batch: int, length: int, vocab: int = 40, seed: int = 1) -> torch.Tensor:
    """Token ids avoiding the special ids 0..6."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(7, vocab, (batch, length), generator=g)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """The test at 1 and at 2 ATen threads (the process's count restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


_kernels = native.kernels()
VECTOR_WIDTHS = [bits for bits, runs in ((512, _kernels and _kernels.has_avx512()),
                                         (256, _kernels and _kernels.has_avx2())) if runs]


@pytest.fixture
def vector_bits_of():
    """cap(bits): the C++ kernels capped at that vector width for the test (``PanelTuning.vector_bits``: an AVX-512
    CPU runs the AVX2 twins at 256); this CPU's rule restored after."""
    def cap(bits: int) -> None:
        native.apply_tuning(_kernels, dataclasses.replace(kernel_tuning(this_cpu()), vector_bits=bits))

    yield cap
    if _kernels is not None:
        native.apply_tuning(_kernels, kernel_tuning(this_cpu()))


@pytest.fixture(params=VECTOR_WIDTHS, ids=lambda bits: f"{bits}-bit")
def vector_bits(request, vector_bits_of):
    """The C++ kernels capped at each vector width this CPU runs, for the test."""
    vector_bits_of(request.param)
    return request.param
