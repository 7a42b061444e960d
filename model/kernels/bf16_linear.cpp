// bf16 linear layers on AVX512-BF16 CPUs (AMD Zen 4, Intel Cooper Lake and later): y = x W^T + b with W stored in
// bf16, x rounded to bf16 per call, products summed in float32 (model/bf16_linear.py).
//
// VDPBF16PS multiplies 16 pairs of bf16 by 16 pairs and adds each pair's two products to a float32 lane, so the
// weights are packed once (model.bf16_linear.pack) as panels of 32 outputs, (ceil(N / 32), ceil(K / 2), 32, 2): one
// panel row is the next pair of inputs for 32 outputs, two vectors, and each panel one contiguous run. x is rounded
// to bf16 first (round to nearest even, NaN kept quiet: the same bits as PyTorch's x.bfloat16(), so ours and the
// torch fallback differ only in the order of the float32 sums), zero-padded to an even K, then every tile
// broadcasts a row's pair of inputs (32 bits) against the panel's two vectors: the structure of packed_linear.cpp
// (tiles of up to 6 rows x 2 panels in registers, 1-row products walking up to 4 panels side by side, blocks of
// rows kept in L2, prefetch by model/cpu.py's PanelTuning), with half the weight bytes and twice the products per
// instruction; products of 2-32 rows (decoding) take one panel at a time, its rows in groups of up to 10 one
// after another (stream_panel). Panels are spread over ATen's threads.
// CPUs without AVX512-BF16 (AMD Zen 2 and 3, Intel before Cooper Lake) run an AVX2 and FMA twin (namespace avx2) over
// the same panels: half of float32's bytes at batch 1, where a float32 copy of the weights per call (the torch
// fallback) took 4x float32's time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_math.h"
#include "kernels.h"
#include "simd_math.h"
#include "spread_prefetch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int64_t kPanel = 32;       // outputs per panel: two vectors of float32 sums
constexpr int64_t kMaxTileRows = 6;  // 6 rows x 2 panels x 2 accumulators + 4 weight vectors + a broadcast: 29 of 32
constexpr int64_t kMaxGemvRows = 2;  // tiles that may walk 4 panels at once
// Products of 2 to kStreamRows rows stream the weights from memory once (stream_panel): each panel in turn, its rows
// in groups of up to kGroupRows rows one after another, the first group reading the panel from memory and the others
// from the caches right after it. Up to kUnaidedRows rows the hardware prefetchers keep up unaided (5 rows took 0.87x
// the time of prefetching); a larger first group (6-8 VDPBF16PS a 64-byte line come near the core's rate at the read
// rate) prefetches by the tuning's streaming rule, 8 KB ahead into L2 on Zen 4 (6-8 rows 0.9-0.95x the time unaided:
// reading and computing overlap). Past 8 rows the products are compute-bound (one 512-bit VDPBF16PS a cycle on Zen 4:
// 8 rows a 64-byte line take about as long as reading it at 30 GB/s), so the groups after the first compute from the
// cache the panel the first has just streamed, at the core's rate: kGroupRows (see stream_panel) keeps the first
// group near 8 rows.
constexpr int64_t kStreamRows = 32;
constexpr int64_t kGroupRows = 10;
constexpr int64_t kUnaidedRows = 5;

struct Problem {
  const uint16_t* x;       // (rows, k2 * 2) bf16 bits, zero-padded
  const uint16_t* panels;  // (panels, k2, 32, 2) bf16 bits
  const float* bias;       // (n,) or null
  float* y;                // (rows, n) contiguous
  int64_t rows, k2, n;
  PanelTuning rule;
};

// Rows of x (rows, k) float32 -> bf16 bits (rows, k2 * 2), RNE as c10::BFloat16 rounds (NaN -> 0x7FC0).
BF16 void round_rows(const float* x, uint16_t* out, int64_t rows, int64_t k, int64_t padded) {
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * k;
    uint16_t* dst = out + r * padded;
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 m = tserve::first_lanes(k - i);
      const __m512 v = _mm512_maskz_loadu_ps(m, src + i);
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
      __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, half)), 16);
      rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
      _mm256_mask_storeu_epi16(dst + i, m, _mm512_cvtepi32_epi16(rounded));
    }
    if (padded > k) dst[k] = 0;
  }
}

