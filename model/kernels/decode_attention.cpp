// Attention of a few queries per head over a KV cache, float32 on AVX-512 (model/native.py, model/attention.py).
//
// out[b, h, i] = softmax(q[b, h, i] . k[b, h, :T] / sqrt(Dh), masked) @ v[b, h, :T] for every query i, with no
// causal structure among the queries: one decoding step (one query per row), or the grouped beams of one
// source in cross-attention. It reads K/V once per head at memory speed where SDPA's CPU kernel, built for
// long query blocks, spends 2-3x longer on one query. The mask is bool (True = attend), broadcast over heads
// and queries where its dims are 1. A query that may attend to nothing gets zeros (SDPA gives NaN).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace {

constexpr int64_t kMaxChunks = 8;  // head dims up to 128
constexpr int64_t kPrefetchKeys = 8;  // keys (each Dh floats) prefetched ahead: across 4 KB pages too

struct Head {
  const float* q;     // first query; queries q_row apart
  const float* k;     // first key; keys and values kv_row apart
  const float* v;
  const bool* mask;   // first query's mask over the keys (or null); mask_row apart per query
  float* out;         // first query's output; out_row apart
  int64_t q_row, kv_row, mask_row, out_row, queries, keys, dh;
};

// The `chunks` 64-byte lines of one key or value row, ahead of use (past the slice's end: harmless, no fault).
void prefetch(const float* row, int64_t chunks) {
  for (int64_t c = 0; c < chunks; ++c) _mm_prefetch(reinterpret_cast<const char*>(row + c * 16), _MM_HINT_T0);
}

AVX512 void attend(const Head& a, float scale, float* scores) {
  const int64_t chunks = (a.dh + 15) / 16;
  const __mmask16 last = static_cast<__mmask16>(a.dh % 16 ? (1u << (a.dh % 16)) - 1 : 0xFFFF);
  auto lanes = [&](int64_t c) { return c + 1 == chunks ? last : static_cast<__mmask16>(0xFFFF); };
  for (int64_t i = 0; i < a.queries; ++i) {
    const float* q = a.q + i * a.q_row;
    const bool* mask = a.mask ? a.mask + i * a.mask_row : nullptr;
    __m512 qv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c)
      qv[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(c), q + c * 16), _mm512_set1_ps(scale));
    float top = -INFINITY;
    for (int64_t j = 0; j < a.keys; ++j) {
      if (mask && !mask[j]) {
        scores[j] = -INFINITY;
        continue;
      }
      const float* k = a.k + j * a.kv_row;
      prefetch(k + kPrefetchKeys * a.kv_row, chunks);
      __m512 dot = _mm512_mul_ps(qv[0], _mm512_maskz_loadu_ps(lanes(0), k));
      for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(lanes(c), k + c * 16), dot);
      scores[j] = _mm512_reduce_add_ps(dot);
      top = std::max(top, scores[j]);
    }
    float* out = a.out + i * a.out_row;
    if (top == -INFINITY) {  // nothing to attend to
      for (int64_t c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(out + c * 16, lanes(c), _mm512_setzero_ps());
      continue;
    }
    const __m512 shift = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < a.keys; j += 16) {
      const __mmask16 m = a.keys - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (a.keys - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(m, tserve::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), shift)));
      _mm512_mask_storeu_ps(scores + j, m, e);
      total = _mm512_add_ps(total, e);
    }
    __m512 acc[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < a.keys; ++j) {
      if (scores[j] == 0.f) continue;  // masked (or underflowed) keys
      const __m512 p = _mm512_set1_ps(scores[j]);
      const float* v = a.v + j * a.kv_row;
      prefetch(v + kPrefetchKeys * a.kv_row, chunks);
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(lanes(c), v + c * 16), acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int64_t c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(out + c * 16, lanes(c), _mm512_mul_ps(acc[c], inv));
  }
}

}  // namespace

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// q (B, H, Tq, Dh); k, v (B, H, T, Dh) with unit stride along Dh (cache slices are fine); mask bool,
// broadcastable to (B, 1 or H, 1 or Tq, T), or None.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(has_avx512(), "decode attention: this CPU has no AVX-512");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode attention: q, k, v must be (B, H, T, Dh)");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->stride(3) == 1,
                "decode attention: float32 CPU tensors with unit stride along Dh");
  const int64_t b = q.size(0), h = q.size(1), tq = q.size(2), dh = q.size(3), t = k.size(2);
  TORCH_CHECK(dh <= kMaxChunks * 16, "decode attention: head dim above ", kMaxChunks * 16);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == b && k.size(1) == h && k.size(3) == dh && k.stride(2) == v.stride(2),
              "decode attention: k and v must match q and each other");
  at::Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(3) == t,
                "decode attention: mask must be bool, broadcastable to (B, H, Tq, T)");
    m = mask->stride(3) == 1 ? *mask : mask->contiguous();
    m = m.expand({b, h, tq, t});
  }
  torch::Tensor out = torch::empty({b, h, tq, dh}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(dh));
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(t + 16);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bi = i / h, hi = i % h;
      const Head head{q.data_ptr<float>() + bi * q.stride(0) + hi * q.stride(1),
                      k.data_ptr<float>() + bi * k.stride(0) + hi * k.stride(1),
                      v.data_ptr<float>() + bi * v.stride(0) + hi * v.stride(1),
                      m.defined() ? m.data_ptr<bool>() + bi * m.stride(0) + hi * m.stride(1) : nullptr,
                      out.data_ptr<float>() + bi * out.stride(0) + hi * out.stride(1),
                      q.stride(2), k.stride(2), m.defined() ? m.stride(2) : 0, out.stride(2), tq, t, dh};
      attend(head, scale, scores.data());
    }
  });
  return out;
}
