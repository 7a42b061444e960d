// Attention of a few queries per head over a KV cache, float32 on AVX-512, or AVX2 (avx2::attend) (model/native.py,
// model/attention.py).
//
// out[b, h, i] = softmax(q[b, h, i] . k[b, h, :T] / sqrt(Dh), masked) @ v[b, h, :T] for every query i, with no
// causal structure among the queries: one decoding step (one query per row), or the grouped beams of one
// source in cross-attention. Grouped-query attention: k and v may hold fewer heads (H_kv dividing H); query head
// h reads KV head h / (H / H_kv), in place (no expanded copy), the query heads of one KV head together. It reads K/V
// once per KV head at memory speed where SDPA's CPU kernel, built for long query blocks, spends 2-3x longer on one
// query. The mask is bool (True = attend), broadcast over heads
// and queries where its dims are 1. A query that may attend to nothing gets zeros (SDPA gives NaN). Or the mask is
// float32, added to the scores as SDPA adds a float attn_mask (T5's relative position bias, its masked keys at the
// lowest float: model/relative_position.py).
//
// A row may also read a shared prefix ahead of its own keys: blocks of a prefix cache (model/shared_prefix.py),
// each (layers, 2, H_kv, block, Dh) contiguous, listed per row by a block table (B, M) of indices into the blocks
// (-1 after the row's last). Every query sees every key of its row's blocks, in table order, then its own keys:
// the rows of one system prompt read one copy of it in place (paged attention for the prefix). And the beams of a
// sentence (a run of consecutive rows, beam_lead naming its first) may read the positions they share with the run's
// first row from there (beam_shared: model/kv_cache.py's share_beam_prefix).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_math.h"
#include "kernels.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace {

constexpr int64_t kMaxChunks = 16;  // head dims up to 256 (Gemma 3)
constexpr int64_t kPrefetchKeys = 8;  // keys (each Dh floats) prefetched ahead: across 4 KB pages too
// A unit's first keys only are prefetched in its K and V passes: past them the hardware's own stream keeps up, and
// the software prefetches (one per 64-byte line) only slowed it (512 keys from memory: 0.86x the time without them;
// docs/benchmarks.md, "Decode attention from memory"). A short cache (T5's self-attention, a prompt's first steps) is
// prefetched whole, as before.
constexpr int64_t kPrefetchedKeys = 64;

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
  // The mask or bias of the prefix's keys (a beam's positions shared with its group's first row: laid out as mask /
  // bias, which then start after them), or null: a prefix cache's blocks are all visible, unbiased.
  const bool* prefix_mask = nullptr;
  const float* prefix_bias = nullptr;
};

// The keys and values the thread's next unit reads first (its k and v, kv_row apart; keys 0: none), fetched while
// this unit computes: a unit's own prefetches run ahead within its keys only.
struct Next {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t kv_row = 0, keys = 0;
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

// The sums of 16 vectors' lanes, lane j of the result holding v[(j % 4) * 4 + j / 4]'s: each sum adds the same pairs
// in the same order as _mm512_reduce_add_ps (GCC's: lanes i and i + 8, then i + 4, i + 2, i + 1), so the same
// float, with the shuffles and adds shared by the 16 (31 of each instead of 16 x 7).
AVX512 inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s i and i + 8 added, lanes 8-15: v[2i + 1]'s
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int i = 0; i < 4; ++i)  // 128-bit lane k: v[4i + k]'s i and i + 4 added
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int i = 0; i < 2; ++i)  // 128-bit lane k: v[8i + k]'s i and i + 2 added (floats 0-1), v[8i + 4 + k]'s (2-3)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  // 128-bit lane k: the sums of v[k], v[4 + k], v[8 + k], v[12 + k]
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#define UNROLL _Pragma("GCC unroll 16")