// acc + the products of a's and b's bf16 pairs (VDPBF16PS). Not GCC 12's _mm512_dpbf16_ps: its __m512bh casts
// kept every tile's accumulators on the stack (a store and a load around each product, 2.5-3.5x slower at 16-64
// rows); this asm keeps them in registers.
BF16 inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// y[r0 .. r0 + R, 32 p .. 32 (p + S)) for the S panels p .. p + S - 1 walked side by side, the outputs past n left
// out; prefetching `ahead` panel rows ahead in each panel (none unless Prefetch).
template <int R, int S, _mm_hint Hint, bool Prefetch = true>
BF16 void tile(const Problem& q, int64_t p, int64_t r0, int64_t ahead) {
  __m512 acc[R][S][2];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s][0] = acc[r][s][1] = _mm512_setzero_ps();
  const uint16_t* panel = q.panels + p * q.k2 * kPanel * 2;
  const uint16_t* x = q.x + r0 * q.k2 * 2;
  for (int64_t i = 0; i < q.k2; ++i) {
    __m512i w[S][2];
    for (int s = 0; s < S; ++s) {
      const uint16_t* row = panel + (s * q.k2 + i) * kPanel * 2;
      if constexpr (Prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(row + ahead * kPanel * 2), Hint);
        _mm_prefetch(reinterpret_cast<const char*>(row + ahead * kPanel * 2 + 32), Hint);
      }
      w[s][0] = _mm512_loadu_si512(row);
      w[s][1] = _mm512_loadu_si512(row + 32);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * q.k2 * 2 + i * 2, sizeof(pair));
      const __m512i xr = _mm512_set1_epi32(pair);
      for (int s = 0; s < S; ++s) {
        acc[r][s][0] = dot_pairs(acc[r][s][0], xr, w[s][0]);
        acc[r][s][1] = dot_pairs(acc[r][s][1], xr, w[s][1]);
      }
    }
  }
  tserve::store_panel_tile<R, S>(acc, q.bias, q.y, q.n, r0, p);
}

// A tile of R rows over S panels under the tuning's prefetch rule for its width.
template <int R, int S = 1>
void tile(const Problem& q, int64_t p, int64_t r0) {
  if (R > q.rule.streaming_tile_rows) return tile<R, S, _MM_HINT_T0>(q, p, r0, q.rule.prefetch_rows);
  const int64_t ahead = q.rule.streaming_prefetch_rows;
  if (q.rule.streaming_into_l2) return tile<R, S, _MM_HINT_T1>(q, p, r0, ahead);
  tile<R, S, _MM_HINT_T0>(q, p, r0, ahead);
}

template <int S>
void tile_rows(const Problem& q, int64_t p, int64_t r0, int64_t rows) {
  switch (rows) {
    case 1: return tile<1, S>(q, p, r0);
    case 2: return tile<2, S>(q, p, r0);
    case 3: return tile<3, S>(q, p, r0);
    case 4: return tile<4, S>(q, p, r0);
    case 5: return tile<5, S>(q, p, r0);
    default: return tile<6, S>(q, p, r0);
  }
}

// Rows r0 .. r0 + rows (at most kMaxTileRows) over `panels` panels from p: 4 only for tiles of up to kMaxGemvRows.
void tile_rows(const Problem& q, int64_t p, int64_t r0, int64_t rows, int64_t panels) {
  if (panels == 4) return rows == 1 ? tile<1, 4>(q, p, r0) : tile<2, 4>(q, p, r0);
  if (panels == 2) return tile_rows<2>(q, p, r0, rows);
  tile_rows<1>(q, p, r0, rows);
}

// Rows r0 .. r0 + R of a product over panel p, the panel one sequential stream from memory (`first`, the panel's
// first group) or from the caches where an earlier group has just read it. Each output's sum runs over the pairs in
// the same order as in tile_rows' tiles, so the outputs are the same bits.
template <int R>
void stream_tile(const Problem& q, int64_t p, int64_t r0, bool first) {
  if constexpr (R > kUnaidedRows) {
    if (first) {
      const int64_t ahead = q.rule.streaming_prefetch_rows;
      if (q.rule.streaming_into_l2) return tile<R, 1, _MM_HINT_T1>(q, p, r0, ahead);
      return tile<R, 1, _MM_HINT_T0>(q, p, r0, ahead);
    }
  }
  tile<R, 1, _MM_HINT_T0, false>(q, p, r0, 0);
}

