// int8 x int8 linear layers: the int8 path's GEMM for every batch size (model/int8_kernel.py).
//
// y = sx * sw * (xq - 128) . w + bias, where
//   w   int8 weights, one scale sw per output channel (symmetric, |w| <= 127), packed as
//       [out / 16][in / 4][16][4]: one 64-byte load holds 4 consecutive inputs of 16 outputs, so
//       `vpdpbusd` accumulates 16 outputs at once without horizontal sums (out and in zero-padded);
//   xq  each activation row quantised on the fly to uint8 around 128, scale sx = max|x| / 127, so a
//       row's result does not depend on the other rows of its batch;
//   the -128 offset is undone with the weights' row sums (w_sum * 128).
// Rows are tiled 4 at a time against 4 blocks of 16 outputs (16 accumulators); tiles are spread over
// ATen's intra-op threads (the process's one OpenMP pool).
// A product of a few rows (decoding: greedy, beams, small batches) streams its weights from memory once: tiles of 1-8
// rows against one block at a time, so the weights are read in order, one sequential stream (docs/benchmarks.md,
// "The int8 GEMM at a few rows").
// The tiles run on AVX512-VNNI (int8_tiles.cpp) or, on CPUs without it (or with the kernels capped at 256-bit vectors,
// PanelTuning.vector_bits), on their AVX2 twins (int8_tiles_avx2.cpp: the same int32 sums by another route, so the
// same outputs); other CPUs get has_int8_kernel() false and the fbgemm path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "int8_tiles.h"
#include "kernels.h"

#include <algorithm>
#include <vector>

using namespace tserve::int8;

namespace {

// The tile set this call runs: VNNI's, else the AVX2 twins (the same values).
bool vnni_tiles() {
  static const bool vnni = has_vnni();
  return vnni && wide_vectors();
}

void quantize_row(const float* x, int64_t k, int64_t k_padded, uint8_t* q, float* scale) {
  vnni_tiles() ? vnni::quantize_row(x, k, k_padded, q, scale) : avx2::quantize_row(x, k, k_padded, q, scale);
}

void rows(const Problem& p, int64_t blk0, int64_t blk1, int64_t begin, int64_t end) {
  vnni_tiles() ? vnni::rows(p, blk0, blk1, begin, end) : avx2::rows(p, blk0, blk1, begin, end);
}

void check_weights(const torch::Tensor& packed, const torch::Tensor& w_scale, const torch::Tensor& w_sum,
                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(has_int8_kernel(), "int8 kernel: this CPU has neither AVX512-VNNI nor AVX2");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 4 && packed.is_contiguous() &&
              packed.scalar_type() == at::kChar, "int8 kernel: packed weights must be int8 [out/16][in/4][16][4]");
  const int64_t n = w_scale.size(0), blocks = packed.size(0);
  TORCH_CHECK(n <= blocks * 16 && n > blocks * 16 - 16 && w_sum.size(0) == n, "int8 kernel: scale/sum sizes");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_sum.scalar_type() == at::kInt && w_scale.is_contiguous() &&
              w_sum.is_contiguous(), "int8 kernel: w_scale float32, w_sum int32, contiguous");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->size(0) == n),
              "int8 kernel: bias must be float32 (out,)");
}

// A gated FFN's gate and up projections: each as check_weights wants it, the two of one shape.
void check_gated(const torch::Tensor& packed, const torch::Tensor& w_scale, const torch::Tensor& w_sum,
                 const c10::optional<torch::Tensor>& bias, const torch::Tensor& up_packed, const torch::Tensor& up_scale,
                 const torch::Tensor& up_sum, const c10::optional<torch::Tensor>& up_bias) {
  check_weights(packed, w_scale, w_sum, bias);
  check_weights(up_packed, up_scale, up_sum, up_bias);
  TORCH_CHECK(up_packed.sizes() == packed.sizes() && up_scale.size(0) == w_scale.size(0),
              "int8 kernel: the gate and up projections must have one shape");
}

// Rows already quantised for the weights `packed`: xq (rows, in padded to 4) uint8, sx (rows,) float32.
void check_quantized(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& packed) {
  TORCH_CHECK(xq.scalar_type() == at::kByte && xq.dim() == 2 && xq.is_contiguous() && xq.size(1) == packed.size(1) * 4,
              "int8 kernel: xq must be contiguous uint8 (rows, in padded to 4)");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.dim() == 1 && sx.size(0) == xq.size(0),
              "int8 kernel: sx must be float32 (rows,)");
}

