// The Python module of model/kernels (built and loaded by model/native.py).
#include <torch/extension.h>

#include "kernels.h"

// The computing functions release the GIL (as PyTorch's own ops do), so the service's event loop and other
// Python threads run while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  module.def("has_vnni", &has_vnni, "whether this CPU has AVX512-VNNI (int8_linear)");
  module.def("int8_linear", &int8_linear, "int8 linear: x float32 (..., in) -> (..., out) float32", release());
  module.def("has_avx512", &has_avx512, "whether this CPU has AVX-512 F/BW/VL/DQ (decode_attention)");
  module.def("decode_attention", &decode_attention, "attention of a few queries per head over a KV cache, float32",
             release());
  module.def("few_rows_linear", &few_rows_linear, "float32 linear of a few rows over input-major weights (else at::linear)",
             release());
  module.def("pack_weight", &pack_weight, "an (N, K) float32 weight as (ceil(N / 32), K, 32) panels", release());
  module.def("packed_linear", &packed_linear, "float32 linear over pack_weight's panels: x (..., K) -> (..., n)",
             release());
  module.def("greedy_pick", &greedy_pick, "greedy choice per row: (first argmax outside banned, its log-prob)", release());
  module.def("rows_layer_norm", &rows_layer_norm, "LayerNorm over the last dim (the native step's)", release());
  module.def("rows_activate_", &rows_activate_, "ReLU (0), GELU (1), GELU tanh (2), SiLU (3) in place", release());
  module.def("rows_add_", &rows_add_, "y += x in place", release());
  module.def("rows_cache_write", &rows_cache_write, "cache[:, :, position] = src (B, H, 1, Dh)", release());
  module.def("lora_delta_add_", &lora_delta_add_, "y += ((x A^T) * scales) B^T in place (LoRA deltas)", release());
  module.def("decode_layers", &decode_layers, "one decoding step through every decoder layer (model/fast_step.py)",
             release());
}