void stream_group(const Problem& q, int64_t p, int64_t r0, int64_t rows, bool first) {
  switch (rows) {
    case 2: return stream_tile<2>(q, p, r0, first);
    case 3: return stream_tile<3>(q, p, r0, first);
    case 4: return stream_tile<4>(q, p, r0, first);
    case 5: return stream_tile<5>(q, p, r0, first);
    case 6: return stream_tile<6>(q, p, r0, first);
    case 7: return stream_tile<7>(q, p, r0, first);
    case 8: return stream_tile<8>(q, p, r0, first);
    case 9: return stream_tile<9>(q, p, r0, first);
    default: return stream_tile<10>(q, p, r0, first);
  }
}

// A product of 2 to kStreamRows rows over panel p: its rows in groups of equal sizes, at most kGroupRows. On
// SmolLM2-135M's step linears at 1 thread (docs/benchmarks.md, "One pass over the bf16 weights at a few rows"), 7-8
// rows took 0.57-0.7x the time of two passes of 4-row x 2-panel tiles (the second pass computed from L2 after the
// first's stream, not during it), 5-6 rows 0.8x a 2-panel tile prefetching 4 KB into L1, 2-4 rows 0.85-0.95x 2 or 4
// panels side by side (2-4 streams) prefetching into L2; with the weights in L2 (576x576, 3072x576) 2-8 rows ran at
// 0.93-1.04x the old tiles. 1 row keeps 4 panels: one panel took the same time on these linears but SmolLM2-135M's
// greedy b1 decode 1.19x as long. 9-32 rows (issue 40, session 31: opus-mt's and gpt2-small's step linears from
// memory at 1 thread, probed against the blocked 6-row x 2-panel tiles they took before, whose first tile streamed
// 2 panels at 6 VDPBF16PS a line and whose later tiles read them back from L2): 9 rows 0.74-0.78x the time, 12-16
// rows 0.84-0.93x, 24-32 rows 0.89-0.94x; 16 rows at 73-80% of the core's VDPBF16PS rate (67% before). Groups of
// up to 10 rows (9-10 rows one group, 12 two of 6, 24 three of 8) came within 3% of groups of up to 8, 12 or 14 at
// every row count, each of those worse somewhere (9 rows as 5 + 4: 1.1x; 24 as 12 + 12: 1.05x); the broadcast folded
// into VDPBF16PS (m32bcst) ran 2.5x slower on Zen 4.
void stream_panel(const Problem& q, int64_t p) {
  const int64_t groups = (q.rows + kGroupRows - 1) / kGroupRows, per_group = (q.rows + groups - 1) / groups;
  for (int64_t r0 = 0; r0 < q.rows; r0 += per_group)
    stream_group(q, p, r0, std::min(per_group, q.rows - r0), r0 == 0);
}

// The twin for CPUs with AVX2 and FMA: each 32-bit pair of a panel row splits into two float32 weights (the low
// bf16 shifted up, the high one masked), multiplied by x's bf16 values (kept as float32) in FMAs, so each output sums
// even input, odd input, next pair, ... in float32 (the products exact, as VDPBF16PS's). A panel is read in blocks of
// kBlockPairs pair rows (8 KB), each block for the rows two by two: the first two read it from memory, the others
// from L1 (one stream from memory, as the float32 AVX2 tiles of 3-4 rows read theirs); the sums wait in a buffer
// between blocks. Past kWidenRows rows each block is first widened into float32 weights (16 KB), which the rows then
// multiply in tiles of up to 6 rows x 16 columns as the float32 tiles do: the split made once a block, not once for
// every pair of rows (the same FMAs in the same order, so the same bits).
namespace avx2 {

constexpr int64_t kBlockPairs = 64;
constexpr int64_t kWidenRows = 4;

// Rows of x (rows, k) -> their bf16 values as float32 (rows, padded), RNE as c10::BFloat16 rounds, zero-padded.
void round_rows(const float* x, float* out, int64_t rows, int64_t k, int64_t padded) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < k; ++i) out[r * padded + i] = static_cast<float>(c10::BFloat16(x[r * k + i]));
    std::fill(out + r * padded + k, out + (r + 1) * padded, 0.f);
  }
}

