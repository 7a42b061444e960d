// Self-attention of a prompt's queries under a bool mask, float32 on AVX-512: what model/attention.py gives SDPA
// for a causal prefill (and any other masked block of more queries than decode_attention.cpp takes).
//
// out[b, h, i] = softmax(q[b, h, i] . k[b, g, j] / sqrt(Dh), keys j the mask keeps) @ v[b, g, :], g = h / (H / H_kv)
// (grouped-query attention: K/V not expanded). The mask, (B|1, 1, Tq|1, Tk), is the one source of the pattern
// (causal, a cached prefix ahead, right or left padding, a sliding window): per block of 8 queries the kernel reads
// the first and last key any of them keeps and computes only that span (the blocks on and below a causal
// diagonal; a window's band). Per batch row: each KV head's keys transposed once (transpose_rows, shared with
// encoder_attention.cpp) for its query heads, then blocks of 8 queries as in encoder_attention.cpp: scores against
// 32 keys at a time (16 accumulators, one broadcast per query and dim), masked as they are stored, the block's
// softmax in a row buffer, then p @ V as 8 queries x 32 dims of accumulators, Dh / 32 passes over the span's keys.
// The blocks of a head are taken from both ends in turn (0, n-1, 1, n-2, ...), so threads given halves of the work
// get equal shares of a causal triangle. A query that may attend to nothing gets zeros (SDPA gives NaN). The output
// is written (B, Tq, H, Dh) and returned as its (B, H, Tq, Dh) view (merging the heads copies nothing).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int kQueries = 8;     // queries per block
constexpr int kKeyVectors = 2;  // 16-key vectors per score tile (32 keys)
constexpr int kDimVectors = 2;  // 16-dim vectors of the output per p @ V pass
static_assert(kDimVectors * 16 == kPrefillHeadDimMultiple, "a head dim is a whole number of p @ V passes");

// One query block of one head: its queries, its KV head's transposed keys and values, its mask rows, its keys.
struct Block {
  const float* qs[kQueries];     // query r (a last, partial block repeats its last query: computed, not stored)
  const bool* masks[kQueries];   // query r's mask row over the keys (null: every key)
  const float* kt;               // the KV head's keys in transpose_rows' tiles (16 keys x dh each), zero past tk
  const float* v;                // the KV head's first value; values v_row apart
  float* out;                    // the first query's output; outputs out_row apart
  int64_t v_row, out_row, tk, dh;
  int64_t lo, width;             // the keys [lo, lo + width) scored: lo and width multiples of 16
  int rows;                      // queries stored (<= kQueries)
};

// Which of the 16 keys from j a mask row keeps (none past tk).
AVX512 inline __mmask16 kept_keys(const bool* mask, int64_t j, int64_t tk) {
  const __mmask16 lanes = tserve::first_lanes(tk - j);
  if (mask == nullptr) return lanes;
  const __m128i bytes = _mm_maskz_loadu_epi8(lanes, mask + j);
  return _mm_test_epi8_mask(bytes, bytes) & lanes;
}

// The block's scores over its keys into p (kQueries x width), scaled, masked keys at -inf; top: each row's maximum.
AVX512 void scores(const Block& b, float* p, float* top) {
  __m512 tops[kQueries];
  UNROLL for (int r = 0; r < kQueries; ++r) tops[r] = _mm512_set1_ps(-INFINITY);
  const int64_t vectors = b.width / 16;
  const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(static_cast<float>(b.dh))), minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t c0 = 0; c0 < vectors; c0 += kKeyVectors) {
    const bool pair = c0 + 1 < vectors;  // an odd number of key vectors: the last tile has one
    __m512 acc[kQueries][kKeyVectors];
    UNROLL for (int r = 0; r < kQueries; ++r) UNROLL for (int c = 0; c < kKeyVectors; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* kc = b.kt + (b.lo + c0 * 16) * b.dh, *kc1 = kc + 16 * b.dh;
    if (pair) {
      for (int64_t d = 0; d < b.dh; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kc + d * 16), k1 = _mm512_loadu_ps(kc1 + d * 16);
        UNROLL for (int r = 0; r < kQueries; ++r) {
          const __m512 query = _mm512_set1_ps(b.qs[r][d]);
          acc[r][0] = _mm512_fmadd_ps(query, k0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(query, k1, acc[r][1]);
        }
      }
    } else {
      for (int64_t d = 0; d < b.dh; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kc + d * 16);
        UNROLL for (int r = 0; r < kQueries; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(b.qs[r][d]), k0, acc[r][0]);
      }
    }
    const int nc = pair ? 2 : 1;
    UNROLL for (int r = 0; r < kQueries; ++r) UNROLL for (int c = 0; c < kKeyVectors; ++c)
      if (c < nc) {
        const int64_t j = b.lo + (c0 + c) * 16;
        const __m512 s = _mm512_mask_blend_ps(kept_keys(b.masks[r], j, b.tk), minus_inf, _mm512_mul_ps(acc[r][c], scale));
        tops[r] = _mm512_max_ps(tops[r], s);
        _mm512_storeu_ps(p + r * b.width + (c0 + c) * 16, s);
      }
  }
  UNROLL for (int r = 0; r < kQueries; ++r) top[r] = _mm512_reduce_max_ps(tops[r]);
}

