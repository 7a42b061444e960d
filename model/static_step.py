"""A decoding step over static buffers: the same function runs eagerly on CPU and is captured as a CUDA graph.

:class:`StaticDecoder` holds, for up to ``rows`` rows, persistent input buffers (the fed token of each row, each
row's adapter index), a :class:`model.static_cache.StaticKVCache` (self-attention, and cross-attention memory for an
encoder-decoder) and an output logits buffer. A step of n live rows runs the padded batch size b = the next of
``sizes`` (1, 2, 4, ..., 64, as vLLM pads to its captured sizes) over the first b rows: the model's own embedding,
layer stack (the PyTorch path: LayerStack.forward, not the CPU C++ step) and head. On CUDA each size's step is
captured once with ``torch.cuda.CUDAGraph`` (lazily, on its first use) and replayed; elsewhere it runs eagerly.

The graph holds the model's forward only: the search (greedy, sampling, beam) runs eagerly on the logits it returns,
and row reorders (beams, finished rows) are index copies into the static buffers between steps.

Per-row LoRA: the rows' adapter indices are a tensor input. Each LoRA layer's inference delta is
``((x A^T) * scales) B^T`` (model.lora_layers.RowDeltas) over every resident adapter stacked; the step routes all b
rows through one Routing whose ``scales`` (b, columns) it refills in the graph from a table (one row per adapter,
computed by the layers themselves) indexed by the rows' adapter indices. Loading, removing or merging an adapter, or
changing its weights in place, changes the stacked weights the graph read: the runner of every size built under the
old adapters is rebuilt (and re-captured) on its next use, and only those; sizes never run are never built. A batch
whose rows all take the base model runs a runner of its own, without the adapters' GEMMs (keyed as vLLM keys its
graphs: by whether LoRA is active).

A server's running batch keeps its own KVCache (rows join, leave and are reordered as ever):
:meth:`StaticDecoder.decode` moves its K/V into the static buffers when rows joined or left (rows reading shared prefix
blocks get the blocks copied ahead of their own positions), and then its buffers are views of them.

Not held (the caller decodes eagerly, :func:`model.static_generation.fits`, :meth:`StaticDecoder.refusal`): more rows
than the largest size or positions than the capacity, adapters' head copies (modules_to_save), a vocabulary
restriction; offline (:meth:`StaticDecoder.load`), a shared prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from model.causal_lm import CausalLM
from model.kv_cache import KVCache
from model.lora_layers import HeadCopies, LoRALinear, Routing
from model.seq2seq import Seq2SeqTransformer
from model.static_cache import StaticKVCache

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # captured batch sizes; a batch is padded up to the next one
VERIFY_WIDTHS = (2, 4, 8, 16)  # a verification step's tokens a row (fed token + draft), padded up to the next one


def padded_size(rows: int, sizes: Sequence[int] = BATCH_SIZES) -> int:
    """The smallest of ``sizes`` holding ``rows`` rows; ValueError beyond the largest (decode those eagerly)."""
    for size in sorted(sizes):
        if size >= rows:
            return size
    raise ValueError(f"{rows} rows exceed the largest captured batch size {max(sizes)}")


def adapter_state(layers: Sequence[LoRALinear]) -> tuple:
    """What a built step depends on in the model's adapters: per LoRA layer, the merged adapter and its resident
    adapters' key (LoRALinear.adapters_key: added, removed or changed in place). Equal states: the same weights."""
    return tuple((m.merged, m.adapters_key()) for m in layers)


@dataclass
class _Runner:
    """One batch size's step, built under one adapter state: its cache view, LoRA routing and scale tables, and
    (CUDA) its captured graph."""

    size: int
    width: int  # tokens a row: 1 (a decoding step) or one of VERIFY_WIDTHS (a verification step)
    state: tuple
    cache: StaticKVCache
    names: list[str | None]  # adapter index -> name (0: the base model)
    routing: Routing | None = None
    scales: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live scales, table)
    graph: torch.cuda.CUDAGraph | None = None


