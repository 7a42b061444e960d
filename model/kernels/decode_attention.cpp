// Attention of a few queries per head over a KV cache, float32 on AVX-512 (model/native.py, model/attention.py).
//
// out[b, h, i] = softmax(q[b, h, i] . k[b, h, :T] / sqrt(Dh), masked) @ v[b, h, :T] for every query i, with no
// causal structure among the queries: one decoding step (one query per row), or the grouped beams of one
// source in cross-attention. Grouped-query attention: k and v may hold fewer heads (H_kv dividing H); query head
// h reads KV head h / (H / H_kv), in place (no expanded copy). It reads K/V once per head at memory speed where SDPA's CPU kernel, built for
// long query blocks, spends 2-3x longer on one query. The mask is bool (True = attend), broadcast over heads
// and queries where its dims are 1. A query that may attend to nothing gets zeros (SDPA gives NaN). Or the mask is
// float32, added to the scores as SDPA adds a float attn_mask (T5's relative position bias, its masked keys at the
// lowest float: model/relative_position.py).
//
// A row may also read a shared prefix ahead of its own keys: blocks of a prefix cache (model/shared_prefix.py),
// each (layers, 2, H_kv, block, Dh) contiguous, listed per row by a block table (B, M) of indices into the blocks
// (-1 after the row's last). Every query sees every key of its row's blocks, in table order, then its own keys:
// the rows of one system prompt read one copy of it in place (paged attention for the prefix).
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

constexpr int64_t kMaxChunks = 16;  // head dims up to 256 (Gemma 3)
constexpr int64_t kPrefetchKeys = 8;  // keys (each Dh floats) prefetched ahead: across 4 KB pages too

struct Head {
  const float* q;     // first query; queries q_row apart
  const float* k;     // first key; keys and values kv_row apart
  const float* v;
  const bool* mask;   // first query's mask over the keys (or null); mask_row apart per query
  const float* bias;  // or a float mask added to the scores (or null), laid out as `mask`
  float* out;         // first query's output; out_row apart
  int64_t q_row, kv_row, mask_row, out_row, queries, keys, dh;
  const float* const* prefix_k = nullptr;  // per prefix block: its first key (keys dh apart), read before k
  const float* const* prefix_v = nullptr;
  int64_t prefix_blocks = 0, block = 0;    // blocks this row reads, keys per block
};

// The `chunks` 64-byte lines of one key or value row, ahead of use (past the slice's end: harmless, no fault).
void prefetch(const float* row, int64_t chunks) {
  for (int64_t c = 0; c < chunks; ++c) _mm_prefetch(reinterpret_cast<const char*>(row + c * 16), _MM_HINT_T0);
}

// The lanes of chunk c of a row of `chunks` 16-float chunks whose last one holds `last`.
inline __mmask16 lanes(int64_t c, int64_t chunks, __mmask16 last) {
  return c + 1 == chunks ? last : static_cast<__mmask16>(0xFFFF);
}

// q . k for one key (prefetching the key `next_row` floats times kPrefetchKeys ahead).
AVX512 inline float dot(const __m512* qv, const float* k, int64_t next_row, int64_t chunks, __mmask16 last) {
  prefetch(k + kPrefetchKeys * next_row, chunks);
  __m512 sum = _mm512_mul_ps(qv[0], _mm512_maskz_loadu_ps(lanes(0, chunks, last), k));
  for (int64_t c = 1; c < chunks; ++c)
    sum = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(lanes(c, chunks, last), k + c * 16), sum);
  return _mm512_reduce_add_ps(sum);
}

// acc += weight * v for one value row (nothing for a zero weight: masked or underflowed keys).
AVX512 inline void accumulate(__m512* acc, float weight, const float* v, int64_t next_row, int64_t chunks,
                              __mmask16 last) {
  if (weight == 0.f) return;
  const __m512 p = _mm512_set1_ps(weight);
  prefetch(v + kPrefetchKeys * next_row, chunks);
  for (int64_t c = 0; c < chunks; ++c)
    acc[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(lanes(c, chunks, last), v + c * 16), acc[c]);
}

