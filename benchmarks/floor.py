"""The floor under every decoding result: bytes read over memory bandwidth, FLOPs over the matmul rate.

A decoding step must read every weight it multiplies by (and the KV cache it attends to) and do 2 FLOPs per weight per
row, so no implementation on this machine beats, per step, ``max(bytes / bandwidth, flops / matmul rate)``; the
weights' products run at their precision's rate, attention's at float32's (its operands are activations and the
float32 K/V cache whatever the weights are: :meth:`Rates.attention_rate`). Bandwidth is measured by reading a buffer
as large as the step's weights (so a working set that lives in the last-level cache gets that cache's rate); the
matmul rate by fp32 GEMMs (1024^3, and 512 rows through a 512 x 2048 linear, torch's and ours: the panel GEMM of
model/kernel_layers.py, which beats MKL's) and, for int8, by the faster of fbgemm's dynamic int8 linear and ours
(model/kernels/int8_gemm.cpp), for bf16 by ours (model/bf16_linear.py: VDPBF16PS where the CPU has AVX512-BF16; its
weights are 2 bytes, :data:`BF16`); a served shape adds 512 rows through its own FFN linear in each.
Each is the fastest of 7 runs at the best of the thread counts tried.
A machine shared with other work reads memory at different rates from minute to minute (33-58 GB/s here within
an hour), so a cell's floor takes the bandwidth read *while the cell ran*: :class:`BandwidthProbe`, run before
each of its timed runs (benchmarks/cells.py), the median of those; the best rate of the run stays in the
report beside it.
The cross-attention K/V of beams of one source count once. The classifier's floor counts every
layer in full (ours computes only [CLS] in its last layer, so it can beat it by up to 1/L).
Sizes come from a :class:`Dims` (default: the toy shape of benchmarks/peers.py; benchmarks/shapes.py
has the OPUS-MT, BERT-base, GPT-2 small, SmolLM2 and Qwen2.5 ones: the last two with grouped-query K/V and a
gated feed-forward).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from benchmarks.common import run_times
from model import kernel_layers
from model.bf16_linear import Bf16Linear
from model.int8_linear import Int8Linear

FP32, BF16, INT8 = 4, 2, 1  # bytes a weight


@dataclass(frozen=True)
class Dims:
    """The sizes a floor depends on (a seq2seq model has ``layers`` in its encoder and in its decoder)."""

    d_model: int = 512
    d_ff: int = 2048
    vocab: int = 8000
    layers: int = 6
    kv_width: int = 0  # K (and V) width per layer: n_kv_heads x head_dim under grouped-query attention; 0: d_model
    ffn_matrices: int = 2  # 3 for a gated feed-forward (gate, up, down)

    @property
    def kv(self) -> int:
        return self.kv_width or self.d_model

    @property
    def self_attn(self) -> int:  # q and out projections, k and v at the K/V width
        return 2 * self.d_model**2 + 2 * self.d_model * self.kv

    @property
    def ffn(self) -> int:
        return self.ffn_matrices * self.d_model * self.d_ff

    @property
    def cross_decode(self) -> int:  # cross-attention q and out (its K/V are computed once per source)
        return 2 * self.d_model**2

    @property
    def lm_head(self) -> int:
        return self.vocab * self.d_model


TOY = Dims()  # benchmarks/peers.py's shape


def _best_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    """The fastest of ``repeats`` runs: a floor takes the best rate the machine showed."""
    return min(run_times(fn, repeats))


@dataclass
class Rates:
    """Measured rates: bytes/s read at a given working-set size, FLOP/s of fp32, int8 and bf16 GEMMs."""

    bandwidth: dict[int, float]  # working-set bytes -> bytes/s
    fp32_flops: float
    int8_ops: float
    threads: dict[str, int]  # which thread count gave each best rate
    bf16_flops: float = 0.0  # our bf16 GEMM (model/bf16_linear.py: VDPBF16PS where the CPU has it); 0: not measured

    def read_rate(self, nbytes: float) -> float:
        """Bandwidth measured at the working-set size closest to ``nbytes``."""
        size = min(self.bandwidth, key=lambda s: abs(s - nbytes))
        return self.bandwidth[size]

    def compute_rate(self, weight_bytes: int) -> float:
        """The GEMM rate of weights of ``weight_bytes`` bytes (FP32, BF16, INT8)."""
        return {FP32: self.fp32_flops, BF16: self.bf16_flops, INT8: self.int8_ops}[weight_bytes]

    def attention_rate(self, weight_bytes: int, encoder: bool = False) -> float:
        """The rate of attention's products (scores, weighted values). Their operands are activations and the float32
        K/V cache whatever the weights' precision, so float32's GEMM rate, except an encoder's in bf16, whose
        attention rounds its inputs to bf16 (model/attention.py's ``bf16_products``). An int8 model's attention at
        int8's rate would need int8 activations and K/V; its K/V bytes are counted as float32 here too."""
        return self.bf16_flops if encoder and weight_bytes == BF16 else self.fp32_flops

    def during(self, bandwidth: dict[int, float]) -> Rates:
        """These rates with the bandwidth read at some moment (a cell's runs) in place of the best one."""
        return replace(self, bandwidth={size: bandwidth.get(size, rate) for size, rate in self.bandwidth.items()})

    def best_with(self, other: Rates) -> Rates:
        """The higher of each rate in two measurements (on a shared machine one may have met other work)."""
        pick = {"fp32": self.fp32_flops >= other.fp32_flops, "int8": self.int8_ops >= other.int8_ops,
                "bf16": self.bf16_flops >= other.bf16_flops}
        pick |= {f"bw{size}": rate >= other.bandwidth.get(size, 0.0) for size, rate in self.bandwidth.items()}
        return Rates(
            bandwidth={size: max(rate, other.bandwidth.get(size, 0.0)) for size, rate in self.bandwidth.items()},
            fp32_flops=max(self.fp32_flops, other.fp32_flops),
            int8_ops=max(self.int8_ops, other.int8_ops),
            threads={k: (self if pick.get(k, True) else other).threads.get(k, n) for k, n in self.threads.items()},
            bf16_flops=max(self.bf16_flops, other.bf16_flops),
        )


class BandwidthProbe:
    """Reads buffers as large as the given working sets, the best of ``repeats`` reads each."""

    def __init__(self, working_sets: list[int], threads: list[int], repeats: int = 3) -> None:
        self.buffers = {size: torch.ones(size // 4) for size in working_sets}
        self.threads, self.repeats = threads, repeats

    def read(self) -> dict[int, float]:
        """Working-set bytes -> bytes/s at the calling thread's intra-op thread count."""
        with torch.inference_mode():
            return {size: size / _best_seconds(buf.sum, self.repeats) for size, buf in self.buffers.items()}

    def __call__(self) -> dict[int, float]:
        """Working-set bytes -> bytes/s at the best of the thread counts, now (a fraction of a second)."""
        before, rates = torch.get_num_threads(), {}
        try:
            for n in self.threads:
                torch.set_num_threads(n)
                rates = {size: max(rates.get(size, 0.0), rate) for size, rate in self.read().items()}
        finally:
            torch.set_num_threads(before)
        return rates


def measure_rates(working_sets: list[int], threads: list[int], linears: list[tuple[int, int, int]] = ()) -> Rates:
    """Best-over-threads read bandwidth per working-set size and GEMM rates; ``linears`` adds (rows, in, out)
    linears to the GEMMs timed, fp32 and our int8 (a shape's own FFN, larger than the fixed ones)."""
    best: dict[str, tuple[float, int]] = {}

    def keep(key: str, value: float, n: int) -> None:
        if key not in best or value > best[key][0]:
            best[key] = (value, n)

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    x32, w32 = torch.randn(512, 512), torch.randn(2048, 512)  # a decoding batch through fc1
    x = torch.randn(256, 2048)
    w = torch.randn(2048, 2048) * 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w, (w.abs().amax(1) / 127).double(), torch.zeros(2048, dtype=torch.long), 0,
                                       torch.qint8)
        packed = torch.ops.quantized.linear_prepack(q, None)
    ours = Int8Linear(w, None)  # the int8 GEMM our models run (ours where it runs, else fbgemm)
    bf16 = Bf16Linear(w32, None)  # the bf16 GEMM our bf16 models run
    extra = [(torch.randn(rows, n_in), torch.randn(n_out, n_in) * 0.02) for rows, n_in, n_out in linears]
    extra = [(xl, wl, Int8Linear(wl, None), Bf16Linear(wl, None)) for xl, wl in extra]
    probe = BandwidthProbe(working_sets, threads, repeats=7)
    before = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            with torch.inference_mode():
                for size, rate in probe.read().items():
                    keep(f"bw{size}", rate, n)
                keep("fp32", 2 * 1024**3 / _best_seconds(lambda: a @ b), n)
                for fp32_linear in (torch.nn.functional.linear, kernel_layers.linear):  # MKL's, ours
                    keep("fp32", 2 * 512 * 512 * 2048 / _best_seconds(partial(fp32_linear, x32, w32)), n)
                    for xl, wl, *_ in extra:
                        flops = 2 * xl.shape[0] * wl.shape[0] * wl.shape[1]
                        keep("fp32", flops / _best_seconds(partial(fp32_linear, xl, wl)), n)
                for xl, wl, wl8, wl16 in extra:
                    flops = 2 * xl.shape[0] * wl.shape[0] * wl.shape[1]
                    keep("int8", flops / _best_seconds(partial(wl8, xl)), n)
                    keep("bf16", flops / _best_seconds(partial(wl16, xl)), n)
                keep("bf16", 2 * 512 * 512 * 2048 / _best_seconds(partial(bf16, x32)), n)
                for int8_linear in (lambda: torch.ops.quantized.linear_dynamic(x, packed, True), lambda: ours(x)):
                    keep("int8", 2 * 256 * 2048 * 2048 / _best_seconds(int8_linear), n)
    finally:
        torch.set_num_threads(before)
    return Rates(
        bandwidth={size: best[f"bw{size}"][0] for size in working_sets},
        fp32_flops=best["fp32"][0],
        int8_ops=best["int8"][0],
        threads={k: n for k, (_, n) in best.items()},
        bf16_flops=best["bf16"][0],
    )


def by_precision(rates: Rates, seconds: Callable[..., float]) -> dict[int, float]:
    """``seconds(weight_bytes=b)`` (a floor function with its other arguments bound) for fp32 and int8 weights, and
    bf16 where its GEMM rate was measured."""
    return {b: seconds(weight_bytes=b) for b in (FP32, INT8, BF16) if b != BF16 or rates.bf16_flops > 0}


def decoder_weights(family: str, dims: Dims = TOY) -> int:
    """Weights one decoding step multiplies by (per row), lm_head included."""
    per_layer = dims.self_attn + dims.ffn + (dims.cross_decode if family == "seq2seq" else 0)
    return dims.layers * per_layer + dims.lm_head


def decode_floor(family: str, batch: int, beams: int, input_len: int, new_tokens: int, rates: Rates,
                 weight_bytes: int, dims: Dims = TOY) -> float:
    """Seconds no engine can beat for one cell (prefill/encoding included); ``weight_bytes`` 4, 2 or 1."""
    d, layers, per_layer = dims.d_model, dims.layers, dims.self_attn + dims.ffn
    rows = batch * max(beams, 1)
    weights = decoder_weights(family, dims)
    flop_rate, attention_rate = rates.compute_rate(weight_bytes), rates.attention_rate(weight_bytes)
    step_bytes = weights * weight_bytes
    bandwidth = rates.read_rate(step_bytes)
    # Attention multiplies 4 * d per (query, key) pair (scores and weighted values), as in encoder_floor and the steps
    if family == "causal_lm":  # prefill: every prompt token through the layers (causal pairs), lm_head on the last one
        pairs = input_len * (input_len + 1) // 2
        first = (2 * batch * (input_len * layers * per_layer + dims.lm_head) / flop_rate
                 + batch * layers * 4 * d * pairs / attention_rate)
        steps = [(input_len + t + 1, 0) for t in range(new_tokens - 1)]  # (self K/V length, cross length)
    else:  # encoder (every pair of source tokens), the cross K/V projections, then a decoder step per new token
        first = (2 * batch * input_len * layers * (per_layer + 2 * d * d) / flop_rate
                 + batch * layers * 4 * d * input_len**2 / rates.attention_rate(weight_bytes, encoder=True))
        steps = [(t + 1, input_len) for t in range(new_tokens)]
    seconds = max(first, (layers * per_layer * weight_bytes) / bandwidth)
    for t, (self_len, cross_len) in enumerate(steps):
        live = batch if t == 0 and family == "seq2seq" else rows  # beams expand after the first step
        kv_bytes = layers * 2 * FP32 * (dims.kv * live * self_len + d * batch * cross_len)
        compute = 2 * live * weights / flop_rate + layers * 4 * d * live * (self_len + cross_len) / attention_rate
        seconds += max((step_bytes + kv_bytes) / bandwidth, compute)
    return seconds


def classifier_floor(batch: int, length: int, rates: Rates, weight_bytes: int, dims: Dims = TOY) -> float:
    """Seconds for one forward of ``batch`` sequences of ``length`` tokens."""
    return encoder_floor([length] * batch, rates, weight_bytes, dims)


def encoder_floor(lengths: list[int], rates: Rates, weight_bytes: int, dims: Dims = TOY) -> float:
    """Seconds for one encoder forward of sequences of ``lengths`` tokens (their own tokens: padding is work an
    engine may skip), the weights read once."""
    weights = dims.layers * (dims.self_attn + dims.ffn)
    compute = (2 * sum(lengths) * weights / rates.compute_rate(weight_bytes)
               + dims.layers * 4 * dims.d_model * sum(n * n for n in lengths)
               / rates.attention_rate(weight_bytes, encoder=True))
    nbytes = weights * weight_bytes
    return max(compute, nbytes / rates.read_rate(nbytes))


__all__ = ["BF16", "FP32", "INT8", "TOY", "BandwidthProbe", "Dims", "Rates", "by_precision", "classifier_floor",
           "decode_floor",
           "decoder_weights", "encoder_floor", "measure_rates"]
