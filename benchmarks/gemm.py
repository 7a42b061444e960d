"""The linear layers of the served shapes, kernel by kernel: `python -m benchmarks.gemm`.

Each weight shape of BERT-base / GPT-2 small (768 x 768, 768 -> 3072, 3072 -> 768) and OPUS-MT (512 x 512,
512 -> 2048, 2048 -> 512) at 1 to 1024 rows, float32: MKL through ``F.linear`` on the weight as the service
stores it (input-major, model/layout.py), our kernels through ``model.kernel_layers.linear`` (the few-rows
GEMV up to 4 rows, the panel GEMM over a packed copy beyond), and ONNX Runtime's MatMul + Add (MLAS, its
weights prepacked at session start) when onnxruntime is installed. int8: our ``Int8Linear`` against ONNX
Runtime's dynamically quantized MatMul (``quantize_dynamic``). The engines alternate in rotating order;
medians of microseconds per call and each one's rate against MKL from the same run. Outputs are checked
against a float64 reference first (int8: against the float32 product, loosely).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import machine_line, markdown_table
from model.int8_linear import Int8Linear
from model.kernel_layers import linear
from model.layout import input_major

WEIGHTS = [(768, 768), (768, 3072), (3072, 768), (512, 512), (512, 2048), (2048, 512)]  # (in, out)
ROWS = [1, 4, 16, 64, 256, 1024]

Call = Callable[[], object]


def ort_matmul(weight: torch.Tensor, bias: torch.Tensor, threads: int, int8: bool, folder: Path):
    """A one-node-pair ONNX Runtime session computing x W^T + b (x: "x" (rows, in)), or None without onnxruntime."""
    try:
        import onnx
        import onnxruntime
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    out_features, in_features = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", out_features])],
        [numpy_helper.from_array(weight.t().contiguous().numpy(), "W"), numpy_helper.from_array(bias.numpy(), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / f"linear-{in_features}-{out_features}.onnx"
    onnx.save(model, path)
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = path.with_suffix(".int8.onnx")
        quantize_dynamic(path, quantized, weight_type=QuantType.QInt8)
        path = quantized
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.force_spinning_stop", "1")  # as benchmarks/shape_engines.py
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def engines(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, sessions: dict) -> dict[str, Call]:
    stored = input_major(weight)
    calls: dict[str, Call] = {"MKL fp32": lambda: F.linear(x, stored, bias),
                              "ours fp32": lambda: linear(x, stored, bias)}
    feed = {"x": x.numpy()}
    if sessions.get("fp32") is not None:
        calls["ORT fp32"] = lambda: sessions["fp32"].run(["y"], feed)
    calls["ours int8"] = lambda: sessions["int8 ours"](x)
    if sessions.get("int8") is not None:
        calls["ORT int8"] = lambda: sessions["int8"].run(["y"], feed)
    return calls


def check(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, calls: dict[str, Call]) -> None:
    reference = x.double() @ weight.double().t() + bias.double()
    scale = reference.abs().max().item()
    for name, call in calls.items():
        got = call()
        got = torch.as_tensor(got[0] if isinstance(got, list) else got).double()
        error = (got - reference).abs().max().item() / scale
        assert error < (5e-2 if "int8" in name else 1e-5), f"{name}: relative error {error:.1e}"


def gemm_arguments(doc: str, weights: list[tuple[int, int]], rows: list[int]) -> argparse.ArgumentParser:
    """The GEMM benchmarks' options (this module's, benchmarks/bf16_gemm.py's) with their default shapes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per engine and cell")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads")
    parser.add_argument("--rows", type=int, nargs="+", default=rows, help="rows per call")
    parser.add_argument("--weights", nargs="+", default=[f"{i}:{o}" for i, o in weights],
                        help="weight shapes as IN:OUT (default: the served shapes')")
    return parser


def random_layer(in_features: int, out_features: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """(a generator seeded by the shape, for the inputs; a weight (out, in) of unit-variance outputs; a bias)."""
    generator = torch.Generator().manual_seed(in_features * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    return generator, weight, torch.randn(out_features, generator=generator)


def rated_cells(us: dict[str, float], base: float, names: list[str]) -> list[str]:
    """Each engine's microseconds and its rate against ``base`` (the first column's), "-" where it did not run."""
    return [f"{us[name]:.0f} ({base / us[name]:.2f}x)" if name in us else "-" for name in names]


def measure(calls: dict[str, Call], rounds: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each engine, the engines alternating in rotating order."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for call in calls.values():
        call()
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            for _ in range(repeats):
                calls[name]()
            times[name].append((time.perf_counter() - start) / repeats * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = gemm_arguments(__doc__, WEIGHTS, ROWS).parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line())
    headers = ["in -> out", "rows", "MKL fp32 us", "ours fp32", "ORT fp32", "ours int8", "ORT int8"]
    table = []
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():  # not inference_mode: packed copies need
        # weights whose changes can be seen (model/packed_weights.py)
        for in_features, out_features in (map(int, shape.split(":")) for shape in args.weights):
            generator, weight, bias = random_layer(in_features, out_features)
            sessions = {kind: ort_matmul(weight, bias, args.threads, kind == "int8", Path(folder))
                        for kind in ("fp32", "int8")}
            sessions["int8 ours"] = Int8Linear(weight, bias)
            for rows in args.rows:
                x = torch.randn(rows, in_features, generator=generator)
                calls = engines(weight, bias, x, sessions)
                check(weight, bias, x, calls)
                us = measure(calls, args.rounds, repeats=max(1, 2000 // rows))
                mkl = us["MKL fp32"]
                cells = rated_cells(us, mkl, headers[3:])
                table.append([f"{in_features} -> {out_features}", rows, f"{mkl:.0f}", *cells])
                print(" | ".join(str(c) for c in table[-1]), flush=True)
    print()
    print("microseconds per call (rate against MKL fp32 from the same run)")
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()