// dot() of 16 keys kv_row floats apart, lane j key j's (the same products and sums, so the same floats). C: the
// chunks of a key known at compile time (unrolled: the 16 sums stay in registers, 1.3x the rate of a loop over
// `chunks`), 0: `chunks` read at run time (head dims past 64 but 128).
template <int C>
AVX512 inline __m512 dot16(const __m512* qv, const float* k, int64_t kv_row, int64_t chunks, __mmask16 last) {
  const int64_t n = C ? C : chunks;
  __m512 sums[16];
  UNROLL for (int j = 0; j < 16; ++j) {
    const float* key = k + j * kv_row;
    __m512 sum = _mm512_mul_ps(qv[0], _mm512_maskz_loadu_ps(lanes(0, n, last), key));
    UNROLL for (int64_t c = 1; c < n; ++c)
      sum = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(lanes(c, n, last), key + c * 16), sum);
    sums[(j % 4) * 4 + j / 4] = sum;  // reduce16's order: lane j ends up with key j's sum
  }
  return reduce16(sums);
}

// dot16 at the head dims served (64: SmolLM2, Llama; 128: Qwen2.5, Llama 3; 16-48: the tests' toys), else its loop.
AVX512 inline __m512 score16(const __m512* qv, const float* k, int64_t kv_row, int64_t chunks, __mmask16 last) {
  switch (chunks) {
    case 1: return dot16<1>(qv, k, kv_row, chunks, last);
    case 2: return dot16<2>(qv, k, kv_row, chunks, last);
    case 3: return dot16<3>(qv, k, kv_row, chunks, last);
    case 4: return dot16<4>(qv, k, kv_row, chunks, last);
    case 8: return dot16<8>(qv, k, kv_row, chunks, last);
    default: return dot16<0>(qv, k, kv_row, chunks, last);
  }
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

// One query's state across attend()'s passes.
struct Query {
  __m512 qv[kMaxChunks];   // q * scale
  __m512 acc[kMaxChunks];  // sum of weight * v
  __m512 tops, total;      // running maxima of its scores (lanes), sum of its weights
  const bool* mask;
  const float* bias;
  const bool* prefix_mask;  // Head's, this query's row of them
  const float* prefix_bias;
  float* out;
  float* scores;           // its row of the scratch: prefix keys' scores, then its own keys'
  float top;
};

// Query states on 64-byte boundaries (their __m512 fields are stored with aligned moves; std::vector's storage is
// not aligned so here), uninitialised (a prefill's hundreds of queries x 2 KB), grown as needed, kept across a
// thread's units.
class QueryBuffer {
 public:
  Query* take(int64_t n) {
    if (n > capacity_) bytes_.reset(new char[n * sizeof(Query) + 64]), capacity_ = n;
    return reinterpret_cast<Query*>((reinterpret_cast<uintptr_t>(bytes_.get()) + 63) & ~static_cast<uintptr_t>(63));
  }

 private:
  std::unique_ptr<char[]> bytes_;
  int64_t capacity_ = 0;
};

// accumulate() of the values [j0, j1) into NQ queries' sums of C chunks, held in registers across the block: each sum
// still adds its keys in order (the same floats), but the NQ x C chains of dependent FMAs overlap instead of each
// waiting on its sum's store and reload (16 keys x 9 query heads x Dh 64: ~2x the one-query loop's rate).
template <int C, int NQ>
AVX512 void accumulate_block(Query* qs, const float* v, int64_t kv_row, int64_t offset, int64_t j0, int64_t j1,
                             int64_t keys, __mmask16 last) {
  __m512 acc[NQ][C];
  UNROLL for (int q = 0; q < NQ; ++q)
    UNROLL for (int c = 0; c < C; ++c) acc[q][c] = qs[q].acc[c];
  for (int64_t j = j0; j < j1; ++j) {
    const float* row = v + j * kv_row;
    if (j < kPrefetchedKeys && j + kPrefetchKeys < keys) prefetch(row + kPrefetchKeys * kv_row, C);
    __m512 value[C];
    UNROLL for (int c = 0; c < C; ++c) value[c] = _mm512_maskz_loadu_ps(lanes(c, C, last), row + c * 16);
    UNROLL for (int q = 0; q < NQ; ++q) {
      const float weight = qs[q].scores[offset + j];
      if (weight == 0.f) continue;  // masked or underflowed, as accumulate()
      const __m512 p = _mm512_set1_ps(weight);
      UNROLL for (int c = 0; c < C; ++c) acc[q][c] = _mm512_fmadd_ps(p, value[c], acc[q][c]);
    }
  }
  UNROLL for (int q = 0; q < NQ; ++q)
    UNROLL for (int c = 0; c < C; ++c) qs[q].acc[c] = acc[q][c];
}

// accumulate_block over n queries, up to 4 at a time (2 for 8 chunks: 16 sums and 8 values in 32 registers).
template <int C>
void accumulate_queries(Query* qs, int64_t n, const float* v, int64_t kv_row, int64_t offset, int64_t j0, int64_t j1,
                        int64_t keys, __mmask16 last) {
  for (int64_t i = 0; i < n;) {
    const int64_t take = std::min<int64_t>(n - i, C <= 4 ? 4 : 2);
    switch (take) {
      case 4: if constexpr (C <= 4) accumulate_block<C, 4>(qs + i, v, kv_row, offset, j0, j1, keys, last); break;
      case 3: if constexpr (C <= 4) accumulate_block<C, 3>(qs + i, v, kv_row, offset, j0, j1, keys, last); break;
      case 2: accumulate_block<C, 2>(qs + i, v, kv_row, offset, j0, j1, keys, last); break;
      default: accumulate_block<C, 1>(qs + i, v, kv_row, offset, j0, j1, keys, last); break;
    }
    i += take;
  }
}

// Attention of the queries of `n` heads that read the same keys and values (the query heads of one KV head in
// grouped-query attention; n = 1 otherwise), each head's `queries` queries. Every block of 16 keys is scored for every
// query while it sits in L1, and every block of 16 values added into every query's output likewise: K and V come
// from L2 or memory once per KV head instead of once per query head. Each query's sums are the one-query loop's, in
// the same order (dot16 / dot, keys in order), so the same floats. scores: rows of `row` floats, one per query.
AVX512 void attend(const Head* heads, int64_t n, float scale, float* scores, int64_t row, QueryBuffer& buffer,
                   const Next& next) {
  const Head& a = heads[0];  // k, v, keys and the prefix: every head's here
  const int64_t chunks = (a.dh + 15) / 16;
  for (int64_t j = 0; j < std::min<int64_t>(next.keys, 16); ++j) prefetch(next.k + j * next.kv_row, chunks);
  for (int64_t j = 0; j < std::min<int64_t>(next.keys, kPrefetchKeys); ++j) prefetch(next.v + j * next.kv_row, chunks);
  const __mmask16 last = static_cast<__mmask16>(a.dh % 16 ? (1u << (a.dh % 16)) - 1 : 0xFFFF);
  auto lanes = [&](int64_t c) { return ::lanes(c, chunks, last); };
  const int64_t shared = a.prefix_blocks * a.block, keys = shared + a.keys;  // scores: prefix keys, then own
  int64_t count = 0;
  for (int64_t h = 0; h < n; ++h) count += heads[h].queries;
  Query* const first = buffer.take(count);
  const struct { Query *b, *e; Query* begin() const { return b; } Query* end() const { return e; } } qs{first, first + count};
  for (int64_t h = 0, next = 0; h < n; ++h) {
    const Head& head = heads[h];
    for (int64_t i = 0; i < head.queries; ++i, ++next) {
      Query& x = first[next];
      const float* q = head.q + i * head.q_row;
      for (int64_t c = 0; c < chunks; ++c)
        x.qv[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(c), q + c * 16), _mm512_set1_ps(scale));
      x.mask = head.mask ? head.mask + i * head.mask_row : nullptr;
      x.bias = head.bias ? head.bias + i * head.mask_row : nullptr;
      x.prefix_mask = head.prefix_mask ? head.prefix_mask + i * head.mask_row : nullptr;
      x.prefix_bias = head.prefix_bias ? head.prefix_bias + i * head.mask_row : nullptr;
      x.out = head.out + i * head.out_row;
      x.scores = scores + next * row;
      x.top = -INFINITY;
      x.tops = _mm512_set1_ps(-INFINITY);
      for (int64_t c = 0; c < chunks; ++c) x.acc[c] = _mm512_setzero_ps();
    }
  }
  for (Query& x : qs)  // the prefix's keys (keys dh apart) as the own keys' below: 16 at a time, then one at a time
    for (int64_t s = 0; s < a.prefix_blocks; ++s) {
      int64_t j = 0;
      for (; j + 16 <= a.block; j += 16) {
        const int64_t at = s * a.block + j;
        __m512 score = score16(x.qv, a.prefix_k[s] + j * a.dh, a.dh, chunks, last);
        if (x.prefix_bias) score = _mm512_add_ps(score, _mm512_loadu_ps(x.prefix_bias + at));
        if (x.prefix_mask) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.prefix_mask + at));
          score = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm_test_epi8_mask(bytes, bytes), score);
        }
        _mm512_storeu_ps(x.scores + at, score);
        x.tops = _mm512_max_ps(x.tops, score);
      }
      for (; j < a.block; ++j) {
        const int64_t at = s * a.block + j;
        float& score = x.scores[at];
        score = dot(x.qv, a.prefix_k[s] + j * a.dh, a.dh, chunks, last);
        if (x.prefix_bias) score += x.prefix_bias[at];
        if (x.prefix_mask && !x.prefix_mask[at]) score = -INFINITY;
        x.top = std::max(x.top, score);
      }
    }
  int64_t own = 0;
  for (; own + 16 <= a.keys; own += 16) {  // 16 keys at a time: one horizontal pass for their 16 sums
    // the next 16 keys, once for all the queries (no lines past the last key: a cache's unused positions, 1.5x the
    // reads of 33 keys at Dh 64)
    if (own < kPrefetchedKeys)
      for (int64_t j = own + 16; j < std::min(own + 32, a.keys); ++j) prefetch(a.k + j * a.kv_row, chunks);
    for (Query& x : qs) {
      __m512 score = score16(x.qv, a.k + own * a.kv_row, a.kv_row, chunks, last);
      if (x.bias) score = _mm512_add_ps(score, _mm512_loadu_ps(x.bias + own));
      if (x.mask) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.mask + own));
        score = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm_test_epi8_mask(bytes, bytes), score);
      }
      _mm512_storeu_ps(x.scores + shared + own, score);
      x.tops = _mm512_max_ps(x.tops, score);
    }
  }
  for (Query& x : qs) {
    x.top = std::max(x.top, _mm512_reduce_max_ps(x.tops));
    for (int64_t j = own; j < a.keys; ++j) {
      float& score = x.scores[shared + j];
      if (x.mask && !x.mask[j]) {
        score = -INFINITY;
        continue;
      }
      score = dot(x.qv, a.k + j * a.kv_row, j + kPrefetchKeys < a.keys ? a.kv_row : 0, chunks, last);
      if (x.bias) score += x.bias[j];
      x.top = std::max(x.top, score);
    }
    if (x.top == -INFINITY) {  // nothing to attend to: zeros, and no weights below
      for (int64_t c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(x.out + c * 16, lanes(c), _mm512_setzero_ps());
      x.out = nullptr;
      continue;
    }
    const __m512 shift = _mm512_set1_ps(x.top);
    x.total = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
      const __mmask16 m = keys - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (keys - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(m, tserve::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x.scores + j), shift)));
      _mm512_mask_storeu_ps(x.scores + j, m, e);
      x.total = _mm512_add_ps(x.total, e);
    }
  }
  // Values [j0, j1) of `values`, kv_row floats apart, into every query (weights from its scores at offset): 16 at a time
  // (a query with nothing to attend to adds -inf weights into sums never stored); the prefix's, then the own ones.
  auto add_values = [&](const float* v, int64_t kv_row, int64_t offset, int64_t j0, int64_t j1, int64_t values) {
    switch (chunks) {
      case 1: return accumulate_queries<1>(first, count, v, kv_row, offset, j0, j1, values, last);
      case 2: return accumulate_queries<2>(first, count, v, kv_row, offset, j0, j1, values, last);
      case 3: return accumulate_queries<3>(first, count, v, kv_row, offset, j0, j1, values, last);
      case 4: return accumulate_queries<4>(first, count, v, kv_row, offset, j0, j1, values, last);
      case 8: return accumulate_queries<8>(first, count, v, kv_row, offset, j0, j1, values, last);
      default:
        for (Query& x : qs)
          for (int64_t j = j0; j < j1; ++j)
            accumulate(x.acc, x.scores[offset + j], v + j * kv_row, j + kPrefetchKeys < values ? kv_row : 0, chunks,
                       last);
    }
  };
  for (int64_t s = 0; s < a.prefix_blocks; ++s)
    for (int64_t j0 = 0; j0 < a.block; j0 += 16) add_values(a.prefix_v[s], a.dh, s * a.block, j0, std::min(j0 + 16, a.block), a.block);
  for (int64_t j0 = 0; j0 < a.keys; j0 += 16) add_values(a.v, a.kv_row, shared, j0, std::min(j0 + 16, a.keys), a.keys);
  for (Query& x : qs) {
    if (x.out == nullptr) continue;
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(x.total));
    for (int64_t c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(x.out + c * 16, lanes(c), _mm512_mul_ps(x.acc[c], inv));
  }
}

