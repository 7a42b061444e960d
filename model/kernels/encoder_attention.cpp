// Bidirectional self-attention of an encoder's rows (64 to a few hundred tokens), float32 on AVX-512: what
// model/attention.py gives SDPA for a forward with a key-padding mask (a classifier, reranker or NER model).
//
// out[b, h, i] = softmax(q[b, h, i] . k[b, h, :] / sqrt(64), keys masked) @ v[b, h, :] for every query i of every
// row and head, head dim 64. Per head: K transposed once into a scratch (transpose_rows: per 16 keys a 64 x 16 tile,
// zero past T), then blocks of 8 queries: their scores against 32 keys at a time are 16
// accumulators fed by one broadcast per query and dim (no horizontal sums), each row's maximum kept as the scores are
// stored, the block's softmax in a row buffer, then p @ V as 8 queries x 32 dims of accumulators, two passes over the
// keys.
// SDPA's CPU (flash) kernel runs ~75 GFLOP/s on 8 x 12 heads x 128 tokens here; this one ~160-175, within 5e-7 of
// it. (4-query blocks against 64 keys: 14% slower; 6-query blocks against 64 keys (24 accumulators): slower still;
// V copied into contiguous planes per head: no faster.)
// The mask is bool over the keys, (B or 1, 1, 1, T) (True = attend); a query that may attend to nothing gets zeros
// (SDPA gives NaN). The output is written (B, T, H, 64) and returned as its (B, H, T, 64) view, so merging the heads
// afterwards (transpose + reshape) copies nothing.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "encoder_heads.h"
#include "kernels.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int kDh = tserve::kEncoderHeadDim;  // the head dim this kernel computes (4 vectors)
constexpr int kQueries = 8;      // queries per block
constexpr int kKeyVectors = 2;   // 16-key vectors per score tile (32 keys)
constexpr int kDimVectors = 2;   // 16-dim vectors of the output per p @ V pass (two passes: dims 0-31, 32-63)

using Head = tserve::EncoderHead;

// Scores of the block's queries (query r at qs[r]) against every key into p (kQueries x tp), scaled, masked keys at
// -inf: 8 queries x 32 keys of accumulators, one broadcast per query and dim, two key tiles (transpose_rows) per dim.
AVX512 void scores(const float* const* qs, const float* kt, const float* bias, int64_t tp, float* p, float* top) {
  __m512 tops[kQueries];
  UNROLL for (int r = 0; r < kQueries; ++r) tops[r] = _mm512_set1_ps(-INFINITY);
  const int64_t vectors = tp / 16;
  for (int64_t c0 = 0; c0 < vectors; c0 += kKeyVectors) {
    const bool pair = c0 + 1 < vectors;  // tp / 16 odd: the last tile has one key vector
    __m512 acc[kQueries][kKeyVectors];
    UNROLL for (int r = 0; r < kQueries; ++r) UNROLL for (int c = 0; c < kKeyVectors; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* kc = kt + c0 * 16 * kDh;
    if (pair) {
      for (int d = 0; d < kDh; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kc + d * 16), k1 = _mm512_loadu_ps(kc + kDh * 16 + d * 16);
        UNROLL for (int r = 0; r < kQueries; ++r) {
          const __m512 query = _mm512_set1_ps(qs[r][d]);
          acc[r][0] = _mm512_fmadd_ps(query, k0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(query, k1, acc[r][1]);
        }
      }
    } else {
      for (int d = 0; d < kDh; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kc + d * 16);
        UNROLL for (int r = 0; r < kQueries; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r][d]), k0, acc[r][0]);
      }
    }
    tserve::store_scores(acc, pair ? 2 : 1, bias, c0, tp, p, tops);
  }
  UNROLL for (int r = 0; r < kQueries; ++r) top[r] = _mm512_reduce_max_ps(tops[r]);
}

