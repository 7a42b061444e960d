"""PEFT LoRA adapters on Llama-family bases (model/hf/llama_adapters.py), built and saved by `peft` itself.

A random Llama with grouped-query attention (tests/model/test_hf_llama.py's helpers) and adapters with random
non-zero A and B (tests.hf_compare.peft_adapter) on every projection, suffixes and a regex, rank-stabilised ones,
a LoRA on lm_head (PEFT saves the head's own weight beside it) and modules_to_save lm_head and embed_tokens (the
adapter's own copies, on an untied and a tied head); Mistral (past its sliding window), Qwen2 (q/k/v biases), Qwen3
(q/k norms) and Gemma 3 (its scaled embeddings copied) of tests/model/test_hf_decoders.py; a Phi-3's fused qkv_proj
and gate_up_proj (B's rows split into ours, q, k and v of different widths): our logits equal PeftModel's in
float32; our export (save_adapter with the layout; a fused module's parts back as one LoRA of rank k r) loads in
PEFT with the same logits; two adapters and the base mixed per row in one forward and in greedy decoding give each
row what PeftModel gives it alone. Refused by name: LoRA on embed_tokens, other modules_to_save, biases other than
"none", DoRA, a head weight saved for another base.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from model.generation import GenerationConfig, generate_causal
from model.hf import IMPORTERS, load_hf_model
from model.lora import AdapterError, LoRAConfig, adapter_names, add_adapter, layers_with, merge_adapter, use_adapters
from model.lora_io import AdapterLayout, check_adapter, load_adapter, save_adapter
from model.lora_layers import HeadCopies
from tests.hf_compare import ATOL, peft_adapter
from tests.model.test_hf_decoders import save
from tests.model.test_hf_llama import EOS, PROMPTS, hf_model, save_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ADAPTERS = {  # name -> (base: BASES' key, PEFT LoraConfig fields)
    "every-projection": ("llama", dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=EVERY)),  # eval: no dropout
    "mlp-rslora": ("llama", dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj",
                                                                                   "down_proj"])),
    "suffixes": ("llama", dict(r=3, lora_alpha=3, target_modules=["self_attn.k_proj", "mlp.up_proj", "o_proj"])),
    "regex-one-layer": ("llama", dict(r=2, lora_alpha=4,
                                      target_modules=r"model\.layers\.1\.(self_attn\.v_proj|mlp\.up_proj)")),
    "lm_head-lora": ("llama", dict(r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"])),
    "modules_to_save": ("llama", dict(r=2, lora_alpha=4, target_modules=["v_proj", "up_proj"],
                                      modules_to_save=["lm_head", "embed_tokens"])),
    "tied-lm_head-copy": ("llama-tied", dict(r=2, lora_alpha=4, target_modules=["q_proj"],
                                             modules_to_save=["lm_head"])),
    "mistral": ("mistral-window", dict(r=2, lora_alpha=4, target_modules=EVERY)),  # 21 positions, a window of 4
    "qwen2-biases": ("qwen2", dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])),
    "qwen3-q_k_norms": ("qwen3-bias-window-head_dim-12", dict(r=2, lora_alpha=4, target_modules=EVERY,
                                                             modules_to_save=["lm_head"])),
    "gemma3-tied-embedding-copy": ("gemma3", dict(r=2, lora_alpha=4, target_modules=EVERY,
                                                  modules_to_save=["embed_tokens"])),  # scaled by sqrt(hidden)
    "phi3-fused": ("phi3", dict(r=2, lora_alpha=4, target_modules=PHI3_FUSED)),  # q, k, v rows of unequal widths
    "phi3-qkv-rslora": ("phi3", dict(r=3, lora_alpha=4, use_rslora=True, target_modules=["qkv_proj"])),
    "phi3-gate_up-lm_head": ("phi3", dict(r=2, lora_alpha=4, target_modules=["gate_up_proj", "lm_head"],
                                          modules_to_save=["embed_tokens"])),
}
IDS = torch.tensor([PROMPTS[1] * 3, PROMPTS[3] * 4 + [9]])  # two rows of 21 positions


def llama(directory: Path, tied: bool = False) -> Path:
    return save_llama(directory, seed=4, num_key_value_heads=2, tie_word_embeddings=tied)


def decoder(variant: str) -> Callable[[Path], Path]:
    """A builder of test_hf_decoders' random ``variant`` (grouped-query attention, 2 KV heads of 4)."""
    return lambda directory: save(directory, variant, seed=4)


