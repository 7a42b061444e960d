"""Checkpoints, adapters and prompts for benchmarks/serve.py (and the tiny ones of benchmarks/soak.py).

Random weights decode exactly as fast as trained ones, so the default checkpoints are random, with a
real byte-level BPE trained on Python's standard library source; the adapters are random LoRA
weights (nonzero B) made with model.lora, labelled as such wherever the benchmark reports them.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import torch

from model.causal_lm import CausalLM
from model.checkpoint import load_checkpoint, load_config, save_checkpoint
from model.classifier import TransformerClassifier
from model.config import CausalLMConfig, ClassifierConfig, Seq2SeqConfig
from model.lora import LoRAConfig, add_adapter
from model.lora_io import save_adapter
from model.seq2seq import Seq2SeqTransformer
from model.tokenizer import Tokenizer

logger = logging.getLogger("benchmarks.serve")

SIZES = dict(vocab_size=8000, d_model=256, n_heads=4, d_ff=1024, dropout=0.0)
TINY_SIZES = dict(d_model=32, n_heads=4, d_ff=64, dropout=0.0)  # build_tiny_models: the soak's server
LABELS = ["negative", "neutral", "positive"]
NUM_ADAPTERS = 8
ADAPTER_RANK, ADAPTER_ALPHA, ADAPTER_STD = 8, 16.0, 0.02
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def stdlib_texts(limit_chars: int = 2_000_000) -> list[str]:
    """Python standard library source files, sorted by name, up to ``limit_chars`` characters."""
    texts, total = [], 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return texts


def build_models(directory: Path) -> tuple[str, str]:
    """Random-weight causal_lm ("bench-lm") and classifier ("bench-cls") with a real BPE; returns their names."""
    tokenizer = Tokenizer.train(stdlib_texts(), vocab_size=SIZES["vocab_size"])
    sizes = dict(SIZES, vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    lm = CausalLM(CausalLMConfig(**sizes, n_layers=4, max_len=256)).eval()
    save_checkpoint(directory / "bench-lm", lm, tokenizer)
    cls = TransformerClassifier(ClassifierConfig(**sizes, n_layers=4, max_len=128, num_labels=len(LABELS),
                                                 cls_id=tokenizer.cls_id)).eval()
    save_checkpoint(directory / "bench-cls", cls, tokenizer, labels=LABELS)
    return "bench-lm", "bench-cls"


def randomize_adapter(model: torch.nn.Module, name: str, seed: int) -> None:
    """Add LoRA adapter ``name`` to ``model`` with PEFT's init of A and a random nonzero B (not trained)."""
    config = LoRAConfig(r=ADAPTER_RANK, lora_alpha=ADAPTER_ALPHA, target_modules=ADAPTER_TARGETS)
    add_adapter(model, name, config, seed=seed)
    generator = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_B") and name in module.lora_B:
                weight = module.lora_B[name].weight
                weight.copy_(torch.randn(weight.shape, generator=generator) * ADAPTER_STD)


def random_adapters(model_dir: Path, out_root: Path, count: int) -> list[str]:
    """``count`` LoRA adapters with random nonzero B for the checkpoint in ``model_dir`` (not trained)."""
    ckpt = load_checkpoint(model_dir, device="cpu")
    names = []
    for i in range(count):
        name = f"rand-{i}"
        randomize_adapter(ckpt.model, name, i)
        save_adapter(ckpt.model, name, out_root / model_dir.name / name, base_model_name_or_path=model_dir.name)
        names.append(name)
    return names


def build_tiny_models(directory: Path) -> tuple[Path, Path]:
    """Random-weight tiny-lm (causal_lm), tiny-mt (seq2seq) and tiny-cls (classifier) of d_model 32, 2 layers (the
    test suite's shapes), with a BPE over some stdlib source, and one random LoRA adapter each (lm-a, mt-a, cls-a).
    Returns (models_dir, adapters_dir)."""
    models, adapters = directory / "models", directory / "adapters"
    tokenizer = Tokenizer.train(stdlib_texts(200_000), vocab_size=300)
    sizes = dict(TINY_SIZES, vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    built = {
        "tiny-lm": (CausalLM(CausalLMConfig(**sizes, n_layers=2, max_len=128)), {}),
        "tiny-mt": (Seq2SeqTransformer(Seq2SeqConfig(**sizes, n_encoder_layers=2, n_decoder_layers=2, max_len=64,
                                                     max_src_len=64)), {}),
        "tiny-cls": (TransformerClassifier(ClassifierConfig(**sizes, n_layers=2, max_len=128, num_labels=len(LABELS),
                                                            cls_id=tokenizer.cls_id)), {"labels": LABELS}),
    }
    for seed, (name, (model, extra)) in enumerate(built.items()):
        save_checkpoint(models / name, model.eval(), tokenizer, **extra)
        adapter = f"{name.removeprefix('tiny-')}-a"
        randomize_adapter(model, adapter, seed)
        save_adapter(model, adapter, adapters / name / adapter, base_model_name_or_path=name)
    return models, adapters


def find_models(directory: Path) -> tuple[str | None, str | None]:
    """(generator, classifier) checkpoint names in ``directory``: first causal_lm (else seq2seq), first classifier."""
    families: dict[str, list[str]] = {}
    for path in sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            families.setdefault(load_config(path).family, []).append(path.name)
        except Exception as exc:  # not a checkpoint: say so and go on
            logger.warning("skipping %s: %s", path, exc)
    generator = (families.get("causal_lm") or families.get("seq2seq") or [None])[0]
    return generator, (families.get("classifier") or [None])[0]


def prompts_from(texts: list[str], count: int = 256, seed: int = 0) -> list[str]:
    """Realistic prompts: runs of 2-3 consecutive non-blank source lines (~20-40 tokens)."""
    lines = [line.strip() for text in texts for line in text.splitlines() if 20 <= len(line.strip()) <= 80]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        i = rng.randrange(len(lines) - 3)
        out.append(" ".join(lines[i: i + rng.choice((2, 3))]))
    return out


def prepare_adapters(given: Path | None, models_dir: Path, models: list[str | None], work: Path) -> tuple[Path, str]:
    """The adapters directory for the servers: --adapters if it has 8 per model, else random ones."""
    if given is not None:
        if all(m is None or len([p for p in (given / m).glob("*") if p.is_dir()]) >= NUM_ADAPTERS
               for m in models):
            return given, f"trained adapters from {given}"
        logger.warning("%s does not hold %d adapters per model: using random ones", given, NUM_ADAPTERS)
    root = work / "adapters"
    for model in models:
        if model is not None:
            random_adapters(models_dir / model, root, NUM_ADAPTERS)
    note = (f"RANDOM LoRA adapters made for this benchmark (not trained): {NUM_ADAPTERS} per model, rank "
            f"{ADAPTER_RANK}, alpha {ADAPTER_ALPHA:g}, on {'/'.join(ADAPTER_TARGETS)}, A PEFT's init, "
            f"B ~ N(0, {ADAPTER_STD}^2) (model.lora.add_adapter + save_adapter)")
    return root, note
