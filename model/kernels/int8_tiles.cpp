// The int8 GEMM's inner loops on AVX512-VNNI (int8_gemm.cpp has the scheme, the checks and the entry points): one
// step of k against a tile's accumulators, a tile's sums and its float epilogue, the few-row stream (tile_stream) and
// the wide products' 4-row tiles, and the row quantisation.
#include <immintrin.h>

#include "activation_math.h"
#include "int8_tiles.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>

#define UNROLL _Pragma("GCC unroll 16")

namespace tserve::int8::vnni {

namespace {

constexpr int64_t kSpanBlocks = 16;  // blocks of a few-row product whose sums are held before their outputs are stored

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

}  // namespace

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

void rows(const Problem& p, int64_t blk0, int64_t blk1, int64_t begin, int64_t end) {
  const bool gated = p.w_up != nullptr;
  if (p.streaming) {
    return gated ? stream_rows<true>(p, blk0, blk1, begin, end) : stream_rows<false>(p, blk0, blk1, begin, end);
  }
  for (int64_t blk = blk0; blk < blk1; blk += 4) {
    gated ? tiled_rows<true>(p, blk, begin, end) : tiled_rows<false>(p, blk, begin, end);
  }
}

}  // namespace tserve::int8::vnni

bool has_vnni() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"); }