// attend() on 8-lane AVX2 vectors (avx2_math.h), for CPUs without AVX-512: each query alone, its scores, their
// softmax, then its weighted values (keys in order; the sums in another order than attend()'s).
namespace avx2 {

using tserve::avx2::load_first;

constexpr int64_t kMaxChunks = ::kMaxChunks * 2;  // 8-float chunks of the largest head

// The scaled query's dot product with one key of dh floats.
TSERVE_AVX2 inline float score(const __m256* qv, const float* k, int64_t dh) {
  __m256 sum = _mm256_setzero_ps();
  for (int64_t c = 0; c * 8 < dh; ++c) sum = _mm256_fmadd_ps(qv[c], load_first(k + c * 8, dh - c * 8), sum);
  return tserve::avx2::reduce_add(sum);
}

// acc += weight * v for one value row (nothing for a zero weight: masked or underflowed keys).
TSERVE_AVX2 inline void accumulate(__m256* acc, float weight, const float* v, int64_t dh) {
  if (weight == 0.f) return;
  const __m256 p = _mm256_set1_ps(weight);
  for (int64_t c = 0; c * 8 < dh; ++c) acc[c] = _mm256_fmadd_ps(p, load_first(v + c * 8, dh - c * 8), acc[c]);
}

// Query i of `head` (its prefix's keys, then its own); scores: a scratch row of the prefix's and own keys.
TSERVE_AVX2 void attend_query(const Head& head, int64_t i, float scale, float* scores) {
  const int64_t dh = head.dh, shared = head.prefix_blocks * head.block, keys = shared + head.keys;
  const float* q = head.q + i * head.q_row;
  const bool* mask = head.mask ? head.mask + i * head.mask_row : nullptr;
  const float* bias = head.bias ? head.bias + i * head.mask_row : nullptr;
  const bool* prefix_mask = head.prefix_mask ? head.prefix_mask + i * head.mask_row : nullptr;
  const float* prefix_bias = head.prefix_bias ? head.prefix_bias + i * head.mask_row : nullptr;
  float* out = head.out + i * head.out_row;
  __m256 qv[kMaxChunks], acc[kMaxChunks];
  for (int64_t c = 0; c * 8 < dh; ++c) {
    qv[c] = _mm256_mul_ps(load_first(q + c * 8, dh - c * 8), _mm256_set1_ps(scale));
    acc[c] = _mm256_setzero_ps();
  }
  float top = -INFINITY;
  for (int64_t s = 0; s < head.prefix_blocks; ++s)
    for (int64_t j = 0; j < head.block; ++j) {
      const int64_t at = s * head.block + j;
      float& x = scores[at];
      x = score(qv, head.prefix_k[s] + j * dh, dh);
      if (prefix_bias) x += prefix_bias[at];
      if (prefix_mask && !prefix_mask[at]) x = -INFINITY;
      top = std::max(top, x);
    }
  for (int64_t j = 0; j < head.keys; ++j) {
    float& x = scores[shared + j];
    if (mask && !mask[j]) {
      x = -INFINITY;
      continue;
    }
    x = score(qv, head.k + j * head.kv_row, dh);
    if (bias) x += bias[j];
    top = std::max(top, x);
  }
  if (top == -INFINITY) {  // nothing to attend to: zeros
    for (int64_t c = 0; c * 8 < dh; ++c) tserve::avx2::store_first(out + c * 8, _mm256_setzero_ps(), dh - c * 8);
    return;
  }
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < keys; j += 8) {
    const __m256 e = tserve::avx2::exp_first(scores + j, keys - j, shift);
    tserve::avx2::store_first(scores + j, e, keys - j);
    total = _mm256_add_ps(total, e);
  }
  for (int64_t s = 0; s < head.prefix_blocks; ++s)
    for (int64_t j = 0; j < head.block; ++j) accumulate(acc, scores[s * head.block + j], head.prefix_v[s] + j * dh, dh);
  for (int64_t j = 0; j < head.keys; ++j) accumulate(acc, scores[shared + j], head.v + j * head.kv_row, dh);
  const __m256 inv = _mm256_set1_ps(1.f / tserve::avx2::reduce_add(total));
  for (int64_t c = 0; c * 8 < dh; ++c) tserve::avx2::store_first(out + c * 8, _mm256_mul_ps(acc[c], inv), dh - c * 8);
}

