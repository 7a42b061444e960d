// encoder_attention.cpp's bidirectional self-attention with bf16 products and float32 sums (AVX512-BF16 VDPBF16PS,
// two products per float32 lane and instruction): for the engines that already round their GEMM inputs (the bf16
// mode of model/quantize.py; int8 measured and left on float32: docs/benchmarks.md), as GPU serving computes
// attention in bf16.
//
// q, k and v are rounded to bf16 (round to nearest even: the bits of x.bfloat16()); scores q . k summed in float32,
// scaled by 1 / sqrt(64), masked, softmax in float32 (simd_math.h's, as encoder_attention.cpp); the unnormalised
// weights exp(s - max) rounded to bf16 for p @ v (float32 sums), divided by their float32 sum at the end. Per head:
// K rounded as bf16 pairs of dims and transposed once into 16-key tiles (transpose_rows on the pairs' 32-bit words),
// V rounded as pairs of keys side by side (pair j: keys 2j and 2j + 1 of each dim in one 32-bit word); then blocks
// of 8 queries as encoder_attention.cpp's: 8 queries x 32 keys of score accumulators fed by one broadcast pair per
// query and two dims, and p @ V as 8 queries x 32 dims, one broadcast pair of weights per query and two keys.
// The mask is bool over the keys, (B or 1, 1, 1, T); a query that may attend to nothing gets zeros. The output is
// written (B, T, H, 64) and returned as its (B, H, T, 64) view.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "encoder_heads.h"
#include "kernels.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int kDh = tserve::kEncoderHeadDim;
constexpr int kPairs = kDh / 2;  // a row of q or k as bf16 pairs of dims (32-bit words)
constexpr int kQueries = 8;      // queries per block
constexpr int kKeyVectors = 2;   // 16-key vectors per score tile (32 keys)
constexpr int kDimVectors = 2;   // 16-dim vectors of the output per p @ V pass (two passes: dims 0-31, 32-63)

// acc + the products of a's and b's bf16 pairs. An asm, not _mm512_dpbf16_ps, whose __m512bh casts keep the
// accumulators on the stack under GCC 12 (bf16_linear.cpp).
BF16 inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// 16 floats -> their bf16 bits in the low half of each 32-bit lane (high half zero), rounded to nearest even with
// NaN kept quiet (0x7FC0): c10::BFloat16's rounding, bit for bit.
BF16 inline __m512i round_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// n floats (a multiple of 16) -> n bf16 (elements 2i and 2i + 1 make the 32-bit word i).
BF16 void round_row(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(round_bf16(_mm512_loadu_ps(x + i))));
}

using Head = tserve::EncoderHead;

// A thread's scratch for one head of up to tp (a multiple of 16) keys.
struct Scratch {
  std::vector<uint16_t> keys;    // (tp, 64) bf16 rows of K
  std::vector<uint32_t> tiles;   // K's pairs transposed: per 16 keys a (32 pairs x 16 keys) tile
  std::vector<uint32_t> values;  // (tp / 2, 64): word d of pair j = bf16 v[2j][d] | bf16 v[2j + 1][d] << 16
  std::vector<float> bias, p;    // (tp,) 0 or -inf; (kQueries, tp) scores, then exp(s - max)
  std::vector<uint16_t> weights, queries;  // (kQueries, tp) p in bf16; (kQueries, 64) the block's q in bf16
  explicit Scratch(int64_t tp)
      : keys(tp * kDh), tiles(tp * kPairs), values(tp / 2 * kDh), bias(tp), p(kQueries * tp), weights(kQueries * tp),
        queries(kQueries * kDh) {}
};

