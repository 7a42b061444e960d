"""benchmarks/floor.py measures our bf16 GEMM beside fp32's and int8's (issue 40)."""

import pytest

from benchmarks import floor


def test_the_rates_include_our_bf16_gemm_and_keep_its_best():
    rates = floor.measure_rates([1 << 20], [1], linears=[(7, 40, 24)])
    assert rates.bf16_flops > 0 and rates.threads["bf16"] == 1

    slower = floor.Rates(rates.bandwidth, rates.fp32_flops, rates.int8_ops, dict(rates.threads), bf16_flops=1.0)
    assert slower.best_with(rates).bf16_flops == rates.bf16_flops == rates.best_with(slower).bf16_flops


def test_a_bf16_floor_reads_half_the_bytes_of_fp32_at_the_bf16_rate():
    rates = floor.Rates({1 << 20: 10e9}, fp32_flops=1e12, int8_ops=4e12, threads={}, bf16_flops=2e12)
    one_step = [floor.decode_floor("causal_lm", 1, 0, 1, 2, rates, b) for b in (floor.FP32, floor.BF16, floor.INT8)]
    assert one_step[0] > one_step[1] > one_step[2]  # bandwidth-bound: 4, 2, 1 bytes a weight
    prefill = [floor.encoder_floor([512] * 64, rates, b) for b in (floor.FP32, floor.BF16, floor.INT8)]
    assert prefill[0] / prefill[1] == 2.0  # compute-bound: bf16 encoders' attention rounds its inputs to bf16 too
    assert 1.0 < prefill[1] / prefill[2] < 2.0  # int8's attention runs at float32's rate, its weights' at int8's


def test_attention_runs_at_float32s_rate_whatever_the_weights_are():
    """A prompt's (query, key) pairs cost as much time under int8 and bf16 weights as under float32 ones: their
    operands are activations and the float32 K/V cache, not weights (Rates.attention_rate)."""
    rates = floor.Rates({1 << 20: 1e30}, fp32_flops=1e12, int8_ops=4e12, threads={}, bf16_flops=2e12)
    pair = floor.TOY.layers * 4 * floor.TOY.d_model / rates.fp32_flops  # seconds a causal (query, key) pair takes

    def prefill(tokens: int, weight_bytes: int) -> float:  # compute-bound: no read time
        return floor.decode_floor("causal_lm", 1, 1, tokens, 1, rates, weight_bytes)

    extra_pairs = 64 * 65 // 2 - 2 * (32 * 33 // 2)  # the pairs a 64-token prompt has beyond two 32-token ones'
    for weight_bytes in (floor.FP32, floor.BF16, floor.INT8):
        head = 2 * floor.TOY.lm_head / rates.compute_rate(weight_bytes)  # one head product fewer than two prompts'
        assert prefill(64, weight_bytes) - 2 * prefill(32, weight_bytes) == pytest.approx(
            extra_pairs * pair - head, rel=1e-9), weight_bytes
