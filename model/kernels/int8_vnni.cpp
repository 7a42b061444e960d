// int8 x int8 linear layers on AVX512-VNNI: the int8 path's GEMM for every batch size (model/int8_kernel.py).
//
// y = sx * sw * (xq - 128) . w + bias, where
//   w   int8 weights, one scale sw per output channel (symmetric, |w| <= 127), packed as
//       [out / 16][in / 4][16][4]: one 64-byte load holds 4 consecutive inputs of 16 outputs, so
//       `vpdpbusd` accumulates 16 outputs at once without horizontal sums (out and in zero-padded);
//   xq  each activation row quantised on the fly to uint8 around 128, scale sx = max|x| / 127, so a
//       row's result does not depend on the other rows of its batch;
//   the -128 offset is undone with the weights' row sums (w_sum * 128).
// Rows are tiled 4 at a time against 4 blocks of 16 outputs (16 accumulators); tiles are spread over
// ATen's intra-op threads (the process's one OpenMP pool). Only `has_vnni()` runs on other CPUs.
// A product of a few rows (decoding: greedy, beams, small batches) streams its weights from memory once: tiles of 1-8
// rows against one block at a time, so the weights are read in order, one sequential stream (docs/benchmarks.md,
// "The int8 GEMM at a few rows").
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "activation_math.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int64_t kRowChunk = 64;  // activation rows per task: their uint8 copy stays in L2 across blocks
// Products of up to this many rows read the weights (from memory) slower than their vpdpbusd run: they take their
// rows 1-8 at a time in one pass over the weights (tile_stream), block after block, one sequential stream (4 blocks
// side by side, 4 streams 9-24 KB apart, took a quarter longer at 1 row on Zen 4). Wider products are bound by their
// vpdpbusd: tiles of 4 rows x 4 blocks.
constexpr int64_t kStreamingRows = 16;
constexpr int64_t kSpanBlocks = 16;  // blocks of a few-row product whose sums are held before their outputs are stored

VNNI void quantize_row(const float* x, int64_t k, int64_t k_padded, uint8_t* q, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float m = _mm512_reduce_max_ps(amax);
  for (; i < k; ++i) m = std::max(m, std::fabs(x[i]));
  const float s = m > 0 ? m / 127.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  const __m512i offset = _mm512_set1_epi32(128);
  i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv)), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtusepi32_epi8(v));
  }
  for (; i < k; ++i) q[i] = static_cast<uint8_t>(std::nearbyint(x[i] * (1.f / s)) + 128);
  for (; i < k_padded; ++i) q[i] = 128;  // zero after the offset; the padded weights are zero too
  *scale = s;
}

struct Problem {
  const uint8_t* xq;   // (m, k_padded)
  const float* sx;     // (m,)
  const int8_t* w;     // packed
  const float* sw;     // (n,)
  const int32_t* w_sum;
  const float* bias;   // (n,) or null
  float* out;          // rows [out_row0, ...) of the (m, n) result, n floats apart
  int64_t out_row0;
  int64_t m, n, k_padded, blocks;
  int64_t activation;  // an Activation of each output vector before it is stored, or kNoActivation
  bool streaming;      // m <= kStreamingRows: rows 1-8 at a time, one block at a time (tile_stream)
  // A gated FFN's up projection (int8_gated_quantized), read side by side with the gate (w, sw, w_sum, bias; the
  // same shape): each output vector stored is activation(gate) * up. Null: one product.
  const int8_t* w_up = nullptr;
  const float* sw_up = nullptr;
  const int32_t* w_sum_up = nullptr;
  const float* bias_up = nullptr;
};

constexpr int64_t kNoActivation = -1;

