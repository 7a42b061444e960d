"""Loading holds the weights once: the tensors read become the model's (no randomly initialised copy beside them,
no mapping of the file), ties stay one Parameter, computed buffers are real, and the first step's packed copies
are the only other copy."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.build import build_empty, load_into
from model.checkpoint import load_checkpoint, save_checkpoint
from model.hf import load_hf_model
from model.hf.common import all_finite, read_safetensors
from model.tokenizer import Tokenizer
from tests.model.conftest import tiny_causal_lm, tiny_classifier, tiny_seq2seq

transformers = pytest.importorskip("transformers")



def test_read_safetensors_reads_every_dtype_into_memory_of_its_own(tmp_path):
    tensors = {"f64": torch.randn(3, 2, dtype=torch.float64), "f32": torch.randn(5), "f16": torch.randn(4).half(),
               "bf16": torch.randn(2, 3).bfloat16(), "i64": torch.arange(1, 4), "bool": torch.tensor([True, False]),
               "i8": torch.tensor([-1, 2], dtype=torch.int8), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    read = read_safetensors(path)
    expected = {name: tensor.clone() for name, tensor in load_file(str(path)).items()}
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    data = 8 + int.from_bytes(path.read_bytes()[:8], "little")  # where the tensors' bytes begin
    with open(path, "r+b") as f:  # rewritten in place, zeros: a tensor mapped from the file would change with it
        f.seek(data)
        f.write(bytes(path.stat().st_size - data))
    for name, tensor in expected.items():
        assert torch.equal(read[name], tensor), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_finds_any_nan_or_infinity_without_a_mask(dtype):
    t = torch.randn(4, 5).to(dtype)
    assert all_finite(t) and all_finite(t[:0]) and all_finite(t[0, 0])
    for value, allowed_as_bias in ((float("nan"), False), (float("inf"), False), (float("-inf"), True)):
        bad = t.clone()
        bad[2, 3] = value
        assert not all_finite(bad) and all_finite(bad, minus_inf=True) == allowed_as_bias, value


def _groups(model: torch.nn.Module) -> list[list[str]]:
    """The names of each Parameter object, in order: which parameters are tied."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return list(names.values())


@pytest.mark.parametrize("make", [tiny_causal_lm, lambda **size: tiny_causal_lm(tie_embeddings=False, **size),
                                  tiny_seq2seq, tiny_classifier])
def test_a_loaded_checkpoint_holds_the_saved_tensors_ties_and_computed_buffers(tmp_path, make):
    model = make(vocab_size=300)
    labels = ["a", "b", "c"] if model.config.family == "classifier" else None
    tokenizer = Tokenizer.train(["hello world", "the cat sat"] * 5, vocab_size=300)
    save_checkpoint(tmp_path / "ckpt", model, tokenizer, labels=labels)
    loaded = load_checkpoint(tmp_path / "ckpt", device="cpu").model
    assert _groups(loaded) == _groups(model)
    everything = [*loaded.named_parameters(remove_duplicate=False), *loaded.named_buffers(remove_duplicate=False)]
    original = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    assert sorted(name for name, _ in everything) == sorted(original)
    assert any("sinusoids" in name for name in original)  # a buffer the file does not hold: computed, not left empty
    for name, tensor in everything:
        assert not tensor.is_meta and torch.equal(tensor, original[name]), name


def test_a_tensor_given_for_two_untied_parameters_becomes_two():
    model = build_empty(tiny_causal_lm(tie_embeddings=False).config)
    state = dict(tiny_causal_lm(tie_embeddings=False).state_dict())
    state["lm_head.weight"] = state["embed.tokens.weight"]
    load_into(model, state)
    assert torch.equal(model.lm_head.weight, model.embed.tokens.weight)
    assert model.lm_head.weight.data_ptr() != model.embed.tokens.weight.data_ptr()  # one update would change both


def _qwen2_directory(directory: Path) -> int:
    """A Qwen2-shaped HF directory (tied embeddings, q/k/v biases) of about 50 MB of float32 weights, written
    without building it; returns the weights' bytes."""
    config = transformers.Qwen2Config(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      max_position_embeddings=128)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.Qwen2ForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {k: 0.02 * torch.randn(shape, generator=generator) for k, shape in shapes.items()
               if k != "lm_head.weight"}
    save_file(tensors, str(directory / "model.safetensors"))
    config.save_pretrained(directory)
    return sum(t.nbytes for t in tensors.values())


# Run in a fresh interpreter: memory a test before freed stays with the allocator and would hide a peak. Prints the
# peak resident set over the one before loading (bytes), after loading, then after a first generate.
MEASURE = """
import sys
from pathlib import Path
from model.checkpoint import load_checkpoint
from model.generation import GenerationConfig, generate_causal
from model.hf import load_hf_model

def status(field):
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024

source, directory = sys.argv[1], Path(sys.argv[2])
Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM)
before = status("VmRSS")
model = load_hf_model(directory)[0] if source == "hf" else load_checkpoint(directory, device="cpu").model
assert model.lm_head.weight is model.embed.tokens.weight
loaded = status("VmHWM") - before
generate_causal(model, [[5, 6, 7]], GenerationConfig(strategy="greedy", max_new_tokens=2))
print(loaded, status("VmHWM") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc (peak RSS reset)")
@pytest.mark.parametrize("source", ["hf", "checkpoint"])
def test_loading_and_the_first_step_hold_the_weights_once_and_their_packed_copy(tmp_path, source):
    """The peak resident set while loading: the weights and little more (a random model beside the tensors read,
    or the file mapped beside them, made it 2-3x); with the first generate's packed copies (model/packed_weights),
    twice (a padded copy beside each while packing, and what the allocator kept of them, made it near three)."""
    weights = _qwen2_directory(tmp_path)
    directory = tmp_path
    if source == "checkpoint":
        directory = save_checkpoint(tmp_path / "ckpt", load_hf_model(tmp_path)[0],
                                    Tokenizer.train(["hello world"] * 5, vocab_size=300))
    run = subprocess.run([sys.executable, "-c", MEASURE, source, str(directory)], capture_output=True, text=True,
                         cwd=Path(__file__).parents[2], check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded, served = (int(n) / weights for n in run.stdout.split())
    assert loaded < 1.5, f"loading peaked at {loaded:.2f}x the weights"
    assert served < 2.6, f"loading and a first generate peaked at {served:.2f}x the weights"
