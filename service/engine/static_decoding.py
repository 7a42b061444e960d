"""The running batch's decoding steps through the static step (model.static_step): CUDA graphs on a GPU.

``TSERVE_CUDA_GRAPHS`` (EngineSettings.cuda_graphs): ``off`` (the default) decodes as ever; ``lazy`` runs every plain
decoding step the static buffers hold through a :class:`model.static_step.StaticDecoder` (on CUDA each padded batch
size's step is captured as a CUDA graph on its first use and replayed after; on the CPU the same step runs eagerly,
which proves it but is slower than the C++ step), and ``startup`` also builds (captures) every size's base step when
the model loads. ``TSERVE_CUDA_GRAPH_SIZES`` lists the captured batch sizes (a batch is padded up to the next one).

The buffers are bounded when the model loads: rows up to ``max_batch_size`` (padded to a size), positions up to the
model's input limit plus its new-token cap (``max_input_tokens`` + ``max_new_tokens``), a translator's sources up to
its input limit; GET /v1/models reports their memory. A step they do not hold runs eagerly, and
``tserve_static_steps_total{model, path}`` counts each step by path: ``static``, or the reason it fell back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.kv_cache import KVCache
from model.restricted_vocab import VocabularyRestriction
from model.static_step import BATCH_SIZES, StaticDecoder
from service.engine.adapters import AdapterRegistry
from service.engine.metrics import Metrics
from service.engine.runners import DECODE_HEADROOM, GenerationRunner
from service.engine.types import EngineSettings

logger = logging.getLogger(__name__)

MODES = ("off", "lazy", "startup")


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8): positive, distinct, at most 1024 each; ValueError naming what is wrong."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"batch sizes are comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > 1024:
        raise ValueError(f"batch sizes must be 1 to 1024, got {text!r}")
    return sizes


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`, else ValueError listing them."""
    if mode not in MODES:
        raise ValueError(f"{mode!r} is not one of {', '.join(MODES)}")
    return mode


@dataclass
class StaticInfo:
    """What GET /v1/models says of a model's static step."""

    mode: str
    sizes: list[int]  # the batch sizes it pads to
    built: list[int]  # the sizes built so far (captured as graphs on CUDA)
    graphs: bool  # whether steps are captured (CUDA) or run eagerly (CPU)
    rows: int
    positions: int  # each row's capacity
    bytes: int  # its buffers and (CUDA) the graphs' memory


class StaticDecoding:
    """A model's static step for its running batch, and the rule of which steps it takes."""

    @classmethod
    def of(cls, name: str, runner: GenerationRunner, settings: EngineSettings, metrics: Metrics,
           registry: AdapterRegistry) -> StaticDecoding | None:
        """The static step ``settings`` ask for (None: cuda_graphs off), its buffers bounded by the settings: a
        causal LM's rows hold an input and its new tokens, a translator's decoder its new tokens (and a target
        prefix of up to DECODE_HEADROOM tokens) and its cross-attention an input."""
        if settings.cuda_graphs == "off":
            return None
        sizes = parse_sizes(settings.cuda_graph_sizes) if settings.cuda_graph_sizes else BATCH_SIZES
        inputs = min(runner.max_input_tokens, settings.max_input_tokens or runner.max_input_tokens)
        prompt = DECODE_HEADROOM + 1 if runner.family == "seq2seq" else inputs
        return cls(name, runner, settings.cuda_graphs, sizes, settings.max_batch_size, prompt + settings.max_new_tokens,
                   metrics, registry)

    def __init__(self, name: str, runner: GenerationRunner, mode: str, sizes: Sequence[int], max_rows: int,
                 positions: int, metrics: Metrics, registry: AdapterRegistry) -> None:
        self.mode = check_mode(mode)
        rows = min(max_rows, max(sizes))
        capacity = min(positions, runner.config.max_len)
        source = runner.max_input_tokens if runner.family == "seq2seq" else None  # the cross-attention buffers
        self.decoder = StaticDecoder(runner.model, rows, capacity, sizes, source_capacity=source)
        self._steps = metrics.static_steps
        self._name = name
        self._registry = registry  # its change counter says when the model's adapters changed
        self._adapters_seen = registry.changes
        logger.info("model %r: static decoding step (%s): %d rows x %d positions, %.1f MB, sizes %s", name, mode,
                    self.decoder.rows, self.decoder.cache.capacity, self.decoder.nbytes / 2**20, self.info().sizes)
        if mode == "startup":
            with torch.inference_mode():
                self.decoder.prepare()

    def fallback(self, cache: KVCache, vocabulary: VocabularyRestriction | None, tokens: int = 1) -> str | None:
        """Why a step of ``cache`` feeding ``tokens`` a row (more than 1: a verification step) runs eagerly (None:
        the static step takes it): "vocabulary" (a translator's vocabulary map), or the decoder's own refusal
        (StaticDecoder.refusal)."""
        if self._registry.changes != self._adapters_seen:  # adapters were loaded or removed: read the model again
            self.decoder.refresh()
            self._adapters_seen = self._registry.changes
        return "vocabulary" if vocabulary is not None else self.decoder.refusal(cache, tokens)

    def count(self, path: str) -> None:
        """One decoding step by ``path`` ("static" or a fallback's reason) in the metrics."""
        self._steps.labels(self._name, path).inc()

    def decode(self, tokens: torch.Tensor, cache: KVCache, vocabulary: VocabularyRestriction | None,
               adapters: Sequence[str | None]) -> torch.Tensor:
        """The runner's ``decode`` through the static step (``vocabulary`` is None: :meth:`fallback` said so)."""
        return self.decoder.decode(tokens, cache, adapters)

    def verify(self, tokens: torch.Tensor, cache: KVCache, vocabulary: VocabularyRestriction | None,
               adapters: Sequence[str | None]) -> torch.Tensor:
        """The runner's ``verify`` (a fed token and a draft a row, (rows, t)) through the static step."""
        return self.decoder.verify(tokens, cache, adapters)

    def info(self) -> StaticInfo:
        decoder = self.decoder
        return StaticInfo(mode=self.mode, sizes=[s for s in decoder.sizes if s <= decoder.rows],
                          built=sorted({key[0] for key in decoder.built}), graphs=decoder.graphs,
                          rows=decoder.rows, positions=decoder.cache.capacity, bytes=decoder.nbytes)