BASES = {"llama": llama, "llama-tied": lambda d: llama(d, tied=True),
         **{v: decoder(v) for v in ("mistral-window", "qwen2", "qwen3-bias-window-head_dim-12", "phi3", "gemma3")}}


def imported(directory: Path) -> tuple[nn.Module, AdapterLayout]:
    """Our model of HF ``directory`` (float32) and its importer's ADAPTER_LAYOUT (what load_hf_checkpoint gives it;
    tests/service and tests/training load Llama directories with their tokenizers that way)."""
    model_type = json.loads((directory / "config.json").read_text())["model_type"]
    return load_hf_model(directory)[0], importlib.import_module(IMPORTERS[model_type]).ADAPTER_LAYOUT


def ours_with(directory: Path, adapters: dict[str, Path]) -> nn.Module:
    """Our model of ``directory`` (float32) with ``adapters`` loaded by name."""
    model, layout = imported(directory)
    for name, path in adapters.items():
        load_adapter(model, path, name, layout=layout)
    return model


def peft_model(directory: Path, adapter: Path | None) -> nn.Module:
    base = hf_model(directory)
    return base if adapter is None else peft.PeftModel.from_pretrained(base, adapter).eval()


def peft_logits(directory: Path, adapter: Path | None, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return peft_model(directory, adapter)(input_ids=ids).logits


def ours_logits(model: nn.Module, adapters, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad(), use_adapters(model, adapters):
        return model(ids)


@pytest.mark.parametrize(("base", "fields"), ADAPTERS.values(), ids=ADAPTERS.keys())
def test_llama_adapters_give_peft_logits_and_export_back_to_peft(tmp_path, base, fields):
    directory = BASES[base](tmp_path / base)
    adapter = peft_adapter(hf_model(directory), tmp_path / "adapter", seed=1, **fields)
    ours, layout = imported(directory)
    load_adapter(ours, adapter, "a", layout=layout)
    saved = load_file(adapter / "adapter_model.safetensors")
    fused = {"qkv_proj": 3, "gate_up_proj": 2}  # our Linears per PEFT LoRA
    assert len(layers_with(ours, "a")) == sum(fused.get(k.split(".lora_A")[0].rpartition(".")[2], 1)
                                              for k in saved if k.endswith("lora_A.weight"))
    expected = peft_logits(directory, adapter)
    assert (ours_logits(ours, "a") - expected).abs().max() < ATOL
    assert (peft_logits(directory, None) - expected).abs().max() > 0.1  # the adapter changes them
    assert (ours_logits(ours, None) - peft_logits(directory, None)).abs().max() < ATOL  # the base's, unselected

    save_adapter(ours, "a", tmp_path / "exported", layout=layout)
    exported = peft_model(directory, tmp_path / "exported")
    loaded = peft.get_peft_model_state_dict(exported)
    # the tensors PEFT made, less the head's own weight it saves beside a LoRA on lm_head
    assert sorted(k for k in loaded if ".base_layer." not in k) == sorted(k for k in saved if ".base_layer." not in k)
    with torch.no_grad():
        assert (exported(input_ids=IDS).logits - expected).abs().max() < ATOL


def test_llama_adapters_mixed_per_row_give_each_row_its_own_in_a_forward_and_in_greedy_decoding(tmp_path):
    directory = llama(tmp_path / "llama")
    names = ["every-projection", "modules_to_save"]
    adapters = {n: peft_adapter(hf_model(directory), tmp_path / n, seed=i, **ADAPTERS[n][1])
                for i, n in enumerate(names)}
    ours = ours_with(directory, adapters)
    assert isinstance(ours.lm_head, HeadCopies) and isinstance(ours.embed.tokens, HeadCopies)
    rows = [names[0], None, names[1], names[1]]
    ids = torch.cat([IDS, IDS.flip(0)])
    got = ours_logits(ours, rows, ids)
    for i, name in enumerate(rows):
        expected = peft_logits(directory, adapters.get(name), ids[i: i + 1])[0]
        assert (got[i] - expected).abs().max() < ATOL, (i, name)

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]  # each decoded with its own adapter, lengths differ
    chosen = [names[1], None, names[0]]
    config = GenerationConfig(strategy="greedy", max_new_tokens=10)
    mine = [h[0].tokens for h in generate_causal(ours, prompts, config, adapters=chosen)]
    wanted = []
    for prompt, name in zip(prompts, chosen, strict=True):
        with torch.no_grad():
            out = peft_model(directory, adapters.get(name)).generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=EOS)
        new = out[0, len(prompt):].tolist()
        wanted.append(new[: new.index(EOS)] if EOS in new else new)
    assert mine == wanted
    assert len({json.dumps(w) for w in wanted}) == 3  # the adapters change the tokens


