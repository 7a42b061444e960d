// The Python module of model/kernels (built and loaded by model/native.py).
#include <torch/extension.h>

bool has_vnni();
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                          const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias);
bool has_avx512();
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("has_vnni", &has_vnni, "whether this CPU has AVX512-VNNI (int8_linear)");
  module.def("int8_linear", &int8_linear, "int8 linear: x float32 (..., in) -> (..., out) float32");
  module.def("has_avx512", &has_avx512, "whether this CPU has AVX-512 F/BW/VL/DQ (decode_attention)");
  module.def("decode_attention", &decode_attention, "attention of a few queries per head over a KV cache, float32");
}
