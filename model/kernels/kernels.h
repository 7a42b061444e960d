// The kernels' entry points, declared once: bindings.cpp exports them to Python, and the kernels that call
// each other (decode_step.cpp's layer loop, the CPU feature checks) include this instead of repeating them.
#pragma once

#include <torch/extension.h>

#include <functional>
#include <tuple>
#include <vector>

bool has_vnni();
bool has_int8_kernel();  // AVX512-VNNI or AVX2 + FMA: int8_linear and its kin run
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                          const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias);
bool has_avx512();
// AVX2 and FMA: the 8-lane twins of the float32 kernels (avx2_math.h), for CPUs without AVX-512.
bool has_avx2();
// Whether this CPU runs the float32 kernels (the decoding step's, the panel GEMM): AVX-512, or AVX2 + FMA.
bool has_vector_kernels();
// Whether the kernels run their AVX-512 code: on an AVX-512 CPU unless the tuning's vector_bits caps them at 256
// (then, as on a CPU with AVX2 alone, their AVX2 twins: tests and benchmarks run both widths on one machine).
bool wide_vectors();
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask,
                               const std::vector<torch::Tensor>& prefix_blocks = {},
                               const c10::optional<torch::Tensor>& prefix_table = c10::nullopt, int64_t layer = 0,
                               const c10::optional<torch::Tensor>& beam_lead = c10::nullopt,
                               const c10::optional<torch::Tensor>& beam_shared = c10::nullopt);
torch::Tensor encoder_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const c10::optional<torch::Tensor>& mask);
// encoder_attention with bf16 products and float32 sums (encoder_attention_bf16.cpp; needs has_avx512_bf16()).
torch::Tensor encoder_attention_bf16(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const c10::optional<torch::Tensor>& mask);
// encoder_attention.cpp's key transposition (dims x tp, zero past rows), shared with prefill_attention.cpp.
void transpose_rows(const float* src, int64_t row, int64_t rows, int64_t dims, int64_t tp, float* dst);
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const c10::optional<torch::Tensor>& mask);
// prefill_attention's shapes (model.attention.prefill_rows reads them from the bindings): head dims a multiple of
// this (one p @ V pass each), at most this many keys (a per-thread row buffer and the transposed keys of a row).
constexpr int64_t kPrefillHeadDimMultiple = 32;
constexpr int64_t kPrefillMaxKeys = 8192;
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);
torch::Tensor pack_weight(const torch::Tensor& weight, const c10::optional<torch::Tensor>& out);
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
  int64_t vector_bits;  // the widest vectors the kernels may use: 512 (AVX-512 where the CPU has it) or 256 (AVX2)
  bool gemv_prefetch;   // tiles of 1-2 rows prefetch by the streaming rule (else they leave it to the hardware)
};
void set_panel_tuning(const PanelTuning& chosen);
PanelTuning panel_tuning();
// Panel rows a streaming tile of `rows` rows prefetches ahead under `rule`: streaming_prefetch_rows, none at 1-2 rows
// unless gemv_prefetch (packed_linear.cpp; bf16_linear.cpp's AVX2 twin too).
int64_t streaming_ahead(const PanelTuning& rule, int64_t rows);
bool has_avx512_bf16();
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const c10::optional<torch::Tensor>& bias);
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(const torch::Tensor& logits, const std::vector<int64_t>& banned);
std::tuple<torch::Tensor, torch::Tensor> beam_topk(const torch::Tensor& logits, const torch::Tensor& scores,
                                                   int64_t width, int64_t k, const std::vector<int64_t>& banned);
torch::Tensor rows_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps);
torch::Tensor rows_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool offset = false);
// The norms into y (x's shape, contiguous float32; undefined or unfit: a fresh tensor), returned: the decoding step's
// workspace (decode_step.cpp).
torch::Tensor rows_layer_norm_into(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                   double eps, torch::Tensor y);
torch::Tensor rows_rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool offset,
                                 torch::Tensor y);

