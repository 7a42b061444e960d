// The kernels' entry points, declared once: bindings.cpp exports them to Python, and the kernels that call
// each other (decode_step.cpp's layer loop, the CPU feature checks) include this instead of repeating them.
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

bool has_vnni();
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                          const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias);
bool has_avx512();
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask);
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);
torch::Tensor pack_weight(const torch::Tensor& weight);
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias);
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(const torch::Tensor& logits, const std::vector<int64_t>& banned);
torch::Tensor rows_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps);
torch::Tensor rows_activate_(torch::Tensor h, int64_t activation);
torch::Tensor rows_add_(torch::Tensor y, const torch::Tensor& x);
void rows_cache_write(const torch::Tensor& cache, int64_t position, const torch::Tensor& src);
void lora_delta_add_(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                     const torch::Tensor& scales);
torch::Tensor decode_layers(torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& projections,
                            const std::vector<std::vector<torch::Tensor>>& deltas, const std::vector<torch::Tensor>& panels,
                            const std::vector<torch::Tensor>& norms, const std::vector<double>& eps,
                            const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                            const std::vector<torch::Tensor>& cross_keys, const std::vector<torch::Tensor>& cross_values,
                            int64_t heads, bool pre_norm, int64_t activation, int64_t start, int64_t visible,
                            const torch::Tensor& write_positions, const torch::Tensor& self_mask,
                            const torch::Tensor& memory_mask, int64_t group);