// The block's outputs = p @ V scaled by inverse: 8 queries x 32 dims of accumulators, one pass over the keys each.
AVX512 void weighted_values(const Block& b, const float* p, const float* inverse) {
  const int64_t end = std::min(b.lo + b.width, b.tk);
  for (int64_t d0 = 0; d0 < b.dh; d0 += kDimVectors * 16) {
    __m512 acc[kQueries][kDimVectors];
    UNROLL for (int r = 0; r < kQueries; ++r) UNROLL for (int c = 0; c < kDimVectors; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* v = b.v + d0;
    for (int64_t j = b.lo; j < end; ++j) {
      const __m512 v0 = _mm512_loadu_ps(v + j * b.v_row), v1 = _mm512_loadu_ps(v + j * b.v_row + 16);
      const float* weights = p + (j - b.lo);
      UNROLL for (int r = 0; r < kQueries; ++r) {
        const __m512 weight = _mm512_set1_ps(weights[r * b.width]);
        acc[r][0] = _mm512_fmadd_ps(weight, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(weight, v1, acc[r][1]);
      }
    }
    UNROLL for (int r = 0; r < kQueries; ++r) {
      if (r >= b.rows) break;
      const __m512 by = _mm512_set1_ps(inverse[r]);
      UNROLL for (int c = 0; c < kDimVectors; ++c)
        _mm512_storeu_ps(b.out + r * b.out_row + d0 + c * 16, _mm512_mul_ps(acc[r][c], by));
    }
  }
}

AVX512 void block_attention(const Block& b, float* p) {
  if (b.width == 0) {  // no query of the block keeps a key
    for (int r = 0; r < b.rows; ++r) std::fill(b.out + r * b.out_row, b.out + r * b.out_row + b.dh, 0.f);
    return;
  }
  float top[kQueries], inverse[kQueries];
  scores(b, p, top);
  for (int r = 0; r < kQueries; ++r) inverse[r] = tserve::softmax_row(p + r * b.width, b.width, top[r]);
  weighted_values(b, p, inverse);
}

// The first key a mask row keeps (tk: none) and one past the last (0: none), 64 bytes at a time.
AVX512 int64_t first_kept(const bool* row, int64_t tk) {
  for (int64_t j = 0; j < tk; j += 64) {
    const __mmask64 lanes = tk - j >= 64 ? ~0ULL : (1ULL << (tk - j)) - 1;
    const __m512i bytes = _mm512_maskz_loadu_epi8(lanes, row + j);
    const __mmask64 kept = _mm512_test_epi8_mask(bytes, bytes);
    if (kept) return j + __builtin_ctzll(kept);
  }
  return tk;
}

AVX512 int64_t past_last_kept(const bool* row, int64_t tk) {
  for (int64_t end = tk; end > 0; end -= 64) {
    const int64_t j = std::max<int64_t>(0, end - 64), n = end - j;
    const __mmask64 lanes = n == 64 ? ~0ULL : (1ULL << n) - 1;
    const __m512i bytes = _mm512_maskz_loadu_epi8(lanes, row + j);
    const __mmask64 kept = _mm512_test_epi8_mask(bytes, bytes);
    if (kept) return j + 64 - __builtin_clzll(kept);
  }
  return 0;
}

// The keys [lo, lo + width) the queries [i0, i0 + rows) keep between them, lo and width rounded out to 16.
std::pair<int64_t, int64_t> block_keys(const bool* mask, int64_t query_row, int64_t i0, int rows, int64_t tk) {
  if (mask == nullptr) return {0, (tk + 15) / 16 * 16};
  int64_t first = tk, past = 0;
  for (int r = 0; r < rows; ++r) {
    const bool* row = mask + (i0 + r) * query_row;
    first = std::min(first, first_kept(row, tk));
    past = std::max(past, past_last_kept(row, tk));
  }
  if (past <= first) return {0, 0};
  const int64_t lo = first / 16 * 16;
  return {lo, (past - lo + 15) / 16 * 16};
}

}  // namespace

// q (B, H, Tq, Dh); k, v (B, H_kv, Tk, Dh) with H_kv dividing H; float32 CPU, unit stride along the head dim (views
// of a fused projection or of a KV cache's buffers are fine), Dh a multiple of kPrefillHeadDimMultiple, Tk at most
// kPrefillMaxKeys; mask bool (B or 1, 1, Tq or 1, Tk) or None. Returns (B, H, Tq, Dh), a view of (B, Tq, H, Dh).
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(has_avx512(), "prefill attention: this CPU has no AVX-512");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
              q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "prefill attention: q (B, H, Tq, Dh), k and v (B, H_kv, Tk, Dh) with H_kv dividing H");
  const int64_t b = q.size(0), heads = q.size(1), tq = q.size(2), kv_heads = k.size(1), tk = k.size(2),
                dh = q.size(3), tkp = (tk + 15) / 16 * 16, group = heads / kv_heads;
  TORCH_CHECK(dh > 0 && dh % kPrefillHeadDimMultiple == 0 && tk <= kPrefillMaxKeys, "prefill attention: the head dim ",
              "must be a multiple of ", kPrefillHeadDimMultiple, " and at most ", kPrefillMaxKeys, " keys");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->stride(3) == 1,
                "prefill attention: float32 CPU tensors with unit stride along the head dim");
  at::Tensor kept;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && (mask->size(0) == b || mask->size(0) == 1) &&
                mask->size(1) == 1 && (mask->size(2) == tq || mask->size(2) == 1) && mask->size(3) == tk,
                "prefill attention: mask must be bool (B or 1, 1, Tq or 1, Tk)");
    kept = mask->select(1, 0).contiguous();  // (B|1, Tq|1, Tk)
  }
  torch::Tensor out = torch::empty({b, tq, heads, dh}, q.options());
  const int64_t blocks = (tq + kQueries - 1) / kQueries;
  const int64_t mask_batch = kept.defined() && kept.size(0) == b ? kept.size(1) * tk : 0;
  const int64_t mask_query = kept.defined() && kept.size(1) == tq ? tk : 0;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<float> kt(kv_heads * dh * tkp);
  std::vector<std::pair<int64_t, int64_t>> spans(blocks);
  for (int64_t row = 0; row < b; ++row) {
    const bool* mask_row = kept.defined() ? kept.data_ptr<bool>() + row * mask_batch : nullptr;
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        transpose_rows(kp + row * k.stride(0) + g * k.stride(1), k.stride(2), tk, dh, tkp, kt.data() + g * dh * tkp);
    });
    for (int64_t i = 0; i < blocks; ++i) {
      const int rows = static_cast<int>(std::min<int64_t>(kQueries, tq - i * kQueries));
      spans[i] = block_keys(mask_row, mask_query, i * kQueries, rows, tk);
    }
    at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p(kQueries * tkp);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t head = item / blocks, turn = item % blocks, g = head / group;
        const int64_t index = turn % 2 == 0 ? turn / 2 : blocks - 1 - turn / 2;  // from both ends in turn
        const int64_t i0 = index * kQueries;
        Block blk;
        blk.rows = static_cast<int>(std::min<int64_t>(kQueries, tq - i0));
        for (int r = 0; r < kQueries; ++r) {
          const int64_t i = i0 + std::min(r, blk.rows - 1);
          blk.qs[r] = qp + row * q.stride(0) + head * q.stride(1) + i * q.stride(2);
          blk.masks[r] = mask_row != nullptr ? mask_row + i * mask_query : nullptr;
        }
        blk.kt = kt.data() + g * dh * tkp;
        blk.v = vp + row * v.stride(0) + g * v.stride(1);
        blk.out = op + ((row * tq + i0) * heads + head) * dh;
        blk.v_row = v.stride(2), blk.out_row = heads * dh, blk.tk = tk, blk.dh = dh;
        std::tie(blk.lo, blk.width) = spans[index];
        block_attention(blk, p.data());
      }
    });
  }
  return out.transpose(1, 2);
}