// The native decoding step's contract with model/fast_step.py: bindings.cpp exports these enums by name
// (kernels.Activation, kernels.Slot, kernels.Norm), so Python never restates their values.
enum Activation : int64_t { kRelu, kGelu, kGeluTanh, kSilu };  // FeedForward's activations, by config name
// a layer's projections; kUp: a gated FFN's second input projection, fc2(act(fc1 x) * up(x))
enum Slot : int64_t { kQ, kK, kV, kOut, kCrossQ, kCrossOut, kFc1, kFc2, kQkv, kUp, kSlots };
// a layer's norms: before each sub-layer, after it (sandwich norms, Gemma 3), and of each head of q and k (Qwen3)
enum Norm : int64_t { kSelfAttnNorm, kCrossAttnNorm, kFfnNorm, kSelfAttnPostNorm, kFfnPostNorm, kQNorm, kKNorm, kNorms };

torch::Tensor rows_activate_(torch::Tensor h, Activation activation);
torch::Tensor int8_linear_activated(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                                    const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias,
                                    Activation activation);
std::tuple<torch::Tensor, torch::Tensor> int8_linear_activated_quantized(
    const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale, const torch::Tensor& w_sum,
    const c10::optional<torch::Tensor>& bias, Activation activation);
torch::Tensor int8_linear_quantized(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& packed,
                                    const torch::Tensor& w_scale, const torch::Tensor& w_sum,
                                    const c10::optional<torch::Tensor>& bias);
std::tuple<torch::Tensor, torch::Tensor> int8_gated_quantized(
    const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale, const torch::Tensor& w_sum,
    const c10::optional<torch::Tensor>& bias, const torch::Tensor& up_packed, const torch::Tensor& up_scale,
    const torch::Tensor& up_sum, const c10::optional<torch::Tensor>& up_bias, Activation activation);
// int8_linear, int8_gated_quantized and int8_linear_quantized into caller-owned buffers (the same bytes): x
// contiguous (..., in); xq (rows, in padded to 4) uint8 and sx (rows,) the scratch of x's quantised rows; out
// contiguous float32 (..., out); hq (rows, out padded to 4) uint8 and hs (rows,) the gated FFN's quantised rows.
void int8_linear_out(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                     const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias, const torch::Tensor& out,
                     const torch::Tensor& xq, const torch::Tensor& sx);
void int8_gated_quantized_out(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                              const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias,
                              const torch::Tensor& up_packed, const torch::Tensor& up_scale, const torch::Tensor& up_sum,
                              const c10::optional<torch::Tensor>& up_bias, Activation activation, const torch::Tensor& xq,
                              const torch::Tensor& sx, const torch::Tensor& hq, const torch::Tensor& hs);
void int8_linear_quantized_out(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& packed,
                               const torch::Tensor& w_scale, const torch::Tensor& w_sum,
                               const c10::optional<torch::Tensor>& bias, const torch::Tensor& out);
torch::Tensor rows_add_(torch::Tensor y, const torch::Tensor& x);
torch::Tensor rows_mul_(torch::Tensor y, const torch::Tensor& x);
void rows_rotate_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, double scale = 1.0);
void rows_rotate_rounded_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
void rows_head_rms_norm_(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool offset);
void rows_cache_write(const torch::Tensor& cache, int64_t position, const torch::Tensor& src);
bool rows_copy_windows(const std::vector<torch::Tensor>& buffers, const std::vector<int64_t>& targets,
                       const std::vector<int64_t>& sources, int64_t start, int64_t end);
void lora_delta_add_(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                     const torch::Tensor& scales);

using Tensors = std::vector<torch::Tensor>;

// One step's KV cache and masks (model.kv_cache.KVCache after begin_step), built per step.
// Most tokens per row one native step takes: a short prompt's prefill (model/fast_step.py's run_prefill: at 32-64
// tokens the step took SmolLM2's and Qwen2.5's prefill in 0.65-0.87 of the PyTorch layer path's time), or a
// speculative draft plus the fed token. An encoder's forward (DecoderStack::encode) takes rows of up to
// kMaxEncodeTokens (at 32-64 tokens in 0.89-0.98 of the layers' time at batch 1: docs/benchmarks.md, "The C++ encoder
// up to 64 tokens").
constexpr int64_t kMaxStepTokens = 64;
constexpr int64_t kMaxEncodeTokens = 64;