// x (m, k) float32 -> its rows quantised (m, k_padded) uint8 around 128 and their scales (m,).
// The same into caller-owned xq and sx: the m rows of k features at xp.
void quantize_rows_into(const float* xp, int64_t m, int64_t k, int64_t k_padded, uint8_t* xqp, float* sxp) {
  at::parallel_for(0, m, kRowChunk, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, k, k_padded, xqp + r * k_padded, sxp + r);
  });
}

std::tuple<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x2, int64_t k_padded) {
  const int64_t m = x2.size(0), k = x2.size(1);
  torch::Tensor xq = torch::empty({m, k_padded}, x2.options().dtype(at::kByte));
  torch::Tensor sx = torch::empty({m}, x2.options());
  quantize_rows_into(x2.data_ptr<float>(), m, k, k_padded, xq.data_ptr<uint8_t>(), sx.data_ptr<float>());
  return {xq, sx};
}

Problem problem(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& packed,
                const torch::Tensor& w_scale, const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias,
                float* out, int64_t activation) {
  return Problem{xq.data_ptr<uint8_t>(), sx.data_ptr<float>(), packed.data_ptr<int8_t>(), w_scale.data_ptr<float>(),
                 w_sum.data_ptr<int32_t>(), bias.has_value() ? bias->data_ptr<float>() : nullptr, out, 0,
                 xq.size(0), w_scale.size(0), packed.size(1) * 4, packed.size(0), activation,
                 xq.size(0) <= kStreamingRows};
}

// The product of a gated FFN (check_gated's gate and up weights) over the quantised rows xq, sx: each tile reads a
// block of the gate and the same block of up side by side.
Problem gated_problem(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& packed,
                      const torch::Tensor& w_scale, const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias,
                      const torch::Tensor& up_packed, const torch::Tensor& up_scale, const torch::Tensor& up_sum,
                      const c10::optional<torch::Tensor>& up_bias, Activation activation) {
  Problem whole = problem(xq, sx, packed, w_scale, w_sum, bias, nullptr, activation);
  whole.w_up = up_packed.data_ptr<int8_t>(), whole.sw_up = up_scale.data_ptr<float>();
  whole.w_sum_up = up_sum.data_ptr<int32_t>(), whole.bias_up = up_bias.has_value() ? up_bias->data_ptr<float>() : nullptr;
  return whole;
}

// The whole (m, n) product into p.out: tasks of (row chunk, group of 4 blocks) over the intra-op threads.
void gemm(const Problem& p) {
  const int64_t groups = (p.blocks + 3) / 4, chunks = (p.m + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {  // the task's groups of one row chunk at a time: one run of blocks
      const int64_t chunk = i / groups, last = std::min(end, (chunk + 1) * groups), row = chunk * kRowChunk;
      rows(p, (i % groups) * 4, std::min(p.blocks, (last - chunk * groups) * 4), row, std::min(p.m, row + kRowChunk));
      i = last;
    }
  });
}

torch::Tensor gemm_float(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& packed,
                         const torch::Tensor& w_scale, const torch::Tensor& w_sum,
                         const c10::optional<torch::Tensor>& bias, int64_t activation) {
  torch::Tensor out = torch::empty({xq.size(0), w_scale.size(0)}, sx.options());
  gemm(problem(xq, sx, packed, w_scale, w_sum, bias, out.data_ptr<float>(), activation));
  return out;
}

torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                        const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias, int64_t activation) {
  check_weights(packed, w_scale, w_sum, bias);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "int8 kernel: x must be float32 on the CPU");
  const int64_t k_padded = packed.size(1) * 4;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) <= k_padded && x.size(-1) > k_padded - 4,
              "int8 kernel: x has ", x.size(-1), " features, the weights ", k_padded, " (padded)");
  auto [xq, sx] = quantize_rows(x.reshape({-1, x.size(-1)}).contiguous(), k_padded);
  torch::Tensor out = gemm_float(xq, sx, packed, w_scale, w_sum, bias, activation);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w_scale.size(0);
  return out.view(sizes);
}

// x (rows, in) float32 -> its rows quantised for `packed` (uint8 rows padded to 4, scales).
std::tuple<torch::Tensor, torch::Tensor> quantize_input(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "int8 kernel: x must be float32 (rows, in) on the CPU");
  const int64_t k_padded = packed.size(1) * 4;
  TORCH_CHECK(x.size(-1) <= k_padded && x.size(-1) > k_padded - 4,
              "int8 kernel: x has ", x.size(-1), " features, the weights ", k_padded, " (padded)");
  return quantize_rows(x.contiguous(), k_padded);
}

