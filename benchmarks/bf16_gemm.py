"""bf16 linear layers against our float32 and int8 ones: `python -m benchmarks.bf16_gemm`.

On the served FFN shapes (768 -> 3072, 3072 -> 768) at 1 to 512 rows: our float32 layers (``model.kernel_layers.
linear``: the few-rows GEMV up to 4 rows, the panel GEMM over a packed copy beyond), our bf16 ``Bf16Linear``
(model/kernels/bf16_linear.cpp: AVX512-BF16, else its AVX2 twin), its torch fallback (the bf16 operands upcast per
call), our ``Int8Linear``, and PyTorch's bf16 ``F.linear`` through oneDNN (x cast to bf16 in the call; its output
is rounded to bf16, so it is not the same numbers: shown for its speed). The engines alternate in rotating order
(``benchmarks.gemm.measure``); medians of microseconds per call and each one's rate against our float32 from the
same run. Outputs are checked first: bf16 layers against a float64 reference of the rounded operands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import machine_line, markdown_table
from benchmarks.gemm import Call, gemm_arguments, measure, random_layer, rated_cells
from model.bf16_linear import Bf16Linear, kernel
from model.int8_linear import Int8Linear
from model.kernel_layers import linear
from model.layout import input_major

WEIGHTS = [(768, 3072), (3072, 768)]  # (in, out)
ROWS = [1, 4, 16, 64, 512]
ENGINES = ["ours fp32", "ours bf16", "bf16 fallback", "ours int8", "torch bf16 (oneDNN)"]


def engines(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, layers: dict) -> dict[str, Call]:
    stored, wb = layers["stored"], layers["bf16 weight"]
    calls: dict[str, Call] = {"ours fp32": lambda: linear(x, stored, bias)}
    if layers["bf16"].backend == "kernel":
        calls["ours bf16"] = lambda: layers["bf16"](x)
    calls["bf16 fallback"] = lambda: layers["fallback"](x)
    calls["ours int8"] = lambda: layers["int8"](x)
    calls["torch bf16 (oneDNN)"] = lambda: F.linear(x.bfloat16(), wb)
    return calls


def check(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, calls: dict[str, Call]) -> None:
    """Each bf16 layer within 4e-6 of the rounded operands' float64 product; fp32 within 1e-5 of the float64."""
    rounded = x.bfloat16().double() @ weight.bfloat16().double().T + bias.double()
    exact = x.double() @ weight.double().T + bias.double()
    for name in ("ours fp32", "ours bf16", "bf16 fallback"):
        if name in calls:
            want = exact if name == "ours fp32" else rounded
            error = (calls[name]().double() - want).abs().max().item() / want.abs().max().item()
            assert error < (1e-5 if name == "ours fp32" else 4e-6), f"{name}: relative error {error:.1e}"


def main(argv: list[str] | None = None) -> None:
    args = gemm_arguments(__doc__, WEIGHTS, ROWS).parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"our bf16 kernel: {'yes' if kernel() is not None else 'no (the torch fallback only)'}")
    headers = ["in -> out", "rows", "ours fp32 us", *ENGINES[1:], "bf16 GFLOP/s"]
    table = []
    with torch.no_grad():  # not inference_mode: packed copies need weights whose changes can be seen
        for in_features, out_features in (map(int, shape.split(":")) for shape in args.weights):
            generator, weight, bias = random_layer(in_features, out_features)
            layers = {"stored": input_major(weight), "bf16 weight": weight.bfloat16(), "bf16": Bf16Linear(weight, bias),
                      "fallback": Bf16Linear(weight, bias, "torch"), "int8": Int8Linear(weight, bias)}
            for rows in args.rows:
                x = torch.randn(rows, in_features, generator=generator)
                calls = engines(weight, bias, x, layers)
                check(weight, bias, x, calls)
                us = measure(calls, args.rounds, repeats=max(1, 200 // rows))
                base = us["ours fp32"]
                cells = rated_cells(us, base, ENGINES[1:])
                best = us.get("ours bf16", us["bf16 fallback"])
                rate = 2 * rows * in_features * out_features / best / 1e3
                table.append([f"{in_features} -> {out_features}", rows, f"{base:.0f}", *cells, f"{rate:.0f}"])
                print(" | ".join(str(c) for c in table[-1]), flush=True)
    print()
    print("microseconds per call (rate against our fp32 from the same run)")
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()