AVX512 void attend(const Head& a, float scale, float* scores) {
  const int64_t chunks = (a.dh + 15) / 16;
  const __mmask16 last = static_cast<__mmask16>(a.dh % 16 ? (1u << (a.dh % 16)) - 1 : 0xFFFF);
  auto lanes = [&](int64_t c) { return ::lanes(c, chunks, last); };
  const int64_t shared = a.prefix_blocks * a.block, keys = shared + a.keys;  // scores: prefix keys, then own
  for (int64_t i = 0; i < a.queries; ++i) {
    const float* q = a.q + i * a.q_row;
    const bool* mask = a.mask ? a.mask + i * a.mask_row : nullptr;
    const float* bias = a.bias ? a.bias + i * a.mask_row : nullptr;
    __m512 qv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c)
      qv[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(c), q + c * 16), _mm512_set1_ps(scale));
    float top = -INFINITY;
    for (int64_t s = 0; s < a.prefix_blocks; ++s) {
      for (int64_t j = 0; j < a.block; ++j) {
        float& score = scores[s * a.block + j];
        score = dot(qv, a.prefix_k[s] + j * a.dh, a.dh, chunks, last);
        top = std::max(top, score);
      }
    }
    for (int64_t j = 0; j < a.keys; ++j) {
      float& score = scores[shared + j];
      if (mask && !mask[j]) {
        score = -INFINITY;
        continue;
      }
      score = dot(qv, a.k + j * a.kv_row, a.kv_row, chunks, last);
      if (bias) score += bias[j];
      top = std::max(top, score);
    }
    float* out = a.out + i * a.out_row;
    if (top == -INFINITY) {  // nothing to attend to
      for (int64_t c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(out + c * 16, lanes(c), _mm512_setzero_ps());
      continue;
    }
    const __m512 shift = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
      const __mmask16 m = keys - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (keys - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(m, tserve::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), shift)));
      _mm512_mask_storeu_ps(scores + j, m, e);
      total = _mm512_add_ps(total, e);
    }
    __m512 acc[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < a.prefix_blocks; ++s)
      for (int64_t j = 0; j < a.block; ++j) accumulate(acc, scores[s * a.block + j], a.prefix_v[s] + j * a.dh, a.dh, chunks, last);
    for (int64_t j = 0; j < a.keys; ++j) accumulate(acc, scores[shared + j], a.v + j * a.kv_row, a.kv_row, chunks, last);
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int64_t c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(out + c * 16, lanes(c), _mm512_mul_ps(acc[c], inv));
  }
}

// The prefix blocks a row reads: checked once per call; pointers per (row, head) looked up in the table.
struct PrefixBlocks {
  std::vector<const float*> data;  // each block's first float
  torch::Tensor table;             // (B, M) int64, contiguous
  int64_t layer = 0, heads = 0, block = 0, dh = 0;