// Rows x[0 .. R) (row stride `padded`) times a panel's pair rows i0 .. i1, added to sums (R x 32, zeros instead when
// `first`), prefetching `ahead` pair rows ahead when `prefetch`.
template <int R, _mm_hint Hint>
TSERVE_AVX2 inline void pair_block(const uint16_t* panel, const float* x, int64_t padded, int64_t i0, int64_t i1,
                                   float* sums, bool first, bool prefetch, int64_t ahead) {
  __m256 acc[R][4];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 4; ++v)
      acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * kPanel + 8 * v);
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t i = i0; i < i1; ++i) {
    const uint16_t* row = panel + i * kPanel * 2;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead * kPanel * 2), Hint);
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead * kPanel * 2 + 32), Hint);
    }
    __m256 even[R], odd[R];
    UNROLL for (int r = 0; r < R; ++r) {
      even[r] = _mm256_broadcast_ss(x + r * padded + 2 * i);
      odd[r] = _mm256_broadcast_ss(x + r * padded + 2 * i + 1);
    }
    UNROLL for (int v = 0; v < 4; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * v));
      const __m256 low_weights = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      const __m256 high_weights = _mm256_castsi256_ps(_mm256_and_si256(w, high));
      UNROLL for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm256_fmadd_ps(even[r], low_weights, acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(odd[r], high_weights, acc[r][v]);
      }
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 4; ++v) _mm256_storeu_ps(sums + r * kPanel + 8 * v, acc[r][v]);
}

// A panel's pair rows i0 .. i1 as float32 weights (2 (i1 - i0), 32): each pair row's low bf16 then its high one (the
// block prefetched while the one before it was multiplied: float_rows).
TSERVE_AVX2 void widen_block(const uint16_t* panel, int64_t i0, int64_t i1, float* out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t i = i0; i < i1; ++i) {
    const uint16_t* row = panel + i * kPanel * 2;
    float* low_out = out + (i - i0) * 2 * kPanel;
    UNROLL for (int v = 0; v < 4; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * v));
      _mm256_store_ps(low_out + 8 * v, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      _mm256_store_ps(low_out + kPanel + 8 * v, _mm256_castsi256_ps(_mm256_and_si256(w, high)));
    }
  }
}

// Rows x[0 .. R) (row stride `padded`) times `inputs` rows of widened float32 weights (row stride 32), 16 of their
// columns (two vectors: the float32 AVX2 tiles' 6 x 2 accumulators, 2 weights and a broadcast), added to sums (row
// stride 32; zeros instead when `first`), prefetching its share of the next block.
template <int R>
TSERVE_AVX2 void float_block(const float* weights, const float* x, int64_t padded, int64_t inputs, float* sums,
                             bool first, tserve::SpreadPrefetch prefetch) {
  __m256 acc[R][2];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 2; ++v)
      acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * kPanel + 8 * v);
  for (int64_t j = 0; j < inputs; ++j) {
    prefetch.step();
    const __m256 w0 = _mm256_load_ps(weights + j * kPanel), w1 = _mm256_load_ps(weights + j * kPanel + 8);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * padded + j);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 2; ++v) _mm256_storeu_ps(sums + r * kPanel + 8 * v, acc[r][v]);
}

// float_block over a widened block's 32 columns (two passes of 16) for rows x[0 .. rows), rows at most kWideRows;
// passes `pass` and `pass + 1` of `passes` over the block, prefetching their shares of the `lines` from `next`.
constexpr int64_t kWideRows = 6;
void float_rows(const float* weights, const float* x, int64_t padded, int64_t inputs, float* sums, bool first,
                int64_t rows, const char* next, int64_t lines, int64_t pass, int64_t passes) {
  for (int64_t half = 0; half < kPanel; half += 16, ++pass) {
    const float* w = weights + half;
    float* s = sums + half;
    const tserve::SpreadPrefetch prefetch(next, lines, pass, passes, inputs);
    switch (rows) {
      case 1: float_block<1>(w, x, padded, inputs, s, first, prefetch); break;
      case 2: float_block<2>(w, x, padded, inputs, s, first, prefetch); break;
      case 3: float_block<3>(w, x, padded, inputs, s, first, prefetch); break;
      case 4: float_block<4>(w, x, padded, inputs, s, first, prefetch); break;
      case 5: float_block<5>(w, x, padded, inputs, s, first, prefetch); break;
      default: float_block<6>(w, x, padded, inputs, s, first, prefetch); break;
    }
  }
}