def base_weight_of_another_model(adapter: Path) -> None:
    """Rewrite a lm_head LoRA's saved head weight as another base's would be."""
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.lm_head.base_layer.weight"] = tensors["base_model.model.lm_head.base_layer.weight"] + 1
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (dict(target_modules=["q_proj", "embed_tokens"]), "LoRA on embed_tokens is not supported"),
        (dict(target_modules=r".*(q_proj|embed_tokens)"),
         r"tensor 'base_model\.model\.model\.embed_tokens\.[a-z_.A-Z]+': LoRA on embed_tokens is not supported"),
        (dict(target_modules=["q_proj"], modules_to_save=["norm"]),
         r"modules_to_save \['norm'\] is not supported for Llama \(supported: lm_head, embed_tokens\)"),
        (dict(target_modules=["q_proj"], bias="all"), "bias='all'"),
        (dict(target_modules=["q_proj"], use_dora=True), r"unsupported PEFT options \{'use_dora': True\}"),
        (dict(target_modules=["q_proj", "lm_head"]), "'base_model.model.lm_head.base_layer.weight' holds weights of "
                                                    "'lm_head' other than the model's"),
    ],
    ids=["embed_tokens", "embed_tokens-regex", "modules_to_save", "bias", "dora", "another-base"],
)
def test_what_we_cannot_adapt_on_llama_is_refused_by_name(tmp_path, fields, says):
    directory = llama(tmp_path / "llama")
    adapter = peft_adapter(hf_model(directory), tmp_path / "adapter", seed=2, r=2, lora_alpha=4, **fields)
    if says.startswith("'base_model.model.lm_head.base_layer"):
        base_weight_of_another_model(adapter)
    ours, layout = imported(directory)
    with pytest.raises(AdapterError, match=says):
        check_adapter(ours, adapter, "a", layout)
    with pytest.raises(AdapterError, match=says):
        load_adapter(ours, adapter, "a", layout=layout)
    assert adapter_names(ours) == []


def test_a_lora_on_a_tied_lm_head_runs_unmerged_and_an_untied_one_merges(tmp_path):
    """Merging into a head tied to the embeddings would change the embeddings too: refused by name, nothing
    merged; on an untied head the merged adapter gives the unmerged logits."""
    for tied in (True, False):
        directory = llama(tmp_path / f"llama-{tied}", tied)
        adapter = peft_adapter(hf_model(directory), tmp_path / f"adapter-{tied}", seed=3, r=2, lora_alpha=4,
                               target_modules=["q_proj", "lm_head"])
        ours = ours_with(directory, {"a": adapter})
        expected = ours_logits(ours, "a")
        if tied:
            with pytest.raises(AdapterError, match=r"cannot merge 'a': lm_head's weight is also embed\.tokens\.weight"):
                merge_adapter(ours, "a")
        else:
            merge_adapter(ours, "a")
        assert all(layer.merged == (None if tied else "a") for layer in layers_with(ours, "a").values())
        assert (ours_logits(ours, "a") - expected).abs().max() < ATOL


@pytest.mark.parametrize("base", ["llama", "phi3"])
def test_our_adapter_on_some_projections_exports_to_peft_with_our_logits(tmp_path, base):
    """q, v, the gate and down but not k nor up: on Phi-3, qkv_proj's and gate_up_proj's LoRAs get zero blocks."""
    directory = BASES[base](tmp_path / base)
    ours, layout = imported(directory)
    add_adapter(ours, "mine", LoRAConfig(r=2, lora_alpha=4, target_modules=("q_proj", "v_proj", "fc1", "fc2")), seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in layers_with(ours, "mine").values():
            layer.lora_B["mine"].weight.copy_(0.3 * torch.randn(layer.lora_B["mine"].weight.shape, generator=g))
    save_adapter(ours, "mine", tmp_path / "exported", layout=layout)
    expected = ours_logits(ours, "mine")
    assert (peft_logits(directory, tmp_path / "exported") - expected).abs().max() < ATOL
    assert (peft_logits(directory, None) - expected).abs().max() > 0.1
