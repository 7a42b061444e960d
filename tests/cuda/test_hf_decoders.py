"""The Llama family (model/hf: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) on each target, against `transformers`
and `peft` on the same device in the same dtype.

Each variant is a random tiny model saved by transformers (tests/model/test_hf_llama.py, test_hf_decoders.py), loaded
as the service loads one (imported in float32, then placed on the device in the target's dtype) beside transformers'
own model loaded with ``from_pretrained(dtype=...)`` onto that device: logits over a sequence longer than the sliding
windows, greedy decoding of a left-padded batch equal to ``generate()``, and two PEFT adapters and the base mixed per
row equal to ``PeftModel`` row by row, in a forward and in greedy decoding.

These random models round far more than the tiny ones of the other checks (bfloat16 logits 2-6% of the largest one
off the float32 values on the CPU, Gemma 3's 15%, in transformers as in ours), so each test measures its tolerance
(tests.cuda.conftest.measured_tolerance): twice transformers' own error on the target against its float32 CPU
logits, at least the dtype's TOLERANCE. Ours must be within it of transformers' logits on the target and of its
float32 CPU logits; greedy tokens are identical in float32 and may part only at a tie within it otherwise. (At
every greedy step of these checks the two best logits are at least 0.25% of the largest apart in float32 on the CPU,
far beyond float32's differences between devices: a float32 parting on the GPU is a fault, not a tie.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model.generation import generate_causal
from model.hf import load_hf_model
from model.hf.llama import ADAPTER_LAYOUT as LLAMA_LAYOUT
from model.lora import use_adapters
from model.lora_io import load_adapter
from tests.cuda.conftest import (
    Target,
    assert_close,
    assert_same_tokens,
    causal_logits_at,
    measured_tolerance,
    relative_error,
    targets,
)
from tests.hf_compare import best_tokens, decoding, peft_adapter, strip
from tests.model.test_hf_decoders import EOS, PROMPTS, WINDOW, save
from tests.model.test_hf_llama import save_llama

transformers = pytest.importorskip("transformers")

# id -> what saves it: the architectures of issue 36, one variant each (test_hf_llama.py, test_hf_decoders.VARIANTS)
VARIANTS: dict[str, Callable[[Path], Path]] = {
    "llama-gqa": lambda d: save_llama(d, seed=3, eos_boost=2.0, num_key_value_heads=2),
    "mistral-window": lambda d: save(d, "mistral-window", eos_boost=2.0),
    "qwen2": lambda d: save(d, "qwen2", eos_boost=2.0),
    "qwen3-bias-window": lambda d: save(d, "qwen3-bias-window-head_dim-12", eos_boost=2.0),
    "phi3-partial-rotary": lambda d: save(d, "phi3-partial-window", eos_boost=2.0),
    "gemma3": lambda d: save(d, "gemma3", eos_boost=2.0),
}
IDS = [PROMPTS[1] * 6, PROMPTS[3] * 8 + [9, 9]]  # two rows of 42 positions, ten sliding windows of 4
MIXED = {  # PEFT LoraConfig fields of two adapters on llama-gqa: every projection; copies of lm_head and embed_tokens
    "every-projection": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"]),
    "head-and-embedding-copies": dict(r=2, lora_alpha=4, target_modules=["v_proj", "up_proj"],
                                      modules_to_save=["lm_head", "embed_tokens"]),
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The directory of a VARIANTS id, saved once for the module."""
    root, saved = tmp_path_factory.mktemp("hf-decoders"), {}

    def get(variant: str) -> Path:
        if variant not in saved:
            saved[variant] = VARIANTS[variant](root / variant)
        return saved[variant]

    return get


def ours_on(directory: Path, target: Target) -> torch.nn.Module:
    """Our model of ``directory`` as the service loads it: imported in float32, placed on the target."""
    return target.place(load_hf_model(directory)[0])


def transformers_on(directory: Path, target: Target, adapter: Path | None = None) -> torch.nn.Module:
    """transformers' model of ``directory`` loaded in the target's dtype onto its device (with a PEFT ``adapter``)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=target.dtype).to(target.device)
    if adapter is not None:
        import peft  # only the adapter check needs it (and skips without it)

        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()


def transformers_greedy(model: torch.nn.Module, prompts: list[list[int]], target: Target) -> list[list[int]]:
    """generate() on a left-padded batch of ``prompts`` on the target: each row's new tokens up to EOS."""
    width = max(map(len, prompts))
    ids = target.tensor([[EOS] * (width - len(p)) + p for p in prompts])
    mask = target.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    _, kwargs = decoding("greedy")
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=EOS, **kwargs)
    return [strip(seq, width, EOS) for seq in out.tolist()]