// p's (m, n) product (p.out unset) as the next int8 GEMM's input: rows quantised (m, round_up(n, 4)) uint8 and their
// scales (m,), the same bytes as quantising the float product. With as many row chunks as threads, each task computes
// one chunk's (64, n) floats into a scratch that stays in L2 and quantises them there, so the float product never goes
// to memory (a FeedForward's (rows, d_ff) hidden state: written once, read back once before); with fewer (a few rows),
// the float product then one pass (inline: under a chunk of rows, no second parallel region).
// Into caller-owned hq (m, round_up(n, 4)) uint8 and hs (m,) float32.
void gemm_quantized_into(const Problem& whole, const torch::TensorOptions& options, const torch::Tensor& hq,
                         const torch::Tensor& hs) {
  const int64_t m = whole.m, n = whole.n, n_padded = (n + 3) / 4 * 4, chunks = (m + kRowChunk - 1) / kRowChunk;
  if (chunks < at::get_num_threads()) {
    torch::Tensor out = torch::empty({m, n}, options);
    Problem p = whole;
    p.out = out.data_ptr<float>();
    gemm(p);
    quantize_rows_into(out.data_ptr<float>(), m, n, n_padded, hq.data_ptr<uint8_t>(), hs.data_ptr<float>());
    return;
  }
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;  // the pool's threads persist: allocated (and zeroed) once per size
    if (scratch.size() < static_cast<size_t>(kRowChunk * n)) scratch.resize(kRowChunk * n);
    Problem p = whole;
    p.out = scratch.data();
    for (int64_t c = begin; c < end; ++c) {
      const int64_t row = c * kRowChunk, row_end = std::min(m, row + kRowChunk);
      p.out_row0 = row;
      rows(p, 0, p.blocks, row, row_end);
      for (int64_t r = row; r < row_end; ++r)
        quantize_row(scratch.data() + (r - row) * n, n, n_padded, hq.data_ptr<uint8_t>() + r * n_padded,
                     hs.data_ptr<float>() + r);
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> gemm_quantized(const Problem& whole, const torch::TensorOptions& options) {
  const int64_t m = whole.m, n_padded = (whole.n + 3) / 4 * 4;
  torch::Tensor hq = torch::empty({m, n_padded}, options.dtype(at::kByte));
  torch::Tensor hs = torch::empty({m}, options);
  gemm_quantized_into(whole, options, hq, hs);
  return {hq, hs};
}

}  // namespace

bool has_int8_kernel() { return has_vnni() || has_avx2(); }

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                          const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias) {
  return int8_gemm(x, packed, w_scale, w_sum, bias, kNoActivation);
}

// activation(int8_linear(...)), applied to each output vector in registers before it is stored: a FeedForward's fc1
// without the separate pass over its (rows, d_ff) output (the same float operations, so the same values).
torch::Tensor int8_linear_activated(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                                    const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias,
                                    Activation activation) {
  return int8_gemm(x, packed, w_scale, w_sum, bias, activation);
}

// int8_linear_activated's output as the next int8 GEMM's input: its rows quantised (m, round_up(out, 4)) uint8 and
// their scales (m,), the same bytes as quantising the float output (gemm_quantized).
std::tuple<torch::Tensor, torch::Tensor> int8_linear_activated_quantized(
    const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale, const torch::Tensor& w_sum,
    const c10::optional<torch::Tensor>& bias, Activation activation) {
  check_weights(packed, w_scale, w_sum, bias);
  auto [xq, sx] = quantize_input(x, packed);
  return gemm_quantized(problem(xq, sx, packed, w_scale, w_sum, bias, nullptr, activation), x.options());
}

// A gated FFN's hidden rows, activation(x gate^T + b) * (x up^T + b'), quantised for fc2 as
// int8_linear_activated_quantized's are: x quantised once, each tile reading a block of the gate and the same block of
// up side by side (one pass over both weights, one parallel region), the product formed in registers. The same bytes
// as quantising rows_mul_(rows_activate_(int8_linear(x, gate)), int8_linear(x, up)).
std::tuple<torch::Tensor, torch::Tensor> int8_gated_quantized(
    const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale, const torch::Tensor& w_sum,
    const c10::optional<torch::Tensor>& bias, const torch::Tensor& up_packed, const torch::Tensor& up_scale,
    const torch::Tensor& up_sum, const c10::optional<torch::Tensor>& up_bias, Activation activation) {
  check_gated(packed, w_scale, w_sum, bias, up_packed, up_scale, up_sum, up_bias);
  auto [xq, sx] = quantize_input(x, packed);
  return gemm_quantized(gated_problem(xq, sx, packed, w_scale, w_sum, bias, up_packed, up_scale, up_sum, up_bias,
                                      activation), x.options());
}