// transpose_rows, 16 rows x 16 dims at a time, transposed in registers.
AVX512 void transpose_in_registers(const float* src, int64_t row, int64_t rows, int64_t dims, int64_t tp, float* dst) {
  for (int64_t j0 = 0; j0 < tp; j0 += 16) {
    for (int64_t d0 = 0; d0 < dims; d0 += 16) {
      __m512 a[16], b[16];
      UNROLL for (int r = 0; r < 16; ++r)
        a[r] = j0 + r < rows ? _mm512_loadu_ps(src + (j0 + r) * row + d0) : _mm512_setzero_ps();
      UNROLL for (int r = 0; r < 16; r += 2) {  // lane L: a[r][4L + 0..1] / a[r][4L + 2..3] interleaved with a[r + 1]
        b[r] = _mm512_unpacklo_ps(a[r], a[r + 1]);
        b[r + 1] = _mm512_unpackhi_ps(a[r], a[r + 1]);
      }
      UNROLL for (int r = 0; r < 16; r += 4) {  // a[r + c]: lane L holds dim 4L + c of keys r .. r + 3
        a[r] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[r]), _mm512_castps_pd(b[r + 2])));
        a[r + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[r]), _mm512_castps_pd(b[r + 2])));
        a[r + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[r + 1]), _mm512_castps_pd(b[r + 3])));
        a[r + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[r + 1]), _mm512_castps_pd(b[r + 3])));
      }
      UNROLL for (int g = 0; g < 16; g += 8) UNROLL for (int c = 0; c < 4; ++c) {  // b[g + c]: dims c and c + 8;
        b[g + c] = _mm512_shuffle_f32x4(a[g + c], a[g + c + 4], 0x88);             // b[g + c + 4]: c + 4, c + 12
        b[g + c + 4] = _mm512_shuffle_f32x4(a[g + c], a[g + c + 4], 0xdd);
      }
      UNROLL for (int c = 0; c < 8; ++c) {
        _mm512_storeu_ps(dst + j0 * dims + (d0 + c) * 16, _mm512_shuffle_f32x4(b[c], b[c + 8], 0x88));
        _mm512_storeu_ps(dst + j0 * dims + (d0 + c + 8) * 16, _mm512_shuffle_f32x4(b[c], b[c + 8], 0xdd));
      }
    }
  }
}

}  // namespace

// dst = rows of src (`rows` rows of `dims` floats, row apart) transposed in tiles of 16 rows: rows j0 .. j0 + 15 as a
// (dims x 16) tile at dst + j0 * dims, zero past rows (tp >= rows, a multiple of 16; dims a multiple of 16). A head's
// keys for the score tiles here and in prefill_attention.cpp: a tile is read front to back, one dim after another
// (dims x tp rows, read 16 floats a row, were 4-12% slower: docs/benchmarks.md, helper P, session 24).
void transpose_rows(const float* src, int64_t row, int64_t rows, int64_t dims, int64_t tp, float* dst) {
  transpose_in_registers(src, row, rows, dims, tp, dst);
}

namespace {

// out rows [i0, i0 + rows) = p @ V scaled by inverse: 8 queries x 32 dims of accumulators, two passes over the keys.
AVX512 void weighted_values(const Head& h, const float* p, int64_t tp, int64_t i0, int rows, const float* inverse) {
  UNROLL for (int half = 0; half < kDh / 16; half += kDimVectors) {
    __m512 acc[kQueries][kDimVectors];
    UNROLL for (int r = 0; r < kQueries; ++r) UNROLL for (int c = 0; c < kDimVectors; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* v = h.v + half * 16;
    for (int64_t j = 0; j < h.t; ++j) {
      const __m512 v0 = _mm512_loadu_ps(v + j * h.kv_row), v1 = _mm512_loadu_ps(v + j * h.kv_row + 16);
      UNROLL for (int r = 0; r < kQueries; ++r) {
        const __m512 weight = _mm512_set1_ps(p[r * tp + j]);
        acc[r][0] = _mm512_fmadd_ps(weight, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(weight, v1, acc[r][1]);
      }
    }
    tserve::store_outputs(acc, h, i0, rows, half, inverse);
  }
}

AVX512 void head_attention(const Head& h, float* kt, float* bias, float* p) {
  const int64_t t = h.t, tp = (t + 15) / 16 * 16;
  transpose_rows(h.k, h.kv_row, t, kDh, tp, kt);
  for (int64_t j = 0; j < tp; ++j) bias[j] = j < t && (h.keep == nullptr || h.keep[j]) ? 0.f : -INFINITY;
  for (int64_t i0 = 0; i0 < t; i0 += kQueries) {
    const int rows = static_cast<int>(std::min<int64_t>(kQueries, t - i0));
    const float* qs[kQueries];  // a last, partial block repeats its last query (computed, not stored)
    for (int r = 0; r < kQueries; ++r) qs[r] = h.q + (i0 + std::min(r, rows - 1)) * h.q_row;
    float top[kQueries], inverse[kQueries];
    scores(qs, kt, bias, tp, p, top);
    for (int r = 0; r < kQueries; ++r) inverse[r] = tserve::softmax_row(p + r * tp, tp, top[r]);
    weighted_values(h, p, tp, i0, rows, inverse);
  }
}

}  // namespace

// encoder_heads.h's contract.
torch::Tensor encoder_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(has_avx512(), "encoder attention: this CPU has no AVX-512");
  const tserve::EncoderHeads heads(q, k, v, mask, "encoder attention");
  const int64_t tp = (heads.tokens() + 15) / 16 * 16;
  at::parallel_for(0, heads.count(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(kDh * tp), bias(tp), p(kQueries * tp);
    for (int64_t i = begin; i < end; ++i) head_attention(heads.head(i), kt.data(), bias.data(), p.data());
  });
  return heads.result();
}
