"""The greedy choice kernel (model/kernels/greedy_pick.cpp) against torch's log_softmax + mask + max."""

import pytest
import torch

from model import native
from model.decoding import GenerationConfig
from model.logits import greedy_choice

kernel = native.kernels()
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ kernels do not run here")


def _reference(logits: torch.Tensor, banned: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    masked = logprobs.clone()
    masked[:, banned] = float("-inf")
    chosen, tokens = masked.max(dim=-1)
    return tokens, chosen


@pytest.mark.parametrize(("rows", "vocab"), [(1, 8000), (3, 37), (32, 8000), (2, 16), (5, 1)])
@pytest.mark.parametrize("banned", [[], [2], [0, 5]])
def test_kernel_equals_the_reference(rows, vocab, banned, vector_bits):
    banned = [b for b in banned if b < vocab]
    logits = torch.randn(rows, vocab) * 4
    tokens, logprobs = kernel.greedy_pick(logits, banned)
    expected_tokens, expected = _reference(logits, banned)
    if len(banned) < vocab:
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(logprobs.double(), expected, rtol=1e-6, atol=1e-5)


def test_the_first_maximal_column_wins_and_a_banned_maximum_gives_way(vector_bits):
    logits = torch.zeros(3, 40)
    logits[0, [7, 23, 39]] = 5.0  # ties across lanes: the first column
    logits[1, 2], logits[1, 30] = 9.0, 8.0  # the maximum is banned: the best allowed column
    logits[2, 17:] = float("-inf")  # -inf columns count for nothing
    logits[2, 3] = 1.0
    tokens, logprobs = kernel.greedy_pick(logits, [2])
    assert tokens.tolist() == [7, 30, 3]
    torch.testing.assert_close(logprobs.double(), _reference(logits, [2])[1], rtol=1e-6, atol=1e-5)


def test_a_row_of_minus_infinity_gives_a_token_and_minus_infinity(vector_bits):
    tokens, logprobs = kernel.greedy_pick(torch.full((1, 20), float("-inf")), [0])
    assert 0 <= tokens.item() < 20 and logprobs.item() == float("-inf")


@pytest.mark.parametrize("bad", ["banned_out_of_range", "negative_banned", "float64", "three_dims"])
def test_bad_inputs_raise(bad):
    logits, banned = torch.randn(2, 10), [1]
    if bad == "banned_out_of_range":
        banned = [10]
    if bad == "negative_banned":
        banned = [-1]
    if bad == "float64":
        logits = logits.double()
    if bad == "three_dims":
        logits = logits[None]
    with pytest.raises(RuntimeError):
        kernel.greedy_pick(logits, banned)


@pytest.mark.parametrize("step", [0, 5])
def test_greedy_choice_is_the_same_with_and_without_the_kernel(step, kernel_options):
    """Before min_new_tokens EOS (id 2) is banned, after it is not; torch's route gives the same choice."""
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=3)
    logits = torch.randn(4, 300)
    logits[:, 2] += 10  # EOS is everyone's maximum
    tokens, logprobs = greedy_choice(logits, step, config)
    kernel_options(decode_kernels=False)
    torch_tokens, torch_logprobs = greedy_choice(logits.clone(), step, config)
    assert torch.equal(tokens, torch_tokens)
    assert (tokens == 2).all() == (step >= config.min_new_tokens)
    torch.testing.assert_close(logprobs, torch_logprobs, rtol=1e-6, atol=1e-5)