// int8_linear of rows already quantised: xq (rows, in padded to 4) uint8 and sx (rows,) float32, as
// int8_linear_activated_quantized returns them -> (rows, out) float32.
torch::Tensor int8_linear_quantized(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& packed,
                                    const torch::Tensor& w_scale, const torch::Tensor& w_sum,
                                    const c10::optional<torch::Tensor>& bias) {
  check_weights(packed, w_scale, w_sum, bias);
  check_quantized(xq, sx, packed);
  return gemm_float(xq, sx, packed, w_scale, w_sum, bias, kNoActivation);
}

// The decoding step's entry points into caller-owned buffers (decode_step.cpp's workspace, reused across layers and
// steps instead of allocated per call): the same bytes as int8_linear, int8_gated_quantized and int8_linear_quantized.

namespace {

// x contiguous float32 (..., in) and the scratch for its quantised rows: xq (rows, in padded) uint8, sx (rows,).
void check_rows_into(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& xq, const torch::Tensor& sx) {
  const int64_t k_padded = packed.size(1) * 4, m = x.dim() ? x.numel() / std::max<int64_t>(x.size(-1), 1) : 0;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous() &&
              x.size(-1) <= k_padded && x.size(-1) > k_padded - 4, "int8 kernel: x must be contiguous float32 (..., in)");
  TORCH_CHECK(xq.scalar_type() == at::kByte && xq.is_contiguous() && xq.dim() == 2 && xq.size(0) == m &&
              xq.size(1) == k_padded && sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.numel() == m,
              "int8 kernel: xq must be uint8 (rows, in padded), sx float32 (rows,)");
}

// out: contiguous float32 of rows x n elements.
void check_out(const torch::Tensor& out, int64_t rows, int64_t n) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() >= 1 && out.size(-1) == n &&
              out.numel() == rows * n, "int8 kernel: out must be contiguous float32 (rows, out)");
}

}  // namespace

void int8_linear_out(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                     const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias, const torch::Tensor& out,
                     const torch::Tensor& xq, const torch::Tensor& sx) {
  check_weights(packed, w_scale, w_sum, bias);
  check_rows_into(x, packed, xq, sx);
  check_out(out, xq.size(0), w_scale.size(0));
  quantize_rows_into(x.data_ptr<float>(), xq.size(0), x.size(-1), xq.size(1), xq.data_ptr<uint8_t>(), sx.data_ptr<float>());
  gemm(problem(xq, sx, packed, w_scale, w_sum, bias, out.data_ptr<float>(), kNoActivation));
}

void int8_gated_quantized_out(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                              const torch::Tensor& w_sum, const c10::optional<torch::Tensor>& bias,
                              const torch::Tensor& up_packed, const torch::Tensor& up_scale, const torch::Tensor& up_sum,
                              const c10::optional<torch::Tensor>& up_bias, Activation activation, const torch::Tensor& xq,
                              const torch::Tensor& sx, const torch::Tensor& hq, const torch::Tensor& hs) {
  check_gated(packed, w_scale, w_sum, bias, up_packed, up_scale, up_sum, up_bias);
  check_rows_into(x, packed, xq, sx);
  const int64_t m = xq.size(0), n_padded = (w_scale.size(0) + 3) / 4 * 4;
  TORCH_CHECK(hq.scalar_type() == at::kByte && hq.is_contiguous() && hq.dim() == 2 && hq.size(0) == m &&
              hq.size(1) == n_padded && hs.scalar_type() == at::kFloat && hs.is_contiguous() && hs.numel() == m,
              "int8 kernel: hq must be uint8 (rows, out padded to 4), hs float32 (rows,)");
  quantize_rows_into(x.data_ptr<float>(), m, x.size(-1), xq.size(1), xq.data_ptr<uint8_t>(), sx.data_ptr<float>());
  gemm_quantized_into(gated_problem(xq, sx, packed, w_scale, w_sum, bias, up_packed, up_scale, up_sum, up_bias,
                                    activation), x.options(), hq, hs);
}

void int8_linear_quantized_out(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& packed,
                               const torch::Tensor& w_scale, const torch::Tensor& w_sum,
                               const c10::optional<torch::Tensor>& bias, const torch::Tensor& out) {
  check_weights(packed, w_scale, w_sum, bias);
  check_quantized(xq, sx, packed);
  check_out(out, xq.size(0), w_scale.size(0));
  gemm(problem(xq, sx, packed, w_scale, w_sum, bias, out.data_ptr<float>(), kNoActivation));
}
