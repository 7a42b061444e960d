"""Tiny checkpoints of all three families and one LoRA adapter each, built once per test session.

Fixtures for the engine tests and the HTTP tests (``from tests.service.conftest import ...`` or just
use the fixtures):

- ``models_dir``: ``<tmp>/models/{tiny-lm, tiny-mt, tiny-cls}/`` (causal_lm, seq2seq, classifier),
  each a checkpoint directory written by ``model.checkpoint.save_checkpoint``;
- ``adapters_dir``: ``<tmp>/adapters/<model>/<adapter>/`` with ``lm-a``, ``mt-a``, ``cls-a``
  (PEFT layout written by ``model.lora.save_adapter``, rank 4, alpha 8).

Why not the training CLI (``python -m training train`` / ``lora``, which exist now): timed on this
2-core machine, training the three tiny models plus one adapter each took ~80 s in-process (the
seq2seq runs alone ~65 s: validation decodes for BLEU), far over the ~60 s budget of the service
tests, and an adapter trained for seconds from B = 0 barely moves the outputs, while the hot-swap
and mixed-adapter tests need versions whose outputs differ. So the models are seeded random
weights (the generators' output projection favours printable ASCII tokens, with logits spread over
several nats so greedy decoding is far from float-rounding ties) and the adapters have random
nonzero B. TODO(training CLI): switch once a sub-second tiny-training path exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from model.causal_lm import CausalLM
from model.checkpoint import load_checkpoint, save_checkpoint
from model.classifier import TransformerClassifier
from model.config import CausalLMConfig, ClassifierConfig, Seq2SeqConfig
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq, stop_strings, trim_stop
from model.lora import LoRAConfig, add_adapter, load_adapter, save_adapter
from model.seq2seq import Seq2SeqTransformer
from model.tokenizer import Tokenizer
from service.engine import Engine
from service.types import Candidate, EngineSettings, GenerateOutput, GenerateParams

LM, MT, CLS = "tiny-lm", "tiny-mt", "tiny-cls"
ADAPTERS = {LM: "lm-a", MT: "mt-a", CLS: "cls-a"}
LABELS = ["negative", "neutral", "positive"]
VOCAB = 300
TINY = dict(vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, dropout=0.0, max_len=128)

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a journey of a thousand miles begins with a single step",
    "to be or not to be, that is the question",
    "all that glitters is not gold",
    "the cat sat on the mat and the dog sat on the log",
    "hello world, hello there, hello again",
    "def main(): return 0",
    "le chat est sur la table",
    "der Hund schläft im Garten",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols %s {name} !?",
] * 4


def build_tokenizer() -> Tokenizer:
    return Tokenizer.train(TEXTS, vocab_size=VOCAB, min_frequency=2)


def build_model(family: str, tokenizer: Tokenizer, seed: int = 0) -> torch.nn.Module:
    """A seeded random model; generators get an untied output projection that only favours printable
    ASCII tokens (and EOS), with logits spread over several nats so greedy is far from ties."""
    torch.manual_seed(seed)
    generative = dict(TINY, tie_embeddings=False)
    if family == "causal_lm":
        model = CausalLM(CausalLMConfig(**generative, n_layers=2))
    elif family == "seq2seq":
        model = Seq2SeqTransformer(Seq2SeqConfig(**generative, n_encoder_layers=2, n_decoder_layers=2,
                                                 max_src_len=64))
    else:
        return TransformerClassifier(ClassifierConfig(**TINY, n_layers=2, num_labels=len(LABELS))).eval()
    printable = [i for i in range(7, tokenizer.vocab_size)  # ids 0..6 are the special tokens
                 if (s := tokenizer.decode([i])).isascii() and s.isprintable()]
    with torch.no_grad():
        weight = torch.zeros_like(model.lm_head.weight)
        weight[printable] = torch.randn(len(printable), weight.shape[1]) * 0.6
        weight[tokenizer.eos_id] = torch.randn(weight.shape[1]) * 0.9
        model.lm_head.weight.copy_(weight)
    return model.eval()


def make_adapter(model_dir: Path, out_dir: Path, seed: int, scale: float = 0.5, rank: int = 4,
                 targets: tuple[str, ...] = ("q_proj", "v_proj", "out_proj", "fc1")) -> Path:
    """Write a LoRA adapter for the checkpoint in ``model_dir`` with random nonzero A and B."""
    ckpt = load_checkpoint(model_dir, device="cpu")
    add_adapter(ckpt.model, "x", LoRAConfig(r=rank, lora_alpha=2.0 * rank, target_modules=targets), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in ckpt.model.modules():
            if hasattr(module, "lora_B") and "x" in module.lora_B:
                b = module.lora_B["x"].weight
                b.copy_(torch.randn(b.shape, generator=generator) * scale)
    save_adapter(ckpt.model, "x", out_dir, base_model_name_or_path=model_dir.name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tserve")
    tokenizer = build_tokenizer()
    for name, family in ((LM, "causal_lm"), (MT, "seq2seq"), (CLS, "classifier")):
        labels = LABELS if family == "classifier" else None
        save_checkpoint(root / "models" / name, build_model(family, tokenizer), tokenizer, labels=labels)
        make_adapter(root / "models" / name, root / "adapters" / name / ADAPTERS[name], seed=1)
    return root


@pytest.fixture(scope="session")
def models_dir(tiny_root: Path) -> Path:
    return tiny_root / "models"


@pytest.fixture(scope="session")
def adapters_dir(tiny_root: Path) -> Path:
    return tiny_root / "adapters"


# ---- helpers for the engine tests ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_engine(models_dir: Path, adapters_dir: Path | None, **settings) -> AsyncIterator[Engine]:
    """A started Engine on CPU (no warm-up unless asked), stopped on exit."""
    settings = {"device": "cpu", "warmup": False, **settings}
    engine = Engine(EngineSettings(**settings), models_dir, adapters_dir)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop(drain_timeout_s=5.0)


def offline(model_dir: Path, texts: list[str], params: GenerateParams, adapter_dir: Path | None = None
            ) -> list[GenerateOutput]:
    """Each text generated alone by model.generation's offline functions (the engine's reference)."""
    ckpt = load_checkpoint(model_dir, device="cpu")
    if adapter_dir is not None:
        load_adapter(ckpt.model, adapter_dir, "ref")
    config = GenerationConfig(
        strategy=params.strategy, max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
        num_beams=params.num_beams if params.strategy == "beam" else 1, length_penalty=params.length_penalty,
        num_return_sequences=params.num_return_sequences, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, seed=params.seed, eos_token_id=ckpt.config.eos_id)
    adapters = "ref" if adapter_dir is not None else None
    outputs = []
    for text in texts:
        if ckpt.family == "causal_lm":
            stop_fn = stop_strings(ckpt.tokenizer, params.stop)
            ids = ckpt.tokenizer.encode(text, add_bos=True)
            hyps = generate_causal(ckpt.model, [ids], config, adapters=adapters, stop_fn=stop_fn)[0]
        else:
            hyps = generate_seq2seq(ckpt.model, [ckpt.src_tokenizer.encode(text, add_eos=True)], config,
                                    adapters=adapters)[0]
        candidates = [Candidate(trim_stop(ckpt.tokenizer.decode(h.tokens), params.stop), h.tokens, h.score,
                                h.finish_reason) for h in hyps]
        best = candidates[0]
        outputs.append(GenerateOutput(best.text, best.tokens, best.score, best.finish_reason, candidates))
    return outputs


def assert_same(got: list[GenerateOutput], want: list[GenerateOutput]) -> None:
    """Same texts, tokens and finish reasons; scores equal up to float rounding."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert [(c.text, c.tokens, c.finish_reason) for c in g.candidates] == \
            [(c.text, c.tokens, c.finish_reason) for c in w.candidates]
        assert [c.score for c in g.candidates] == pytest.approx([c.score for c in w.candidates], abs=1e-4)
        assert (g.text, g.tokens, g.finish_reason) == (w.text, w.tokens, w.finish_reason)


def histogram_count(engine: Engine, name: str, labels: dict[str, str], le: str | None = None) -> float:
    """A histogram's _count (or one bucket's cumulative count) from the engine's registry."""
    suffix = "_count" if le is None else "_bucket"
    labels = dict(labels, **({"le": le} if le is not None else {}))
    return engine.metrics.registry.get_sample_value(name + suffix, labels) or 0.0
