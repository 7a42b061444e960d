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
                               const c10::optional<torch::Tensor>& mask,
                               const std::vector<torch::Tensor>& prefix_blocks = {},
                               const c10::optional<torch::Tensor>& prefix_table = c10::nullopt, int64_t layer = 0);
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);
torch::Tensor pack_weight(const torch::Tensor& weight);
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias);
// packed_linear's blocking and prefetch rule (model.cpu.PanelTuning, the same fields): set once when the kernels load.
struct PanelTuning {
  int64_t row_block_bytes;
  int64_t prefetch_rows;
  int64_t streaming_tile_rows;
  int64_t streaming_prefetch_rows;
  bool streaming_into_l2;
  int64_t gemv_panels;
};
void set_panel_tuning(const PanelTuning& chosen);
PanelTuning panel_tuning();
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(const torch::Tensor& logits, const std::vector<int64_t>& banned);
torch::Tensor rows_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps);

// The native decoding step's contract with model/fast_step.py: bindings.cpp exports these enums by name
// (kernels.Activation, kernels.Slot, kernels.Norm), so Python never restates their values.
enum Activation : int64_t { kRelu, kGelu, kGeluTanh, kSilu };  // FeedForward's activations, by config name
enum Slot : int64_t { kQ, kK, kV, kOut, kCrossQ, kCrossOut, kFc1, kFc2, kQkv, kSlots };  // a layer's projections
enum Norm : int64_t { kSelfAttnNorm, kCrossAttnNorm, kFfnNorm, kNorms };  // a layer's LayerNorms

torch::Tensor rows_activate_(torch::Tensor h, Activation activation);
torch::Tensor rows_add_(torch::Tensor y, const torch::Tensor& x);
void rows_cache_write(const torch::Tensor& cache, int64_t position, const torch::Tensor& src);
bool rows_copy_windows(const std::vector<torch::Tensor>& buffers, const std::vector<int64_t>& targets,
                       const std::vector<int64_t>& sources, int64_t start, int64_t end);
void lora_delta_add_(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                     const torch::Tensor& scales);

using Tensors = std::vector<torch::Tensor>;

// One step's KV cache and masks (model.kv_cache.KVCache after begin_step), built per step.
// Most tokens per row one native step takes (a speculative draft plus the fed token; the attention kernel's own
// limit is 16 queries per head).
constexpr int64_t kMaxStepTokens = 16;

struct StepCache {
  Tensors keys, values;              // per layer: the cache buffers (B, H, capacity, Dh)
  Tensors cross_keys, cross_values;  // per layer: cross-attention's (B, H, S, Dh); empty without it
  int64_t start;                     // the position every row writes at (uniform rows)
  int64_t visible;                   // keys visible after the write
  c10::optional<torch::Tensor> write_positions;  // (B, t) per-row positions of ragged rows, instead of start
  c10::optional<torch::Tensor> self_mask, memory_mask;  // bool masks of self- and cross-attention
  int64_t group;                     // rows repeat their source in runs of `group` (beams)
  Tensors prefix_blocks;             // a shared prefix's blocks and block table (decode_attention.cpp); empty: none
  c10::optional<torch::Tensor> prefix_table;
};

// A decoder stack's weights as the native step reads them, bound once per decode plan. projections: per layer
// kSlots lists, {weight, bias} float32 or {packed, scales, sums, bias} int8 (an empty bias when absent), {} for
// a projection the layer has not (kQkv non-empty: the fused q/k/v projection is in use instead of kQ/kK/kV);
// norms: per layer kNorms lists {weight, bias}, {} without cross-attention; eps: per layer kNorms.
struct DecoderStack {
  std::vector<Tensors> projections;
  std::vector<Tensors> norms;
  std::vector<double> eps;
  int64_t heads;
  bool pre_norm;
  Activation activation;

  DecoderStack(std::vector<Tensors> projections, std::vector<Tensors> norms, std::vector<double> eps, int64_t heads,
               bool pre_norm, Activation activation);
  int64_t layers() const { return static_cast<int64_t>(eps.size()) / kNorms; }
  // x (B, 1, D) -> the stack's output before any final norm. deltas: none, or one list of LoRA deltas per
  // projection (empty where it adds none); panels: none, or one per projection (empty where it has none:
  // model/packed_weights.py).
  torch::Tensor step(torch::Tensor x, const StepCache& cache, const std::vector<Tensors>& deltas,
                     const Tensors& panels) const;
  // An encoder's forward (no cache, no cross-attention, no adapters) of x (B, T, D), T <= kMaxStepTokens: each
  // layer's queries attend to the rows' own keys under `mask` (the padding). keep_first: the last layer computes
  // the first position alone, attending to all (a [CLS] head): (B, 1, D).
  torch::Tensor encode(torch::Tensor x, const c10::optional<torch::Tensor>& mask, const Tensors& panels,
                       bool keep_first) const;
};
