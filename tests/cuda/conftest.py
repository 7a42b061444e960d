"""Targets (device, dtype) for the GPU path's checks, and the tolerances each dtype is held to.

Every test here is a function of a :class:`Target`: ``cuda`` in float32, bfloat16 and float16 (marked
``cuda``: skipped without a GPU, run by ``scripts/gpu-check`` on a lent one), and the same body on the CPU in
float32, so CI runs the test logic too. ``TSERVE_TEST_CPU_DTYPES=float32,bfloat16,float16`` adds CPU variants
in the low-precision dtypes (slower; a way to try the tolerances and the tie rule without a GPU).

Tolerances are relative to the largest magnitude of the reference (logits, embeddings): a value computed in
``dtype`` may differ from a float64 CPU reference, or from the same value computed another way in the same
dtype (cached vs uncached, batched vs alone, merged vs unmerged), by ``TOLERANCE[dtype]`` times that magnitude.
Greedy/beam tokens are identical in float32; in bfloat16/float16 two searches may part only where the
two tokens' logits are within that tolerance of each other (a tie at the dtype's precision). The random Hugging Face
models of the Llama family round more than these tiny models do: their checks measure their tolerance in the test
(:func:`measured_tolerance`) and hold both rules to it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from model.generation import generate_causal, generate_seq2seq
from tests.model.conftest import tiny_causal_lm, tiny_seq2seq

# The session's trained tiny checkpoints and adapters (tests/service/fixtures.py), for the checkpoint,
# training and service checks.
from tests.service.conftest import adapters_dir, models_dir, tiny_root  # noqa: F401

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# About 8x the relative errors the CPU gives the tiny models against float64 (float32 3e-7, bfloat16 5e-3,
# float16 8e-4: their 8 and 11 significant bits, lost a little more over two layers); float32 more, for
# the GPU's other summation orders.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 6e-3}


@dataclass(frozen=True)
class Target:
    """Where and in which dtype a check runs."""

    device: str  # "cpu" or "cuda"
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def tol(self) -> float:
        return TOLERANCE[self.dtype]

    @property
    def exact(self) -> bool:
        """float32: searches must give identical tokens."""
        return self.dtype == torch.float32

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(device=self.device, dtype=self.dtype)

    def tensor(self, rows: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(rows, dtype=torch.long, device=self.device)

    def __str__(self) -> str:
        return f"{self.device}-{self.dtype_name}"


def _cpu_dtypes() -> list[torch.dtype]:
    names = os.environ.get("TSERVE_TEST_CPU_DTYPES", "float32")
    return [DTYPES[name.strip()] for name in names.split(",") if name.strip()]


def targets(*dtypes: torch.dtype) -> list:
    """pytest params: the CPU target(s) and the ``cuda``-marked targets of ``dtypes`` (default: all three)."""
    dtypes = dtypes or tuple(DTYPES.values())
    cpu = [Target("cpu", d) for d in _cpu_dtypes() if d in dtypes]
    cuda = [Target("cuda", d) for d in dtypes]
    return [pytest.param(t, id=str(t)) for t in cpu] + [pytest.param(t, id=str(t), marks=pytest.mark.cuda)
                                                         for t in cuda]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).abs().max() / want.abs().max()).item()


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "values") -> None:
    """|got - want| <= tol * max |want|, compared in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = want.abs().max().item()
    error = (got - want).abs().max().item()
    assert error <= tol * scale, f"{what}: max error {error:.3g} over {tol:g} x max |reference| {scale:.3g}"


def measured_tolerance(target: Target, reference: torch.Tensor, exact: torch.Tensor) -> float:
    """The tolerance of a model whose rounding grows more than the tiny ones' (a random Hugging Face model: weights
    of std 0.3, more norms; Gemma 3's bfloat16 logits 15% of the largest one off on the CPU): twice the relative
    error of a reference computation on the target (``reference``: transformers', or our offline model's) against
    the same computation in float32 on the CPU (``exact``), measured in the same test; at least the dtype's
    TOLERANCE."""
    return max(target.tol, 2 * relative_error(reference, exact))


def first_difference(a: Sequence[int], b: Sequence[int], eos: int) -> tuple[int, int, int] | None:
    """(step, a's token, b's token) where two generated sequences first part (EOS where one ended), or None."""
    for step in range(max(len(a), len(b))):
        x = a[step] if step < len(a) else eos
        y = b[step] if step < len(b) else eos
        if x != y:
            return step, x, y
    return None


LogitsAt = Callable[[list[int]], torch.Tensor]  # generated prefix -> the next token's logits (V,)


def assert_same_tokens(target: Target, got: Sequence[int], want: Sequence[int], eos: int, logits_at: LogitsAt,
                       tol: float | None = None) -> None:
    """Identical tokens in float32; in lower precision, identical up to a step where the two choices tie.

    ``logits_at(prefix)`` recomputes that step's logits (the tie is judged on them): the sequences may part
    only where the two tokens' logits are within the dtype's tolerance (or ``tol``) of each other.
    """
    if target.exact:
        assert list(got) == list(want)
        return
    diff = first_difference(got, want, eos)
    if diff is None:
        return
    step, x, y = diff
    logits = logits_at(list(want[:step])).double().cpu()
    gap, scale = abs(logits[x] - logits[y]).item(), logits.abs().max().item()
    tol = target.tol if tol is None else tol
    assert gap <= tol * scale, (
        f"tokens part at step {step} ({x} vs {y}) though their logits differ by {gap:.3g}, "
        f"over {tol:g} x {scale:.3g}: {list(got)} vs {list(want)}"
    )


def causal_logits_at(model: torch.nn.Module, prompt: Sequence[int]) -> LogitsAt:
    """The next-token logits of a causal LM after ``prompt`` + a generated prefix, by a full forward."""
    device = next(model.parameters()).device

    def logits_at(prefix: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([[*prompt, *prefix]], device=device))[0, -1]

    return logits_at


def seq2seq_logits_at(model: torch.nn.Module, source: Sequence[int]) -> LogitsAt:
    """The next-token logits of a translator for ``source`` after BOS + a generated prefix, teacher-forced."""
    device = next(model.parameters()).device

    def logits_at(prefix: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            tgt = torch.tensor([[model.config.bos_id, *prefix]], device=device)
            return model(torch.tensor([list(source)], device=device), tgt)[0, -1]

    return logits_at


# family -> (a tiny model maker, its generate function, its logits_at), for the decoding and LoRA checks
FAMILIES = {"causal_lm": (tiny_causal_lm, generate_causal, causal_logits_at),
            "seq2seq": (tiny_seq2seq, generate_seq2seq, seq2seq_logits_at)}  # fmt: skip