struct Problem {
  const float* x;          // (rows, k2 * 2): x's bf16 values, zero-padded
  const uint16_t* panels;  // (panels, k2, 32, 2) bf16 bits
  const float* bias;       // (n,) or null
  float* y;                // (rows, n) contiguous
  int64_t k2, n;
};

// y[r0 .. r1, 32 p .. 32 p + 32) (the outputs past n left out), the panel read from memory prefetching `ahead` pair
// rows ahead (past kWidenRows rows: the next block, spread over this one's passes); `sums` holds (r1 - r0) x 32 floats.
template <_mm_hint Hint>
void panel_rows(const Problem& q, int64_t p, int64_t r0, int64_t r1, int64_t ahead, float* sums) {
  const uint16_t* panel = q.panels + p * q.k2 * kPanel * 2;
  const int64_t padded = q.k2 * 2;
  const bool widen = r1 - r0 > kWidenRows;
  alignas(32) float widened[kBlockPairs * 2 * kPanel];  // 16 KB, used past kWidenRows rows
  for (int64_t i0 = 0; i0 < q.k2; i0 += kBlockPairs) {
    const int64_t i1 = std::min(q.k2, i0 + kBlockPairs);
    const bool first = i0 == 0;
    if (widen) {  // the next block (or the next panel's first) prefetched over this one's passes, not in a burst
      widen_block(panel, i0, i1, widened);
      const int64_t groups = (r1 - r0 + kWideRows - 1) / kWideRows, per_group = (r1 - r0 + groups - 1) / groups;
      const char* next = reinterpret_cast<const char*>(panel + i1 * kPanel * 2);  // or the next panel's start
      const int64_t lines = tserve::next_block_lines(i1, q.k2, kBlockPairs, p + 1 < (q.n + kPanel - 1) / kPanel,
                                                     kPanel * 2 * sizeof(uint16_t));
      for (int64_t r = r0, pass = 0; r < r1; r += per_group, pass += 2)
        float_rows(widened, q.x + r * padded + 2 * i0, padded, 2 * (i1 - i0), sums + (r - r0) * kPanel, first,
                   std::min(per_group, r1 - r), next, lines, pass, 2 * groups);
      continue;
    }
    for (int64_t r = r0; r < r1; r += 2) {
      float* s = sums + (r - r0) * kPanel;
      const float* x = q.x + r * padded;
      if (r + 1 < r1) pair_block<2, Hint>(panel, x, padded, i0, i1, s, first, r == r0, ahead);
      else pair_block<1, Hint>(panel, x, padded, i0, i1, s, first, r == r0, ahead);
    }
  }
  const int64_t c0 = p * kPanel, width = std::min<int64_t>(kPanel, q.n - c0);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < width; ++c)
      q.y[r * q.n + c0 + c] = sums[(r - r0) * kPanel + c] + (q.bias != nullptr ? q.bias[c0 + c] : 0.f);
}

// y = x W^T + b into y (rows, n) for x (rows, k) float32 contiguous, under the tuning's rule: the panel's reading
// rows prefetch by the streaming rule (none ahead at 1-2 rows unless gemv_prefetch); inputs past row_block_bytes in
// blocks of rows, each block walking the thread's panels.
void linear(const float* x, const uint16_t* panels, const float* bias, float* y, int64_t rows, int64_t k, int64_t n,
            const PanelTuning& rule) {
  const int64_t k2 = (k + 1) / 2, padded = k2 * 2, panels_n = (n + kPanel - 1) / kPanel;
  std::vector<float> rounded(rows * padded);
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / k), [&](int64_t begin, int64_t end) {
    round_rows(x + begin * k, rounded.data() + begin * padded, end - begin, k, padded);
  });
  const Problem q{rounded.data(), panels, bias, y, k2, n};
  const int64_t block = std::min(rows, std::max<int64_t>(2, rule.row_block_bytes / (padded * 4)));
  const int64_t ahead = streaming_ahead(rule, rows);
  at::parallel_for(0, panels_n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(block * kPanel);
    for (int64_t r0 = 0; r0 < rows; r0 += block)
      for (int64_t p = begin; p < end; ++p) {
        const int64_t r1 = std::min(rows, r0 + block);
        if (rule.streaming_into_l2) panel_rows<_MM_HINT_T1>(q, p, r0, r1, ahead, sums.data());
        else panel_rows<_MM_HINT_T0>(q, p, r0, r1, ahead, sums.data());
      }
  });
}

}  // namespace avx2

}  // namespace