// attend()'s work: every query of the n heads.
void attend(const Head* heads, int64_t n, float scale, float* scores) {
  for (int64_t h = 0; h < n; ++h)
    for (int64_t i = 0; i < heads[h].queries; ++i) attend_query(heads[h], i, scale, scores);
}

}  // namespace avx2

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
                               const c10::optional<torch::Tensor>& prefix_table, int64_t layer,
                               const c10::optional<torch::Tensor>& beam_lead,
                               const c10::optional<torch::Tensor>& beam_shared) {
  TORCH_CHECK(has_vector_kernels(), "decode attention: this CPU has neither AVX-512 nor AVX2");
  const bool avx512 = wide_vectors();
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
  // Beams: row r's first beam_shared[r] positions equal row beam_lead[r]'s (its sentence's first beam: the same
  // tokens, copied there by the search's reorders); a sentence's beams are consecutive rows, their lead the first
  // (the lead of a row alone is itself). The other rows read those positions from the lead as a prefix block (scored
  // and summed as their own keys are, in order: the same floats), and a run's units of one head follow each other, so
  // the lead's keys come from memory once and from the cache for the others. Runs may differ in width (the serving
  // engine's requests). Only over the cache's own (B, H_kv, T, Dh) layout (keys dh apart), without a prefix cache.
  const int64_t *shared_of = nullptr, *lead_of = nullptr;
  if (beam_shared.has_value() || beam_lead.has_value()) {
    TORCH_CHECK(beam_shared.has_value() && beam_lead.has_value(), "decode attention: beam_lead and beam_shared together");
    for (const auto* beams : {&*beam_lead, &*beam_shared})
      TORCH_CHECK(beams->scalar_type() == at::kLong && beams->dim() == 1 && beams->size(0) == b &&
                  beams->is_contiguous() && beams->device().is_cpu(),
                  "decode attention: beam_lead and beam_shared must be int64 (B,)");
    const int64_t *shared = beam_shared->data_ptr<int64_t>(), *lead = beam_lead->data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(shared, shared + b, [t](int64_t n) { return n >= 0 && n <= t; }),
                "decode attention: beam_shared outside [0, T]");
    for (int64_t r = 0; r < b; ++r)
      TORCH_CHECK(lead[r] == r || (r > 0 && lead[r] == lead[r - 1]),
                  "decode attention: beam_lead must name each run's first row (runs of consecutive rows)");
    if (prefix.data.empty() && k.stride(2) == dh && v.stride(2) == dh) shared_of = shared, lead_of = lead;
  }
  // (B, H, Tq, Dh) laid out (B, Tq, H, Dh): merging the heads for the out projection is then a view, not a copy
  torch::Tensor out = torch::empty({b, tq, h, dh}, q.options()).transpose(1, 2);
  const float scale = 1.f / std::sqrt(static_cast<float>(dh));
  const bool additive = m.defined() && m.scalar_type() == at::kFloat;
  // Units of work: (row, KV head), its query heads together (attend); with fewer such units than two per thread, each
  // query head alone, as many units as heads (b = 1 on 2 threads: 3 KV heads would leave one thread idle a third).
  const int64_t together = b * kv_heads >= 2 * at::get_num_threads() ? group : 1;
  const int64_t units_per_row = h / together;
  // Each unit's (row, first query head): row after row, a beam run's rows after each other per head.
  std::vector<std::pair<int64_t, int64_t>> units;
  units.reserve(b * units_per_row);
  for (int64_t first = 0, next = 1; first < b; first = next++) {
    while (lead_of && next < b && lead_of[next] == first) ++next;
    for (int64_t u = 0; u < units_per_row; ++u)
      for (int64_t r = first; r < next; ++r) units.emplace_back(r, u * together);
  }
  at::parallel_for(0, b * units_per_row, 1, [&](int64_t begin, int64_t end) {
    const int64_t row = most_shared + t + 32;
    std::vector<float> scores(together * tq * row);
    QueryBuffer queries;
    std::vector<Head> heads(together);
    std::vector<const float*> prefix_k, prefix_v;
    for (int64_t i = begin; i < end; ++i) {
      const auto [bi, first] = units[i];
      const int64_t kv = first / group;
      int64_t shared_blocks = prefix.lookup(bi, kv, prefix_k, prefix_v);
      const int64_t lead = lead_of ? lead_of[bi] : bi, shared = lead != bi ? shared_of[bi] : 0;  // keys read from lead
      if (shared > 0) {
        prefix_k.assign(1, k.data_ptr<float>() + lead * k.stride(0) + kv * k.stride(1));
        prefix_v.assign(1, v.data_ptr<float>() + lead * v.stride(0) + kv * v.stride(1));
        shared_blocks = 1;
      }
      for (int64_t u = 0; u < together; ++u) {
        const int64_t hi = first + u;
        const bool* mask_at = m.defined() && !additive ? m.data_ptr<bool>() + bi * m.stride(0) + hi * m.stride(1) : nullptr;
        const float* bias_at = additive ? m.data_ptr<float>() + bi * m.stride(0) + hi * m.stride(1) : nullptr;
        heads[u] = Head{q.data_ptr<float>() + bi * q.stride(0) + hi * q.stride(1),
                        k.data_ptr<float>() + bi * k.stride(0) + kv * k.stride(1) + shared * k.stride(2),
                        v.data_ptr<float>() + bi * v.stride(0) + kv * v.stride(1) + shared * v.stride(2),
                        mask_at ? mask_at + shared : nullptr, bias_at ? bias_at + shared : nullptr,
                        out.data_ptr<float>() + bi * out.stride(0) + hi * out.stride(1),
                        q.stride(2), k.stride(2), m.defined() ? m.stride(2) : 0, out.stride(2), tq, t - shared, dh};
        heads[u].prefix_blocks = shared_blocks;
        heads[u].prefix_k = prefix_k.data(), heads[u].prefix_v = prefix_v.data();
        heads[u].block = shared > 0 ? shared : prefix.block;
        if (shared > 0) heads[u].prefix_mask = mask_at, heads[u].prefix_bias = bias_at;
      }
      Next next;
      if (i + 1 < end) {
        const auto [nb, nfirst] = units[i + 1];
        const int64_t nkv = nfirst / group;
        next = Next{k.data_ptr<float>() + nb * k.stride(0) + nkv * k.stride(1),
                    v.data_ptr<float>() + nb * v.stride(0) + nkv * v.stride(1), k.stride(2), t};
      }
      if (avx512)
        attend(heads.data(), together, scale, scores.data(), row, queries, next);
      else
        avx2::attend(heads.data(), together, scale, scores.data());
    }
  });
  return out;
}