// One step s of k (4 inputs) of a tile's rows against its NB blocks of each of its NM matrices, into acc. Ahead: bytes
// ahead of each stream to prefetch into L2 (0: none).
template <int MR, int NB, int NM, int Ahead>
VNNI inline __attribute__((always_inline)) void step(const int8_t* const (&w)[NM], int64_t stride,
                                                     const int32_t* const (&x)[MR], int64_t s,
                                                     __m512i (&acc)[MR][NM * NB]) {
  __m512i wv[NM * NB];
  if constexpr (Ahead > 0) {
    UNROLL for (int m = 0; m < NM; ++m)
      UNROLL for (int c = 0; c < NB; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w[m] + c * stride + s * 64 + Ahead), _MM_HINT_T1);
  }
  UNROLL for (int m = 0; m < NM; ++m)
    UNROLL for (int c = 0; c < NB; ++c) wv[m * NB + c] = _mm512_loadu_si512(w[m] + c * stride + s * 64);
  UNROLL for (int r = 0; r < MR; ++r) {
    const __m512i xb = _mm512_set1_epi32(x[r][s]);
    UNROLL for (int c = 0; c < NM * NB; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xb, wv[c]);
  }
}

// The int32 sums of rows [m0, m0 + MR) against output blocks [blk, blk + NB) (of each of the NM matrices) into sums.
// Every loop over rows and blocks is unrolled by force: GCC 12 -O3 leaves some of them rolled, so the MR x NB
// accumulators live on the stack and the tile runs at half the vpdpbusd rate (512 rows: 500-700 GOP/s rolled,
// 930-1,000 unrolled on a 1,040 GOP/s Zen core).
// Split: consecutive steps go to Split sets of accumulators, added at the end (int32 sums: exact in any order, so the
// same sums): independent vpdpbusd chains for a tile of a few rows against one block.
// Gated: NB blocks of the gate and the same NB of up (p.w_up) side by side, one quantised input for both.
template <int MR, int NB, int Split, int Ahead, bool Gated>
VNNI inline __attribute__((always_inline)) void tile_sums(const Problem& p, int64_t blk, int64_t m0,
                                                          __m512i (&sums)[MR][(Gated ? 2 : 1) * NB]) {
  constexpr int NM = Gated ? 2 : 1;  // weight matrices read side by side
  __m512i acc[Split][MR][NM * NB];
  UNROLL for (int j = 0; j < Split; ++j)
    UNROLL for (int r = 0; r < MR; ++r)
      UNROLL for (int c = 0; c < NM * NB; ++c) acc[j][r][c] = _mm512_setzero_si512();
  const int64_t steps = p.k_padded / 4, stride = steps * 64;
  const int8_t* w[NM];
  w[0] = p.w + blk * stride;
  if constexpr (Gated) w[NM - 1] = p.w_up + blk * stride;
  const int32_t* x[MR];
  UNROLL for (int r = 0; r < MR; ++r) x[r] = reinterpret_cast<const int32_t*>(p.xq + (m0 + r) * p.k_padded);
  int64_t s = 0;
  for (; s + Split <= steps; s += Split)
    UNROLL for (int j = 0; j < Split; ++j) step<MR, NB, NM, Ahead>(w, stride, x, s + j, acc[j]);
  for (; s < steps; ++s) step<MR, NB, NM, Ahead>(w, stride, x, s, acc[0]);
  UNROLL for (int j = 1; j < Split; ++j)
    UNROLL for (int r = 0; r < MR; ++r)
      UNROLL for (int c = 0; c < NM * NB; ++c) acc[0][r][c] = _mm512_add_epi32(acc[0][r][c], acc[j][r][c]);
  UNROLL for (int r = 0; r < MR; ++r)
    UNROLL for (int c = 0; c < NM * NB; ++c) sums[r][c] = acc[0][r][c];
}