def transformers_logits(directory: Path, target: Target, ids: list[list[int]],
                        adapter: Path | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """transformers' logits of ``ids`` on the target and on the CPU in float32, and the tolerance they give
    (tests.cuda.conftest.measured_tolerance)."""
    cpu = Target("cpu", torch.float32)
    with torch.inference_mode():
        logits = transformers_on(directory, target, adapter)(input_ids=target.tensor(ids)).logits
        exact = transformers_on(directory, cpu, adapter)(input_ids=torch.tensor(ids)).logits
    return logits, exact, measured_tolerance(target, logits, exact)


@functools.cache
def reference(directory: Path, target: Target) -> tuple[torch.Tensor, torch.Tensor, float]:
    """transformers_logits of IDS, once per directory and target (for the logits and the greedy checks)."""
    return transformers_logits(directory, target, IDS)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("target", targets())
def test_logits_equal_transformers_on_the_target(target, variant, directory):
    path = directory(variant)
    ours = ours_on(path, target)
    assert {(p.device.type, p.dtype) for p in ours.parameters()} == {(target.device, target.dtype)}
    with torch.inference_mode():
        got = ours(target.tensor(IDS))
    want, exact, tol = reference(path, target)
    assert_close(got, want, tol, f"{variant} logits vs transformers in {target.dtype_name}")
    assert_close(got, exact, tol, f"{variant} logits vs transformers in float32 on the CPU")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("target", targets())
def test_greedy_on_a_left_padded_batch_equals_generate_on_the_target(target, variant, directory):
    path = directory(variant)
    ours = ours_on(path, target)
    config, _ = decoding("greedy")
    got = best_tokens(generate_causal(ours, PROMPTS, config))
    want = transformers_greedy(transformers_on(path, target), PROMPTS, target)
    tol = reference(path, target)[2]  # the ties of this model in this dtype on this device
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        assert_same_tokens(target, g, w, EOS, causal_logits_at(ours, prompt), tol)
    if target.exact:  # the CPU's tokens (tests/model/test_hf_decoders.py): outputs reach past three windows
        assert max(len(p) + len(w) for p, w in zip(PROMPTS, want, strict=True)) > 3 * WINDOW


@pytest.mark.parametrize("target", targets())
def test_peft_adapters_mixed_per_row_equal_peft_model_on_the_target(target, directory, tmp_path):
    """Adapters loaded into our model already on the target (as the service loads an upload), against PeftModel
    on the target; each row with its own adapter or none, in a forward and in greedy decoding."""
    pytest.importorskip("peft")
    path = directory("llama-gqa")
    adapters = {name: peft_adapter(transformers_on(path, Target("cpu", torch.float32)), tmp_path / name, seed=i,
                                   **fields) for i, (name, fields) in enumerate(MIXED.items())}
    ours = ours_on(path, target)
    for name, adapter in adapters.items():
        load_adapter(ours, adapter, name, layout=LLAMA_LAYOUT)
    first, second = MIXED
    rows = [first, None, second, second]
    ids = IDS + IDS[::-1]
    with torch.inference_mode():
        with use_adapters(ours, rows):
            got = ours(target.tensor(ids))
        base = ours(target.tensor(ids))
    tols = {}
    for i, name in enumerate(rows):
        want, exact, tols[name] = transformers_logits(path, target, ids[i: i + 1], adapters.get(name))
        assert_close(got[i], want[0], tols[name], f"row {i} ({name}) vs PeftModel")
        assert_close(got[i], exact[0], tols[name], f"row {i} ({name}) vs PeftModel in float32 on the CPU")
        if name is not None:  # the adapter changes the logits well beyond the tolerance
            assert relative_error(base[i], want[0]) > 2 * tols[name]

    chosen = [second, None, first]  # each prompt decoded with its own adapter
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    config, _ = decoding("greedy")
    mine = best_tokens(generate_causal(ours, prompts, config, adapters=chosen))
    for prompt, name, got_tokens in zip(prompts, chosen, mine, strict=True):
        want_tokens = transformers_greedy(transformers_on(path, target, adapters.get(name)), [prompt], target)[0]
        with use_adapters(ours, name):
            assert_same_tokens(target, got_tokens, want_tokens, EOS, causal_logits_at(ours, prompt), tols[name])
    if target.exact:
        assert len({tuple(t) for t in mine}) == 3  # the adapters change the tokens