class StaticDecoder:
    """Static decode buffers and steps for ``model`` (a CausalLM or a Seq2SeqTransformer) over up to ``rows`` rows of
    ``capacity`` positions (and ``source_capacity`` source tokens); ``graphs``: capture on CUDA (None: when the
    model is on CUDA)."""

    def __init__(self, model: CausalLM | Seq2SeqTransformer, rows: int, capacity: int,
                 sizes: Sequence[int] = BATCH_SIZES, graphs: bool | None = None,
                 source_capacity: int | None = None) -> None:
        self.model = model
        self.sizes = tuple(sorted(sizes))
        self.rows = padded_size(rows, self.sizes)
        weight = self._embed().tokens.weight
        self.device = weight.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        c = model.config
        if capacity > c.max_len:  # a learned position table has max_len rows
            raise ValueError(f"capacity {capacity} exceeds the model's maximum length {c.max_len}")
        seq2seq = isinstance(model, Seq2SeqTransformer)
        layers = c.n_decoder_layers if seq2seq else c.n_layers
        heads = c.n_heads if seq2seq else c.kv_heads
        self.cache = StaticKVCache.allocate(layers, self.rows, heads, c.head_dim, capacity, self.device, weight.dtype)
        if seq2seq:
            self.cache.add_cross(layers, c.n_heads, c.head_dim, source_capacity or c.max_src_len)
        self.tokens = torch.zeros(self.rows, max(VERIFY_WIDTHS), dtype=torch.long, device=self.device)  # fed
        self.adapters = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.logits: dict[int, torch.Tensor] = {}  # per width: (rows, width, V), allocated by its first step
        self.live = 0  # rows in use
        self.used = 0  # the longest live row's length (host side: the copy windows of select)
        self.builds = 0  # runners built (graphs captured on CUDA): tells when adapters invalidated them
        self._row_adapters: list[str | None] = []
        self._written: tuple | None = None  # (adapter names by index, each row's name) the adapters buffer holds
        self._runners: dict[tuple[int, bool, int], _Runner] = {}  # by (size, any row with an adapter, width)
        self._pool = None  # the graphs' shared memory pool (CUDA)
        self.graph_bytes = 0  # memory the captures reserved (CUDA: the graphs' pool)
        self.adopted = 0  # running caches copied into the buffers by decode (rows joined, or left a cache not adopted)
        self.kept = 0  # rows left an adopted cache in place (keep_rows)
        self._cross: object | None = None  # the cross-attention memory decode last copied in, and its rows
        self._cross_rows = 0
        self._lora: list[LoRALinear] = []  # the model's LoRA layers and whether any adapter has head copies (refresh)
        self._head_copies = False
        self.refresh()

    def refresh(self) -> None:
        """Read the model's LoRA layers again (one walk of its modules, not one a step): call it after adapters were
        added to or removed from the model (weights changed in place need nothing: adapter_state sees them)."""
        modules = list(self.model.modules())
        self._lora = [m for m in modules if isinstance(m, LoRALinear)]
        self._head_copies = any(isinstance(m, HeadCopies) for m in modules)

    @property
    def built(self) -> list[tuple[int, bool, int]]:
        """The runners built and current: (batch size, whether it runs adapters, tokens a row), sorted."""
        return sorted(self._runners)

    @property
    def captured(self) -> int:
        """How many of them hold a CUDA graph."""
        return sum(runner.graph is not None for runner in self._runners.values())

    @property
    def routed_adapters(self) -> list[str]:
        """The adapters (internal names) its steps route rows to: those of the model's LoRA layers as of refresh."""
        return sorted({name for layer in self._lora for name in layer.configs})

    def holds_model(self) -> bool:
        """Whether the model's modules (as of :meth:`refresh`) take a static step: no adapter holds head copies
        (``modules_to_save``, whose rows are routed on the host)."""
        return not self._head_copies

    def _embed(self) -> nn.Module:
        return self.model.tgt_embed if isinstance(self.model, Seq2SeqTransformer) else self.model.embed

    def load(self, cache: KVCache, adapters: Sequence[str | None] | None = None) -> None:
        """Start from an eagerly prefilled ``cache`` (its rows become rows 0..n-1) with per-row ``adapters``."""
        self.cache.load(cache)
        self.live, self.used = cache.batch_size, cache.max_length
        self._row_adapters = list(adapters) if adapters is not None else [None] * self.live

    def decode(self, tokens: torch.Tensor, cache: KVCache, adapters: Sequence[str | None]) -> torch.Tensor:
        """One step for the rows of a running ``cache`` that the caller keeps selecting, concatenating and compacting
        as any KVCache (the service's continuous batching): (n, V) logits after ``tokens`` (n,), rows selecting
        ``adapters``. The cache's K/V move into the static buffers when they are not there already (after rows
        joined or left: one copy of the used positions; its keys and values become views of rows 0..n-1, so beam
        reorders in place stay in them), its cross-attention memory is copied in when it changed, and its lengths
        are copied in at every step; the step's K/V land in place and the cache advances as KVCache.end_step."""
        return self._take(tokens[:, None], cache, adapters)[:, 0]

    def verify(self, tokens: torch.Tensor, cache: KVCache, adapters: Sequence[str | None]) -> torch.Tensor:
        """:meth:`decode` of t tokens a row (n, t) (the fed token and a speculative draft, model.speculative): the
        logits (n, t, V) after each; the cache keeps all t positions until the caller truncates it. Rows are padded to
        the next of VERIFY_WIDTHS tokens (one step of each width: its graph), the padding computed and forgotten;
        a translator's too (T5's relative position bias spans the static positions: StaticKVCache.begin_step)."""
        return self._take(tokens, cache, adapters)

    def _take(self, fed: torch.Tensor, cache: KVCache, adapters: Sequence[str | None]) -> torch.Tensor:
        n, t = fed.shape
        if (reason := self.refusal(cache, t)) is not None:
            raise ValueError(f"the static step does not take this step of {n} rows x {t} tokens: {reason}")
        width = verify_width(t)
        self._adopt(cache)
        self.cache.lengths[:n].copy_(cache.lengths)
        self.cache.lengths[n:] = 0
        self.live, self.used = n, cache.max_length
        self._row_adapters = list(adapters)
        logits = self._run(fed, width)
        cache.lengths = cache.lengths + t
        cache.max_length += t
        return logits

    def refusal(self, cache: KVCache, tokens: int = 1) -> str | None:
        """Why :meth:`decode` (``tokens`` 1) or :meth:`verify` does not take a step of ``cache`` (None: it does):
        "rows" past the largest size, "width" (more tokens a row than the widest step),
        "length" (fewer free positions a row than the step's width, after its own and shared prefix ones),
        "head_copies" (:meth:`holds_model`), "source" (cross-attention past the static buffers)."""
        cross = self.cache.cross
        if cache.batch_size > self.rows:
            return "rows"
        if tokens > max(VERIFY_WIDTHS):
            return "width"
        if span(cache) + verify_width(tokens) > self.cache.capacity:
            return "length"
        if not self.holds_model():
            return "head_copies"
        if (cache.cross is None) != (cross is None) or (cross is not None
                                                        and cache.cross.mask.shape[-1] > cross.mask.shape[-1]):
            return "source"
        return None

    def _adopt(self, cache: KVCache) -> None:
        """Make rows 0..n-1 of the static buffers hold ``cache``'s K/V (and cross-attention memory) and its buffers
        views of them; a copy only when they are not already. Rows reading shared prefix blocks get them copied
        ahead of their own positions, and the cache reads no prefix any more (its lengths count it)."""
        n, mine = cache.batch_size, self.cache
        if cache.prefix is not None:
            self._adopt_prefixed(cache)
        elif not self._adopted(cache):
            used = cache.max_length
            for static, own in zip(mine.keys + mine.values, cache.keys + cache.values, strict=True):
                static[:n, :, :used] = own[:, :, :used]
            cache.keys, cache.values = [k[:n] for k in mine.keys], [v[:n] for v in mine.values]
            self.adopted += 1
        if cache.cross is not None and (cache.cross is not self._cross or n != self._cross_rows):
            mine._load_cross(cache.cross, n)
            self._cross, self._cross_rows = cache.cross, n

    def keep_rows(self, cache: KVCache, index: torch.Tensor) -> bool:
        """``cache.select(index)`` for rows leaving (``index`` (m,), m < n) done inside the static buffers when
        ``cache`` is the adopted one (StaticKVCache.select: the moved rows' used positions copied), its buffers then
        views of rows 0..m-1 (no new buffers, no copy back at the next step). False (nothing done) for any other
        cache."""
        n, m, mine = cache.batch_size, index.shape[0], self.cache
        if not (m < n and self._adopted(cache)):
            return False
        lengths = cache.lengths.index_select(0, index)
        used = min(cache.max_length, int(lengths.max()) if m else 0)
        mine.select(index, None, used)  # the moved rows' K/V (and cross-attention rows) by index copies
        cache.keys, cache.values = [k[:m] for k in mine.keys], [v[:m] for v in mine.values]
        cache.lengths, cache.max_length = lengths, used
        if cache.cross is not None:
            cache.cross = cache.cross.select(index)
            self._cross, self._cross_rows = cache.cross, m  # the static rows hold it already
        self.kept += 1
        return True

    def _adopted(self, cache: KVCache) -> bool:
        """Whether ``cache``'s buffers are the views of static rows 0..n-1 that :meth:`_adopt` made."""
        theirs, mine = cache.keys[0], self.cache.keys[0]
        return theirs.data_ptr() == mine.data_ptr() and theirs.shape == mine[: cache.batch_size].shape

    def _adopt_prefixed(self, cache: KVCache) -> None:
        """:meth:`_adopt` of rows that read shared prefix blocks: per group of rows reading one chain, the chain's K/V
        and then each row's own positions."""
        prefix, mine, used, n = cache.prefix, self.cache, cache.max_length, cache.batch_size
        for layer in range(len(mine.keys)):
            for group in prefix.groups:
                ahead = len(group.chain) * prefix.block_tokens
                for static, own, chain in ((mine.keys[layer], cache.keys[layer], prefix.keys),
                                           (mine.values[layer], cache.values[layer], prefix.values)):
                    rows = static[:n][group.index]  # a view when the group's rows are consecutive, else a copy
                    if ahead:
                        rows[:, :, :ahead] = chain(layer, group.chain)
                    rows[:, :, ahead: ahead + used] = own[group.index][:, :, :used]
                    if not isinstance(group.index, slice):
                        static[:n][group.index] = rows
        cache.keys, cache.values = [k[:n] for k in mine.keys], [v[:n] for v in mine.values]
        cache.lengths, cache.max_length = cache.lengths + prefix.lengths, span(cache)
        cache.prefix, cache.uniform = None, False
        self.adopted += 1

    @property
    def nbytes(self) -> int:
        """Memory of the static step: the K/V (and cross-attention) buffers, the logits and the graphs' pool."""
        logits = sum(t.numel() * t.element_size() for t in list(self.logits.values()))  # read by other threads
        return self.cache.nbytes + logits + self.tokens.numel() * self.tokens.element_size() + self.graph_bytes

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row (n,); return the next-token logits (n, V) (a copy: the buffer is reused)."""
        if tokens.shape[0] != self.live:
            raise ValueError(f"{tokens.shape[0]} tokens for {self.live} live rows")
        if self.used >= self.cache.capacity:
            raise ValueError(f"the static cache's {self.cache.capacity} positions are used up")
        return self._run(tokens[:, None], 1)[:, 0]

    def _run(self, fed: torch.Tensor, width: int) -> torch.Tensor:
        """The step of ``width`` tokens a row over the live rows, ``fed`` (n, t <= width) padded with each row's last
        token; the logits (n, t, V) (a copy)."""
        n, t = fed.shape
        runner = self._runner(padded_size(n, self.sizes), width)
        buffer = self.tokens[:, :width]
        buffer[:n, :t].copy_(fed, non_blocking=True)
        buffer[:n, t:] = buffer[:n, t - 1: t]
        buffer[n:].zero_()
        self._write_adapters(runner)
        if runner.graph is not None:
            runner.graph.replay()
        else:
            self._eager(runner)
        self.used += t
        return self.logits[width][:n, :t].clone()

    def prepare(self) -> None:
        """Build the base model's step of every size now (on CUDA: capture its graph) rather than on first use."""
        self._row_adapters = []
        for size in self.sizes:
            if size <= self.rows:
                self._runner(size, 1)

    def select(self, index: torch.Tensor, tails: torch.Tensor | None = None) -> None:
        """Rows 0..m-1 become old rows ``index`` (m,): beams reordered, finished rows dropped (model.search)."""
        keeps_rows = index.shape[0] == self.live
        self.cache.select(index, tails if keeps_rows else None, self.used)
        self._row_adapters = [self._row_adapters[i] for i in index.tolist()]
        self.live = index.shape[0]

    def _write_adapters(self, runner: _Runner) -> None:
        """Each row's adapter index into the buffer (a host-to-device copy only when a row's adapter moved)."""
        written = (tuple(runner.names), tuple(self._row_adapters))
        if not runner.scales or written == self._written:
            return
        self._written = written
        position = {name: i for i, name in enumerate(runner.names)}
        rows = [position[name] for name in self._row_adapters] + [0] * (self.rows - self.live)
        self.adapters.copy_(torch.tensor(rows, dtype=torch.long), non_blocking=True)

    def _runner(self, size: int, width: int) -> _Runner:
        """The runner of ``size`` rows of ``width`` tokens and whether any live row selects an adapter (vLLM keys its
        graphs so too: a base-only batch skips the adapters' GEMMs), (re)built when none is or the adapters changed
        since."""
        state = adapter_state(self._lora)
        key = (size, any(name is not None for name in self._row_adapters), width)
        runner = self._runners.get(key)
        if runner is None or runner.state != state:
            runner = self._runners[key] = self._build(size, width, state, key[1])
        return runner

    def _build(self, size: int, width: int, state: tuple, adapters: bool) -> _Runner:
        if not self.holds_model():
            raise ValueError("adapters' head copies (modules_to_save) route rows on the host: decode them eagerly")
        layers = self._lora
        names = [None, *self.routed_adapters]
        runner = _Runner(size, width, state, self.cache.view(size), names)
        if adapters and len(names) > 1:
            runner.routing, runner.scales = _lora_scales(layers, names, size)
        elif layers:  # every row on the base model (a merged adapter's delta taken out)
            runner.routing = Routing()
        self.builds += 1
        if self.graphs:
            self._capture(runner)
        return runner

    def _eager(self, runner: _Runner) -> None:
        """The step of ``runner``'s size and width over its views of the static buffers (what a graph captures)."""
        size, width = runner.size, runner.width
        for scales, table in runner.scales:
            scales.copy_(table.index_select(0, self.adapters[:size]))
        with _routed(self._lora, runner.routing):
            logits = _forward(self.model, self.tokens[:size, :width], runner.cache)
        if width not in self.logits:
            self.logits[width] = logits.new_zeros(self.rows, width, logits.shape[-1])
        self.logits[width][:size].copy_(logits)

    def _capture(self, runner: _Runner) -> None:
        """Capture ``runner``'s step as a CUDA graph, after two eager warm-up steps on a side stream (their cache
        writes land beyond the rows' lengths, which are restored, so they are overwritten and masked)."""
        lengths = self.cache.lengths.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._eager(runner)
        torch.cuda.current_stream().wait_stream(stream)
        self.cache.lengths.copy_(lengths)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        reserved = torch.cuda.memory_reserved(self.device)
        runner.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(runner.graph, pool=self._pool):
            self._eager(runner)
        self.graph_bytes += torch.cuda.memory_reserved(self.device) - reserved
        logger.info("captured the decoding step for %d rows of %d tokens", runner.size, runner.width)