  // Row `b`, KV head `h`: its blocks' first keys and values, in table order.
  int64_t lookup(int64_t b, int64_t h, std::vector<const float*>& keys, std::vector<const float*>& values) const {
    keys.clear(), values.clear();
    if (data.empty()) return 0;
    const int64_t* row = table.data_ptr<int64_t>() + b * table.size(1);
    const int64_t head_block = block * dh, kind = heads * head_block;  // floats per (head, block), per K or V
    for (int64_t s = 0; s < table.size(1) && row[s] >= 0; ++s) {
      const float* base = data[row[s]] + layer * 2 * kind + h * head_block;
      keys.push_back(base);
      values.push_back(base + kind);
    }
    return static_cast<int64_t>(keys.size());
  }
};

}  // namespace

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// q (B, H, Tq, Dh); k, v (B, H_kv, T, Dh), H_kv dividing H, with unit stride along Dh (cache slices are fine); mask bool
// or float32 (added to the scores of the row's own keys), broadcastable to (B, 1 or H, 1 or Tq, T), or None. prefix_blocks / prefix_table / layer: a shared prefix (the
// header); no blocks: none.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask, const std::vector<torch::Tensor>& prefix_blocks,
                               const c10::optional<torch::Tensor>& prefix_table, int64_t layer) {
  TORCH_CHECK(has_avx512(), "decode attention: this CPU has no AVX-512");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode attention: q, k, v must be (B, H, T, Dh)");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->stride(3) == 1,
                "decode attention: float32 CPU tensors with unit stride along Dh");
  const int64_t b = q.size(0), h = q.size(1), tq = q.size(2), dh = q.size(3), t = k.size(2), kv_heads = k.size(1);
  TORCH_CHECK(dh <= kMaxChunks * 16, "decode attention: head dim above ", kMaxChunks * 16);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == b && kv_heads > 0 && h % kv_heads == 0 && k.size(3) == dh &&
              k.stride(2) == v.stride(2), "decode attention: k and v must match q (KV heads dividing its heads) and each other");
  const int64_t group = h / kv_heads;  // query heads per KV head
  at::Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK((mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat) && mask->dim() == 4 &&
                mask->size(3) == t && mask->device().is_cpu(),
                "decode attention: mask must be bool or float32, broadcastable to (B, H, Tq, T)");
    m = mask->stride(3) == 1 ? *mask : mask->contiguous();
    m = m.expand({b, h, tq, t});
  }
  PrefixBlocks prefix;
  if (!prefix_blocks.empty()) {
    TORCH_CHECK(prefix_table.has_value() && prefix_table->dim() == 2 && prefix_table->size(0) == b &&
                prefix_table->scalar_type() == at::kLong && prefix_table->device().is_cpu(),
                "decode attention: a prefix needs an int64 CPU block table (B, M)");
    const auto& first = prefix_blocks[0];
    TORCH_CHECK(first.dim() == 5 && first.size(1) == 2 && first.size(2) == kv_heads && first.size(4) == dh &&
                layer >= 0 && layer < first.size(0), "decode attention: prefix blocks must be (layers, 2, H_kv, block, Dh)");
    for (const auto& block : prefix_blocks) {
      TORCH_CHECK(block.sizes() == first.sizes() && block.is_contiguous() && block.device().is_cpu() &&
                  block.scalar_type() == at::kFloat, "decode attention: prefix blocks alike, float32, contiguous");
      prefix.data.push_back(block.data_ptr<float>());
    }
    prefix.table = prefix_table->contiguous();
    const int64_t n = static_cast<int64_t>(prefix.data.size());
    TORCH_CHECK(prefix.table.numel() == 0 || (prefix.table.max().item<int64_t>() < n && prefix.table.min().item<int64_t>() >= -1),
                "decode attention: a block table entry names no block");
    prefix.layer = layer, prefix.heads = kv_heads, prefix.block = first.size(3), prefix.dh = dh;
  }
  const int64_t most_shared = prefix.data.empty() ? 0 : prefix.table.size(1) * prefix.block;
  // (B, H, Tq, Dh) laid out (B, Tq, H, Dh): merging the heads for the out projection is then a view, not a copy
  torch::Tensor out = torch::empty({b, tq, h, dh}, q.options()).transpose(1, 2);
  const float scale = 1.f / std::sqrt(static_cast<float>(dh));
  const bool additive = m.defined() && m.scalar_type() == at::kFloat;
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(most_shared + t + 16);
    std::vector<const float*> prefix_k, prefix_v;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bi = i / h, hi = i % h, kv = hi / group;
      Head head{q.data_ptr<float>() + bi * q.stride(0) + hi * q.stride(1),
                k.data_ptr<float>() + bi * k.stride(0) + kv * k.stride(1),
                v.data_ptr<float>() + bi * v.stride(0) + kv * v.stride(1),
                m.defined() && !additive ? m.data_ptr<bool>() + bi * m.stride(0) + hi * m.stride(1) : nullptr,
                additive ? m.data_ptr<float>() + bi * m.stride(0) + hi * m.stride(1) : nullptr,
                out.data_ptr<float>() + bi * out.stride(0) + hi * out.stride(1),
                q.stride(2), k.stride(2), m.defined() ? m.stride(2) : 0, out.stride(2), tq, t, dh};
      head.prefix_blocks = prefix.lookup(bi, kv, prefix_k, prefix_v);
      head.prefix_k = prefix_k.data(), head.prefix_v = prefix_v.data(), head.block = prefix.block;
      attend(head, scale, scores.data());
    }
  });
  return out;
}