// V's rows [0, t) as pairs of keys (zero past t, up to tp).
BF16 void pair_values(const Head& h, int64_t tp, uint32_t* out) {
  for (int64_t j = 0; j < tp; j += 2) {
    uint32_t* row = out + j / 2 * kDh;
    UNROLL for (int d = 0; d < kDh; d += 16) {
      const __m512i even = j < h.t ? round_bf16(_mm512_loadu_ps(h.v + j * h.kv_row + d)) : _mm512_setzero_si512();
      const __m512i odd = j + 1 < h.t ? round_bf16(_mm512_loadu_ps(h.v + (j + 1) * h.kv_row + d)) : _mm512_setzero_si512();
      _mm512_storeu_si512(row + d, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
  }
}

// Scores of the block's queries (bf16 pairs, query r at qs[r]) against every key into p (kQueries x tp), scaled,
// masked keys at -inf, each row's maximum into top: 8 queries x 32 keys of accumulators.
BF16 void scores(const uint32_t* qs, const uint32_t* kt, const float* bias, int64_t tp, float* p, float* top) {
  __m512 tops[kQueries];
  UNROLL for (int r = 0; r < kQueries; ++r) tops[r] = _mm512_set1_ps(-INFINITY);
  const int64_t vectors = tp / 16;
  for (int64_t c0 = 0; c0 < vectors; c0 += kKeyVectors) {
    const bool pair = c0 + 1 < vectors;  // tp / 16 odd: the last tile has one key vector
    __m512 acc[kQueries][kKeyVectors];
    UNROLL for (int r = 0; r < kQueries; ++r) UNROLL for (int c = 0; c < kKeyVectors; ++c) acc[r][c] = _mm512_setzero_ps();
    const uint32_t* kc = kt + c0 * 16 * kPairs;
    if (pair) {
      for (int d = 0; d < kPairs; ++d) {
        const __m512i k0 = _mm512_loadu_si512(kc + d * 16), k1 = _mm512_loadu_si512(kc + kPairs * 16 + d * 16);
        UNROLL for (int r = 0; r < kQueries; ++r) {
          const __m512i query = _mm512_set1_epi32(static_cast<int>(qs[r * kPairs + d]));
          acc[r][0] = dot_pairs(acc[r][0], query, k0);
          acc[r][1] = dot_pairs(acc[r][1], query, k1);
        }
      }
    } else {
      for (int d = 0; d < kPairs; ++d) {
        const __m512i k0 = _mm512_loadu_si512(kc + d * 16);
        UNROLL for (int r = 0; r < kQueries; ++r)
          acc[r][0] = dot_pairs(acc[r][0], _mm512_set1_epi32(static_cast<int>(qs[r * kPairs + d])), k0);
      }
    }
    tserve::store_scores(acc, pair ? 2 : 1, bias, c0, tp, p, tops);
  }
  UNROLL for (int r = 0; r < kQueries; ++r) top[r] = _mm512_reduce_max_ps(tops[r]);
}

// out rows [i0, i0 + rows) = weights @ V scaled by inverse (weights: kQueries rows of tp bf16, read as pairs of
// keys): 8 queries x 32 dims of accumulators, two passes over the key pairs up to t.
BF16 void weighted_values(const Head& h, const uint32_t* weights, const uint32_t* values, int64_t tp, int64_t i0,
                          int rows, const float* inverse) {
  const int64_t pairs = (h.t + 1) / 2, row = tp / 2;
  UNROLL for (int half = 0; half < kDh / 16; half += kDimVectors) {
    __m512 acc[kQueries][kDimVectors];
    UNROLL for (int r = 0; r < kQueries; ++r) UNROLL for (int c = 0; c < kDimVectors; ++c) acc[r][c] = _mm512_setzero_ps();
    const uint32_t* v = values + half * 16;
    for (int64_t j = 0; j < pairs; ++j) {
      const __m512i v0 = _mm512_loadu_si512(v + j * kDh), v1 = _mm512_loadu_si512(v + j * kDh + 16);
      UNROLL for (int r = 0; r < kQueries; ++r) {
        const __m512i weight = _mm512_set1_epi32(static_cast<int>(weights[r * row + j]));
        acc[r][0] = dot_pairs(acc[r][0], weight, v0);
        acc[r][1] = dot_pairs(acc[r][1], weight, v1);
      }
    }
    tserve::store_outputs(acc, h, i0, rows, half, inverse);
  }
}

// Prefetches rows [i0, i0 + kQueries) of the next head's q, k and v (strided rows of a fused projection: read
// first by the rounding passes, whose loads would otherwise wait on memory, while this head's blocks compute).
inline void prefetch_rows(const Head* next, int64_t i0) {
  if (next == nullptr) return;
  for (int64_t i = i0; i < std::min<int64_t>(i0 + kQueries, next->t); ++i)
    for (int d = 0; d < kDh; d += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(next->q + i * next->q_row + d), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next->k + i * next->kv_row + d), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next->v + i * next->kv_row + d), _MM_HINT_T1);
    }
}

BF16 void head_attention(const Head& h, const Head* next, Scratch& s) {
  const int64_t t = h.t, tp = (t + 15) / 16 * 16;
  for (int64_t j = 0; j < t; ++j) round_row(h.k + j * h.kv_row, kDh, s.keys.data() + j * kDh);
  // the pairs' 32-bit words moved as floats (bits unchanged): per 16 keys a (32 x 16) tile, zero past t
  transpose_rows(reinterpret_cast<const float*>(s.keys.data()), kPairs, t, kPairs, tp,
                 reinterpret_cast<float*>(s.tiles.data()));
  pair_values(h, tp, s.values.data());
  for (int64_t j = 0; j < tp; ++j) s.bias[j] = j < t && (h.keep == nullptr || h.keep[j]) ? 0.f : -INFINITY;
  const auto* queries = reinterpret_cast<const uint32_t*>(s.queries.data());
  const auto* weights = reinterpret_cast<const uint32_t*>(s.weights.data());
  for (int64_t i0 = 0; i0 < t; i0 += kQueries) {
    const int rows = static_cast<int>(std::min<int64_t>(kQueries, t - i0));
    prefetch_rows(next, i0);
    for (int r = 0; r < kQueries; ++r)  // a last, partial block repeats its last query (computed, not stored)
      round_row(h.q + (i0 + std::min(r, rows - 1)) * h.q_row, kDh, s.queries.data() + r * kDh);
    float top[kQueries], inverse[kQueries];
    scores(queries, s.tiles.data(), s.bias.data(), tp, s.p.data(), top);
    for (int r = 0; r < kQueries; ++r) {
      inverse[r] = tserve::softmax_row(s.p.data() + r * tp, tp, top[r]);
      round_row(s.p.data() + r * tp, tp, s.weights.data() + r * tp);
    }
    weighted_values(h, weights, s.values.data(), tp, i0, rows, inverse);
  }
}

}  // namespace

// encoder_attention's contract (encoder_heads.h) with bf16 products; needs AVX512-BF16 (has_avx512_bf16).
torch::Tensor encoder_attention_bf16(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(has_avx512_bf16(), "bf16 encoder attention: this CPU has no AVX512-BF16");
  const tserve::EncoderHeads heads(q, k, v, mask, "bf16 encoder attention");
  at::parallel_for(0, heads.count(), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch((heads.tokens() + 15) / 16 * 16);
    for (int64_t i = begin; i < end; ++i) {
      const Head next = i + 1 < end ? heads.head(i + 1) : Head{};
      head_attention(heads.head(i), i + 1 < end ? &next : nullptr, scratch);
    }
  });
  return heads.result();
}