// The outputs of rows [m0, m0 + MR) and blocks [blk, blk + NB) from their int32 sums: scaled, biased, activated and
// stored. Gated: activation(gate) * up, the float operations of an int8_linear of each, the activation pass over the
// gate's output and the product pass (elementwise.cpp's rows_activate_, rows_mul_), so the same values.
template <int MR, int NB, bool Gated>
VNNI inline __attribute__((always_inline)) void tile_store(const Problem& p, int64_t blk, int64_t m0,
                                                           const __m512i (&sums)[MR][(Gated ? 2 : 1) * NB]) {
  UNROLL for (int c = 0; c < NB; ++c) {
    const int64_t n0 = (blk + c) * 16;
    if (n0 >= p.n) break;
    const __mmask16 mask = p.n - n0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (p.n - n0)) - 1);
    const __m512 sw = _mm512_maskz_loadu_ps(mask, p.sw + n0);
    const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, p.w_sum + n0), 7);  // 128 * sum(w)
    const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0) : _mm512_setzero_ps();
    __m512 sw_up, bias_up;
    __m512i offset_up;
    if constexpr (Gated) {
      sw_up = _mm512_maskz_loadu_ps(mask, p.sw_up + n0);
      offset_up = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, p.w_sum_up + n0), 7);
      bias_up = p.bias_up ? _mm512_maskz_loadu_ps(mask, p.bias_up + n0) : _mm512_setzero_ps();
    }
    UNROLL for (int r = 0; r < MR; ++r) {
      const __m512 sx = _mm512_set1_ps(p.sx[m0 + r]);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][c], offset));
      __m512 y = _mm512_fmadd_ps(dot, _mm512_mul_ps(sw, sx), bias);
      if (p.activation != kNoActivation) y = tserve::activate(y, static_cast<Activation>(p.activation));
      if constexpr (Gated) {
        const __m512 up = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][NB + c], offset_up));
        y = _mm512_mul_ps(y, _mm512_fmadd_ps(up, _mm512_mul_ps(sw_up, sx), bias_up));
      }
      _mm512_mask_storeu_ps(p.out + (m0 + r - p.out_row0) * p.n + n0, mask, y);
    }
  }
}

// Rows [m0, m0 + MR) against output blocks [blk, blk + NB): their sums, then their outputs.
template <int MR, int NB, int Split = 1, int Ahead = 0, bool Gated = false>
VNNI void tile(const Problem& p, int64_t blk, int64_t m0) {
  __m512i sums[MR][(Gated ? 2 : 1) * NB];
  tile_sums<MR, NB, Split, Ahead, Gated>(p, blk, m0, sums);
  tile_store<MR, NB, Gated>(p, blk, m0, sums);
}

// Rows [m0, m0 + MR) against the group's (up to 4) blocks; gated: 2 blocks of each matrix at a time (16 accumulators
// at 4 rows, as tile<4, 4>).
template <int MR, bool Gated>
void tile_blocks(const Problem& p, int64_t blk, int64_t m0) {
  const int64_t nb = std::min<int64_t>(4, p.blocks - blk);
  if constexpr (Gated) {
    for (int64_t b = 0; b + 2 <= nb; b += 2) tile<MR, 2, 1, 0, true>(p, blk + b, m0);
    if (nb % 2) tile<MR, 1, 1, 0, true>(p, blk + nb - 1, m0);
    return;
  }
  switch (nb) {
    case 4: return tile<MR, 4>(p, blk, m0);
    case 3: return tile<MR, 3>(p, blk, m0);
    case 2: return tile<MR, 2>(p, blk, m0);
    default: return tile<MR, 1>(p, blk, m0);
  }
}

