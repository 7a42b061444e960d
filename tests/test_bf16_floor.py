"""benchmarks/floor.py measures our bf16 GEMM beside fp32's and int8's (issue 40)."""

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
    assert prefill[0] / prefill[1] == 2.0 == prefill[1] / prefill[2]  # compute-bound: the three GEMM rates