struct StepCache {
  Tensors keys, values;              // per layer: the cache buffers (B, H_kv, capacity, Dh)
  Tensors cross_keys, cross_values;  // per layer: cross-attention's (B, H, S, Dh); empty without it
  int64_t start;                     // the position every row writes at (uniform rows)
  int64_t visible;                   // keys visible after the write
  c10::optional<torch::Tensor> write_positions;  // (B, t) per-row positions of ragged rows, instead of start
  c10::optional<torch::Tensor> self_mask, memory_mask;  // masks of self- (bool, or float: added) and cross-attention
  int64_t group;                     // rows repeat their source in runs of `group` (beams)
  Tensors prefix_blocks;             // a shared prefix's blocks and block table (decode_attention.cpp); empty: none
  c10::optional<torch::Tensor> prefix_table;
  Tensors rotary_cos, rotary_sin;    // per rotary kind (DecoderStack::rotary): (B|1, t, R) at this step's positions
  c10::optional<torch::Tensor> window_mask;  // the self-attention mask of sliding-window layers (None: every key)
  // Beams: each row's first beam_shared[r] positions row beam_lead[r]'s, its run's first (int64 (B,) each;
  // decode_attention reads them there once); None: every row reads its own.
  c10::optional<torch::Tensor> beam_lead, beam_shared;
  // Cross-attention rows in runs of one source of different lengths (group 1): each row's run's first row (int64
  // (B,)), whose K/V copy every row of the run reads; None: every row its own.
  c10::optional<torch::Tensor> cross_lead;
};

// A decoder stack's weights as the native step reads them, bound once per decode plan. projections: per layer
// kSlots lists, {weight, bias} float32 or {packed, scales, sums, bias} int8 (an empty bias when absent), {} for
// a projection the layer has not (kQkv non-empty: the fused q/k/v projection, q then k then v, is in use instead
// of kQ/kK/kV; kUp non-empty: a gated FFN); norms: per layer kNorms lists, {weight, bias} a LayerNorm, {weight} an
// RMSNorm, {} where the layer has none (cross-attention, post norms, q/k norms); eps: per layer kNorms. kv_heads:
// K/V heads (grouped-query attention, 0: as heads); head_dim: 0 for d_model / heads; rotary: per layer, which of
// StepCache's cos/sin rotate its q and k at each row's positions (empty: no rotary positions); windowed: per layer,
// whether it attends under StepCache's window_mask (empty: none does); norm_offset: the RMSNorms scale by
// (1 + weight) (Gemma); query_scale: q multiplied by it after rotation (a scale of q.k other than 1/sqrt(Dh)), and
// cross-attention's q too.
struct DecoderStack {
  std::vector<Tensors> projections;
  std::vector<Tensors> norms;
  std::vector<double> eps;
  int64_t heads;
  bool pre_norm;
  Activation activation;
  int64_t kv_heads, head_dim;
  std::vector<int64_t> rotary;
  std::vector<bool> windowed;
  bool norm_offset;
  double query_scale;

  DecoderStack(std::vector<Tensors> projections, std::vector<Tensors> norms, std::vector<double> eps, int64_t heads,
               bool pre_norm, Activation activation, int64_t kv_heads = 0, int64_t head_dim = 0,
               std::vector<int64_t> rotary = {}, std::vector<bool> windowed = {}, bool norm_offset = false,
               double query_scale = 1.0);
  int64_t layers() const { return static_cast<int64_t>(eps.size()) / kNorms; }
  // x (B, 1, D) -> the stack's output before any final norm. deltas: none, or one list of LoRA deltas per
  // projection (empty where it adds none); panels: none, or one per projection (empty where it has none:
  // model/packed_weights.py).
  torch::Tensor step(torch::Tensor x, const StepCache& cache, const std::vector<Tensors>& deltas,
                     const Tensors& panels) const;
  // An encoder's forward (no cache, no cross-attention, no adapters) of x (B, T, D), T <= kMaxEncodeTokens: each
  // layer's queries attend to the rows' own keys under `mask` (the padding), through decode_attention, or through
  // `attention(q, k, v)` where given (the interpreter's: model/attention.py picks the kernel for longer rows, as the
  // layers do, so both paths give the same floats). keep_first: the last layer computes the first position alone,
  // attending to all (a [CLS] head): (B, 1, D).
  using Attention = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
  torch::Tensor encode(torch::Tensor x, const c10::optional<torch::Tensor>& mask, const Tensors& panels,
                       bool keep_first, const Attention& attention) const;
};