// Rows [m0, m0 + MR) of a few-row product, 1 <= MR <= 8, against blocks [blk0, blk1) (at most kSpanBlocks) one at a
// time (gated: one block of the gate and one of up), each block's weights one sequential stream (consecutive blocks are
// contiguous), consecutive steps split over up to 16 accumulators. The hardware prefetchers keep up with such a stream
// unaided up to 4 rows: 2-4 rows read at 0.88-1.0 of a plain read's rate and every software prefetch slowed them (1-4
// KB into L1 0-16%, 4-16 KB into L2 8-38%, both 15-25%, one line in 16 or 64 unchanged; 1-4 accumulator sets alike);
// 5-8 rows (up to 8 vpdpbusd a line, near the core's rate at the read rate) prefetch 8 KB ahead into L2 (none: 7-8%
// slower at 5-6 rows): 8 rows then read and compute at once, the stream as fast as the same loop on weights in cache, a
// fifth faster than 4 KB into L1 (which let the dot products wait on the stream). 9-16 rows (8, then the rest over the
// span from L2) run within 3-5% of the same loop on weights in cache, at the wide GEMM's rate a row: bound by their
// vpdpbusd, which no distance or chunking (6 + 6) moved (docs/benchmarks.md, "The int8 GEMM at a few rows",
// "Prefetching into L2", "Prefetching at 2-4 and 9-16 int8 rows"). The span's outputs are stored after all its sums: a
// block's float epilogue (an activation: tens of instructions a row) waits on the block's last weights and, run between
// two blocks' loops, stalled the stream (no loads while it ran, the next block's starting again at memory latency):
// SmolLM2-135M's gated FFN at 8 rows took 27% less time with its outputs stored a span at a time than a block at a time
// (4 rows 15%).
template <int MR, bool Gated>
VNNI void tile_stream(const Problem& p, int64_t blk0, int64_t blk1, int64_t m0) {
  constexpr int chains = MR * (Gated ? 2 : 1), split = chains <= 4 ? 4 : chains <= 8 ? 2 : 1;
  constexpr int ahead = MR > 4 ? 8192 : 0;
  __m512i sums[kSpanBlocks][MR][Gated ? 2 : 1];  // at most 16 KB
  for (int64_t b = blk0; b < blk1; ++b) tile_sums<MR, 1, split, ahead, Gated>(p, b, m0, sums[b - blk0]);
  for (int64_t b = blk0; b < blk1; ++b) tile_store<MR, 1, Gated>(p, b, m0, sums[b - blk0]);
}

// Rows [begin, end) of a few-row product (p.streaming) against blocks [blk0, blk1): spans of kSpanBlocks, rows 1-8 at a
// time in one pass over each span.
template <bool Gated>
void stream_rows(const Problem& p, int64_t blk0, int64_t blk1, int64_t begin, int64_t end) {
  for (int64_t b = blk0; b < blk1; b += kSpanBlocks) {
    const int64_t b1 = std::min(blk1, b + kSpanBlocks);
    for (int64_t m0 = begin; m0 < end; m0 += 8) {
      switch (std::min<int64_t>(8, end - m0)) {
        case 8: tile_stream<8, Gated>(p, b, b1, m0); break;
        case 7: tile_stream<7, Gated>(p, b, b1, m0); break;
        case 6: tile_stream<6, Gated>(p, b, b1, m0); break;
        case 5: tile_stream<5, Gated>(p, b, b1, m0); break;
        case 4: tile_stream<4, Gated>(p, b, b1, m0); break;
        case 3: tile_stream<3, Gated>(p, b, b1, m0); break;
        case 2: tile_stream<2, Gated>(p, b, b1, m0); break;
        default: tile_stream<1, Gated>(p, b, b1, m0); break;
      }
    }
  }
}

// Rows [begin, end) of a wider product against its group of (up to) 4 blocks starting at blk: tiles of 4 rows.
template <bool Gated>
void tiled_rows(const Problem& p, int64_t blk, int64_t begin, int64_t end) {
  int64_t m0 = begin;
  for (; m0 + 4 <= end; m0 += 4) tile_blocks<4, Gated>(p, blk, m0);
  switch (end - m0) {
    case 3: return tile_blocks<3, Gated>(p, blk, m0);
    case 2: return tile_blocks<2, Gated>(p, blk, m0);
    case 1: return tile_blocks<1, Gated>(p, blk, m0);
    default: return;
  }
}

// Rows [begin, end) of p against blocks [blk0, blk1) (blk0 a multiple of 4).
void rows(const Problem& p, int64_t blk0, int64_t blk1, int64_t begin, int64_t end) {
  const bool gated = p.w_up != nullptr;
  if (p.streaming) {
    return gated ? stream_rows<true>(p, blk0, blk1, begin, end) : stream_rows<false>(p, blk0, blk1, begin, end);
  }
  for (int64_t blk = blk0; blk < blk1; blk += 4) {
    gated ? tiled_rows<true>(p, blk, begin, end) : tiled_rows<false>(p, blk, begin, end);
  }
}

}  // namespace

bool has_vnni() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"); }

namespace {

void check_weights(const torch::Tensor& packed, const torch::Tensor& w_scale, const torch::Tensor& w_sum,
                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(has_vnni(), "int8 kernel: this CPU has no AVX512-VNNI");
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