bool has_avx512_bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// x (..., K) float32; packed (ceil(n / 32), ceil(K / 2), 32, 2) bf16 from model.bf16_linear.pack; bias (n,) or None
// -> (..., n) float32.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const c10::optional<torch::Tensor>& bias) {
  static const bool bf16_dots = has_avx512_bf16();
  const int64_t k = x.size(-1), k2 = (k + 1) / 2, panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == panels && packed.size(1) == k2 && packed.size(2) == kPanel &&
                  packed.size(3) == 2 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.device().is_cpu(),
              "bf16_linear: packed weights must be model.bf16_linear.pack's (ceil(n / 32), ceil(K / 2), 32, 2) bf16");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->scalar_type() == at::kFloat && bias->device().is_cpu()),
              "bf16_linear: bias must be a float32 CPU (n,) tensor");
  TORCH_CHECK(has_vector_kernels() && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  !at::GradMode::is_enabled(),
              "bf16_linear: float32 CPU input without autograd on an AVX-512 or AVX2 CPU only");
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  if (k == 0) return bias.has_value() ? bias->expand(sizes).contiguous() : at::zeros(sizes, x.options());
  const int64_t rows = x.numel() / k;
  torch::Tensor y = at::empty(sizes, x.options());
  if (rows == 0) return y;
  const torch::Tensor input = x.is_contiguous() ? x : x.contiguous();
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bias_data = b.defined() ? b.data_ptr<float>() : nullptr;
  const uint16_t* panel_data = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (!(bf16_dots && wide_vectors())) {
    avx2::linear(input.data_ptr<float>(), panel_data, bias_data, y.data_ptr<float>(), rows, k, n, panel_tuning());
    return y;
  }
  torch::Tensor rounded = at::empty({rows, k2 * 2}, x.options().dtype(at::kBFloat16));
  const float* src = input.data_ptr<float>();
  uint16_t* xb = reinterpret_cast<uint16_t*>(rounded.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / k), [&](int64_t begin, int64_t end) {
    round_rows(src + begin * k, xb + begin * k2 * 2, end - begin, k, k2 * 2);
  });
  const Problem q{xb, panel_data, bias_data, y.data_ptr<float>(), rows, k2, n, panel_tuning()};
  if (rows > 1 && rows <= kStreamRows) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) stream_panel(q, p);
    });
    return y;
  }
  const int64_t tiles = (rows + kMaxTileRows - 1) / kMaxTileRows, per_tile = (rows + tiles - 1) / tiles;
  const int64_t row_bytes = k2 * 4;  // a bf16 row of x
  const int64_t block = rows * row_bytes <= q.rule.row_block_bytes
                            ? rows
                            : std::max<int64_t>(1, q.rule.row_block_bytes / row_bytes / per_tile) * per_tile;
  // Each tile walks 2 panels at least (12 x 1 tiles ran at 0.95x 6 x 2 on Zen 4: docs/benchmarks.md, issue 40's
  // bf16 section); gemv_panels (4 on AMD) for 1-row products.
  const int64_t together = per_tile <= kMaxGemvRows ? std::max<int64_t>(2, q.rule.gemv_panels) : 2;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += block)
      for (int64_t p = begin, step; p < end; p += step) {
        step = p + together <= end ? together : 1;
        for (int64_t r0 = first; r0 < std::min(first + block, rows); r0 += per_tile)
          tile_rows(q, p, r0, std::min(per_tile, rows - r0), step);
      }
  });
  return y;
}
