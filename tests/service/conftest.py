"""Tiny checkpoints of all three families and one LoRA adapter each, trained once per test session.

Fixtures for the engine tests and the HTTP tests (``from tests.service.conftest import ...`` or just
use the fixtures):

- ``models_dir``: ``<tmp>/models/{tiny-lm, tiny-mt, tiny-cls}/`` (causal_lm, seq2seq, classifier),
  each a checkpoint directory written by ``python -m training train`` on tiny data;
- ``adapters_dir``: ``<tmp>/adapters/<model>/<adapter>/`` with ``lm-a``, ``mt-a``, ``cls-a``
  (PEFT layout, rank 4, alpha 8), trained by ``python -m training lora``.

tests/service/fixtures.py writes the data and runs the training commands in-process; its
``make_adapter(model_dir, out_dir, seed)`` trains further adapters (one task per seed).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from model.checkpoint import checkpoint_vocabulary_map, load_checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_causal, generate_seq2seq, stop_strings, trim_stop
from model.lora_io import load_adapter
from service.api.convert import generation_request
from service.api.schemas import DEFAULT_NEW_TOKENS, GenerateRequest
from service.engine.engine import Engine
from service.engine.jobs import continuation, token_logprobs
from service.engine.requests import DECODING_FIELDS, GenerationRequest
from service.engine.types import EngineSettings, GeneratedSequence, GenerationOutput
from tests.service.fixtures import (
    ADAPTERS,
    CLS,
    LABELS,
    LM,
    MT,
    TEXTS,
    build_models,
    make_adapter,
    train_placeholder_translator,
)

__all__ = ["ADAPTERS", "CLS", "LABELS", "LM", "MT", "TEXTS", "make_adapter"]

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tserve")
    start = time.perf_counter()
    build_models(root)
    logger.info("tiny models and adapters trained in %.1f s", time.perf_counter() - start)
    return root


@pytest.fixture(scope="session")
def models_dir(tiny_root: Path) -> Path:
    return tiny_root / "models"


@pytest.fixture(scope="session")
def adapters_dir(tiny_root: Path) -> Path:
    return tiny_root / "adapters"


@pytest.fixture(scope="session")
def placeholder_translator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny translator trained on commands carrying placeholders (protected pairs)."""
    return train_placeholder_translator(tmp_path_factory.mktemp("placeholders"))


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


def ask(*inputs: str, **fields: Any) -> GenerationRequest:
    """The engine's request for ``inputs`` with GenerateRequest ``fields``: validated and converted as the route
    does."""
    return generation_request(GenerateRequest(inputs=list(inputs), **fields))


def offline(model_dir: Path, texts: list[str], fields: dict[str, Any], adapter_dir: Path | None = None
            ) -> list[GenerationOutput]:
    """Each text generated alone by model.generation's offline functions (the engine's reference), decoding as
    a GenerateRequest with ``fields`` asks (a translator's vocabulary map applied unless use_vmap is false)."""
    ckpt = load_checkpoint(model_dir, device="cpu")
    if adapter_dir is not None:
        load_adapter(ckpt.model, adapter_dir, "ref")
    req = GenerateRequest(inputs=texts, **fields)
    decoding = {name: getattr(req, name) for name in DECODING_FIELDS}
    decoding["max_new_tokens"] = req.max_new_tokens or DEFAULT_NEW_TOKENS
    decoding["num_beams"] = req.num_beams if req.strategy == "beam" else 1
    config = GenerationConfig(**decoding, eos_token_id=ckpt.config.eos_id)
    adapters = "ref" if adapter_dir is not None else None
    outputs = []
    for i, text in enumerate(texts):
        target = ckpt.tokenizer.encode(req.target_prefix[i]) if req.target_prefix is not None else []
        if ckpt.family == "causal_lm":
            stop_fn = stop_strings(ckpt.tokenizer, req.stop)
            ids = ckpt.tokenizer.encode(text, add_bos=True)
            hyps = generate_causal(ckpt.model, [ids], config, adapters=adapters, stop_fn=stop_fn)[0]
        else:
            vocab_map = checkpoint_vocabulary_map(ckpt) if req.use_vmap is not False else None  # as served
            hyps = generate_seq2seq(ckpt.model, [ckpt.src_tokenizer.encode(text, add_eos=True)], config,
                                    adapters=adapters, targets=[target], vocab_map=vocab_map)[0]
        text_of = continuation(ckpt.tokenizer.decode, target)
        candidates = [GeneratedSequence(text=trim_stop(text_of(h.tokens), req.stop), tokens=h.tokens,
                                        score=h.score, finish_reason=h.finish_reason,
                                        logprobs=token_logprobs(h, ckpt.tokenizer.decode)) for h in hyps]
        outputs.append(GenerationOutput(**vars(candidates[0]), candidates=candidates))
    return outputs


def assert_same(got: list[GenerationOutput], want: list[GenerationOutput]) -> None:
    """Same texts, tokens and finish reasons; scores equal up to float rounding (an output without candidates
    is its own one candidate)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g_all, w_all = g.candidates or [g], w.candidates or [w]
        assert [(c.text, c.tokens, c.finish_reason) for c in g_all] == \
            [(c.text, c.tokens, c.finish_reason) for c in w_all]
        assert [c.score for c in g_all] == pytest.approx([c.score for c in w_all], abs=1e-4)
        for g_c, w_c in zip(g_all, w_all, strict=True):
            assert_same_logprobs(g_c.logprobs, w_c.logprobs)
        assert (g.text, g.tokens, g.finish_reason) == (w.text, w.tokens, w.finish_reason)


def assert_same_logprobs(got: list | None, want: list | None) -> None:
    """Same tokens and alternatives; log-probs equal up to float rounding (both None when not asked for)."""
    assert (got is None) == (want is None)
    if got is None:
        return
    assert [(e.token, e.text) for e in got] == [(e.token, e.text) for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
    for g, w in zip(got, want, strict=True):
        assert (g.top_logprobs is None) == (w.top_logprobs is None)
        if g.top_logprobs is not None:
            assert [a.token for a in g.top_logprobs] == [a.token for a in w.top_logprobs]
            assert [a.logprob for a in g.top_logprobs] == pytest.approx([a.logprob for a in w.top_logprobs], abs=1e-4)


def histogram_count(engine: Engine, name: str, labels: dict[str, str], le: str | None = None) -> float:
    """A histogram's _count (or one bucket's cumulative count) from the engine's registry."""
    suffix = "_count" if le is None else "_bucket"
    labels = dict(labels, **({"le": le} if le is not None else {}))
    return engine.metrics.registry.get_sample_value(name + suffix, labels) or 0.0