def verify_width(tokens: int) -> int:
    """The width a step of ``tokens`` a row runs at: 1, or the next of VERIFY_WIDTHS (ValueError past the last)."""
    return 1 if tokens == 1 else padded_size(tokens, VERIFY_WIDTHS)


def span(cache: KVCache) -> int:
    """The most positions a row of ``cache`` holds (host side): its own and the shared prefix blocks it reads."""
    prefix = cache.prefix
    return cache.max_length + (max(map(len, prefix.rows)) * prefix.block_tokens if prefix is not None else 0)


def _forward(model: CausalLM | Seq2SeqTransformer, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    """One step of ``model`` feeding ``tokens`` (B, t) over ``cache``: logits (B, t, V). The models' decode_step (t = 1)
    and verify_step, through LayerStack.forward (PyTorch ops, as on a GPU) and with the static cross-attention mask
    (no host-side check of it)."""
    positions, mask = cache.begin_step(tokens.shape[1])
    if isinstance(model, Seq2SeqTransformer):
        x = model.tgt_embed(tokens, positions)
        x = model.decoder(x, mask, memory_mask=cache.cross.mask, cache=cache)[0]
        head: Callable[[torch.Tensor], torch.Tensor] = model.logits
    else:
        x = model.decoder(model.embed(tokens, positions), mask, cache=cache)[0]
        head = model.lm_head
    cache.end_step(tokens.shape[1])
    return head(x)


def _lora_scales(layers: list[LoRALinear], names: list[str | None], size: int
                 ) -> tuple[Routing, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A Routing of ``size`` rows whose per-row scales the step refills, and per distinct scales tensor its table
    (one row per adapter of ``names``, as the layers compute it for a row selecting that adapter)."""
    device = layers[0].base.weight.device
    empty = torch.zeros(0, dtype=torch.long, device=device)
    table_routing = Routing(groups={name: torch.tensor([i], device=device) for i, name in enumerate(names)},
                            rows=len(names))
    routing = Routing(groups={None: torch.arange(size, device=device), **{n: empty for n in names[1:]}}, rows=size)
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    previous = [layer.routing for layer in layers]
    try:
        for layer in layers:
            layer.routing = table_routing
            if not layer.stackable():
                raise ValueError("non-finite adapter weights: a static step needs the stacked adapters")
            table = layer.row_deltas(len(names))
            layer.routing = routing
            layer.stackable()
            live = layer.row_deltas(size)
            if table is not None and live is not None:
                found.setdefault(id(live.scales), (live.scales, table.scales))
    finally:
        for layer, prev in zip(layers, previous, strict=True):
            layer.routing = prev
    return routing, list(found.values())


class _routed:
    """Route the LoRA ``layers`` by ``routing`` for a block (None: leave the routing as it is)."""

    def __init__(self, layers: list[LoRALinear], routing: Routing | None) -> None:
        self.layers = layers if routing is not None else []
        self.routing = routing
        self.previous: list[Routing] = []

    def __enter__(self) -> None:
        self.previous = [layer.routing for layer in self.layers]
        for layer in self.layers:
            layer.routing = self.routing

    def __exit__(self, *exc) -> None:
        for layer, prev in zip(self.layers, self.previous, strict=True):
            layer.routing = prev
