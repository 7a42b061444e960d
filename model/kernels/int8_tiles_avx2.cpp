// The int8 GEMM's inner loops on AVX2 (CPUs without AVX512-VNNI: AMD Zen 2 and 3, Intel before Ice Lake): the twin of
// int8_tiles.cpp over the same packed weights and quantised rows, with the same int32 sums, so the same outputs.
//
// AVX2 has no vpdpbusd. Its vpmaddubsw multiplies unsigned by signed bytes into 16-bit sums of pairs, saturating: the
// rows' uint8 values around 128 against weights up to 127 (pairs up to 2 x 255 x 127) would saturate. So each row is
// taken as x - 128 (int8, |x - 128| <= 127: quantize_row's range) apart into its magnitude and its sign, the sign
// moved onto the weights (vpsignb): |x - 128| * (sign * w), pairs at most 2 x 127 x 127 = 32,258, exact; vpmaddwd by
// ones adds the pairs into int32: the dot products of x - 128 and w, which the VNNI tiles reach by subtracting
// 128 * sum(w) from theirs. A 32-byte half of a step's 64-byte line is 4 inputs of 8 outputs: one accumulator each.
#include <immintrin.h>

#include "avx2_math.h"
#include "int8_tiles.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

#define UNROLL _Pragma("GCC unroll 16")

namespace tserve::int8::avx2 {

using tserve::avx2::load_first;
using tserve::avx2::store_first;

namespace {

constexpr int64_t kSpanBlocks = 16;  // blocks of a few-row product whose sums are held before their outputs are stored
// How far ahead of its loads (bytes) a few-row stream prefetches its weights into L1. On a Zen 3 (2 threads, the
// decoder projections of a T5-base from memory) 1 KB took 5-12% less time than none at 1 and 4 rows; 512 bytes and 2-4
// KB gained less (docs/benchmarks.md, "int8 layers on AVX2").
constexpr int kStreamAhead = 1024;

// A Problem's rows [row0, ...) as the tiles read them: each row's x - 128 (its sign) and |x - 128|, k_padded bytes
// apart. Made once per call of `rows` (a few KB: the weights' bytes are rows x 16 times as many).
struct SignedRows {
  const int8_t* sign;
  const int8_t* magnitude;
  int64_t row0, k_padded;
};

// A block's int32 sums for a tile's rows: a row's two vectors of 8 outputs, then (gated) up's two.
template <int MR, bool Gated>
using BlockSums = __m256i[MR][Gated ? 4 : 2];

// The sums of rows [m0, m0 + MR) against block blk (gated: the gate's and up's, read side by side): sums[r][2m + h]
// holds matrix m's outputs 8h to 8h + 7. Ahead: bytes ahead of each matrix's loads to prefetch into L1 (0: none).
template <int MR, bool Gated, int Ahead>
TSERVE_AVX2_INLINE void tile_sums(const Problem& p, const SignedRows& x, int64_t blk, int64_t m0,
                                  BlockSums<MR, Gated>& sums) {
  constexpr int NM = Gated ? 2 : 1, NV = 2 * NM;  // weight matrices read, weight vectors a step
  const int64_t steps = p.k_padded / 4, stride = steps * 64;
  const int8_t* w[NM];
  w[0] = p.w + blk * stride;
  if constexpr (Gated) w[NM - 1] = p.w_up + blk * stride;
  const int32_t* sign[MR];
  const int32_t* magnitude[MR];
  UNROLL for (int r = 0; r < MR; ++r) {
    sign[r] = reinterpret_cast<const int32_t*>(x.sign + (m0 + r - x.row0) * x.k_padded);
    magnitude[r] = reinterpret_cast<const int32_t*>(x.magnitude + (m0 + r - x.row0) * x.k_padded);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MR][NV];
  UNROLL for (int r = 0; r < MR; ++r)
    UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
  for (int64_t s = 0; s < steps; ++s) {
    __m256i wv[NV];
    UNROLL for (int m = 0; m < NM; ++m) {
      if constexpr (Ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(w[m] + s * 64 + Ahead), _MM_HINT_T0);
      UNROLL for (int h = 0; h < 2; ++h)
        wv[2 * m + h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[m] + s * 64 + h * 32));
    }
    UNROLL for (int r = 0; r < MR; ++r) {
      const __m256i xs = _mm256_set1_epi32(sign[r][s]), xm = _mm256_set1_epi32(magnitude[r][s]);
      UNROLL for (int v = 0; v < NV; ++v) {
        const __m256i pairs = _mm256_maddubs_epi16(xm, _mm256_sign_epi8(wv[v], xs));
        acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  UNROLL for (int r = 0; r < MR; ++r)
    UNROLL for (int v = 0; v < NV; ++v) sums[r][v] = acc[r][v];
}

// The outputs of rows [m0, m0 + MR) and block blk from their sums: int8_tiles.cpp's tile_store in 8 lanes (the same
// float operations on the same dot products, so the same values).
template <int MR, bool Gated>
TSERVE_AVX2_INLINE void tile_store(const Problem& p, int64_t blk, int64_t m0, const BlockSums<MR, Gated>& sums) {
  UNROLL for (int h = 0; h < 2; ++h) {
    const int64_t n0 = blk * 16 + h * 8, left = p.n - n0;
    if (left <= 0) return;
    const __m256 sw = load_first(p.sw + n0, left);
    const __m256 bias = p.bias ? load_first(p.bias + n0, left) : _mm256_setzero_ps();
    __m256 sw_up, bias_up;
    if constexpr (Gated) {
      sw_up = load_first(p.sw_up + n0, left);
      bias_up = p.bias_up ? load_first(p.bias_up + n0, left) : _mm256_setzero_ps();
    }
    UNROLL for (int r = 0; r < MR; ++r) {
      const __m256 sx = _mm256_set1_ps(p.sx[m0 + r]);
      __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][h]), _mm256_mul_ps(sw, sx), bias);
      if (p.activation != kNoActivation) y = tserve::avx2::activate(y, static_cast<Activation>(p.activation));
      if constexpr (Gated) {
        const __m256 up = _mm256_cvtepi32_ps(sums[r][2 + h]);
        y = _mm256_mul_ps(y, _mm256_fmadd_ps(up, _mm256_mul_ps(sw_up, sx), bias_up));
      }
      store_first(p.out + (m0 + r - p.out_row0) * p.n + n0, y, left);
    }
  }
}

// Rows per tile: each row holds two accumulators per 16 outputs of each matrix, in 16 registers with the weights'.
template <bool Gated>
constexpr int kTileRows = Gated ? 2 : 4;

// Rows [m0, m0 + MR) of a few-row product against blocks [blk0, blk1) (at most kSpanBlocks) one at a time, each
// block's weights one sequential stream; the outputs stored after all the span's sums (int8_tiles.cpp's tile_stream).
template <int MR, bool Gated>
TSERVE_AVX2 void tile_stream(const Problem& p, const SignedRows& x, int64_t blk0, int64_t blk1, int64_t m0) {
  BlockSums<MR, Gated> sums[kSpanBlocks];  // at most 4 KB
  for (int64_t b = blk0; b < blk1; ++b) tile_sums<MR, Gated, kStreamAhead>(p, x, b, m0, sums[b - blk0]);
  for (int64_t b = blk0; b < blk1; ++b) tile_store<MR, Gated>(p, b, m0, sums[b - blk0]);
}

// Rows [m0, m0 + MR) against one block: its sums, then its outputs.
template <int MR, bool Gated>
TSERVE_AVX2 void tile(const Problem& p, const SignedRows& x, int64_t blk, int64_t m0) {
  BlockSums<MR, Gated> sums;
  tile_sums<MR, Gated, 0>(p, x, blk, m0, sums);
  tile_store<MR, Gated>(p, blk, m0, sums);
}

// Rows [m0, m0 + MR): a few-row product's stream over blocks [blk0, blk1), else a tile of block blk0.
template <int MR, bool Gated, bool Stream>
void run(const Problem& p, const SignedRows& x, int64_t blk0, int64_t blk1, int64_t m0) {
  if constexpr (Stream) tile_stream<MR, Gated>(p, x, blk0, blk1, m0);
  else tile<MR, Gated>(p, x, blk0, m0);
}

// `run` of the `rows` rows (1 to kTileRows) at m0.
template <bool Gated, bool Stream>
void rows_at(const Problem& p, const SignedRows& x, int64_t blk0, int64_t blk1, int64_t m0, int64_t rows) {
  if constexpr (kTileRows<Gated> == 4) {
    if (rows == 4) return run<4, Gated, Stream>(p, x, blk0, blk1, m0);
    if (rows == 3) return run<3, Gated, Stream>(p, x, blk0, blk1, m0);
  }
  if (rows == 2) return run<2, Gated, Stream>(p, x, blk0, blk1, m0);
  run<1, Gated, Stream>(p, x, blk0, blk1, m0);
}

// Rows [begin, end) against blocks [blk0, blk1): a few-row product (p.streaming) in spans of blocks, each span's
// weights from memory for its first rows and from L2 for the rest; a wider one block by block.
template <bool Gated>
void product_rows(const Problem& p, const SignedRows& x, int64_t blk0, int64_t blk1, int64_t begin, int64_t end) {
  constexpr int64_t step = kTileRows<Gated>;
  if (p.streaming) {
    for (int64_t b = blk0; b < blk1; b += kSpanBlocks)
      for (int64_t m0 = begin; m0 < end; m0 += step)
        rows_at<Gated, true>(p, x, b, std::min(blk1, b + kSpanBlocks), m0, std::min(step, end - m0));
    return;
  }
  for (int64_t b = blk0; b < blk1; ++b)  // a block's weights (16 x k bytes) stay near while every row passes
    for (int64_t m0 = begin; m0 < end; m0 += step) rows_at<Gated, false>(p, x, b, b + 1, m0, std::min(step, end - m0));
}

}  // namespace

TSERVE_AVX2 void quantize_row(const float* x, int64_t k, int64_t k_padded, uint8_t* q, float* scale) {
  __m256 amax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) amax = _mm256_max_ps(amax, tserve::avx2::abs(_mm256_loadu_ps(x + i)));
  float m = tserve::avx2::reduce_max(amax);
  for (; i < k; ++i) m = std::max(m, std::fabs(x[i]));
  const float s = m > 0 ? m / 127.f : 1.f;
  const __m256 inv = _mm256_set1_ps(1.f / s);
  const __m256i offset = _mm256_set1_epi32(128);
  i = 0;
  for (; i + 8 <= k; i += 8) {  // 8 values in 1..255: packed to bytes without saturating any
    const __m256i v = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv)), offset);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packus_epi16(words, words));
  }
  for (; i < k; ++i) q[i] = static_cast<uint8_t>(std::nearbyint(x[i] * (1.f / s)) + 128);
  for (; i < k_padded; ++i) q[i] = 128;  // zero after the offset; the padded weights are zero too
  *scale = s;
}

TSERVE_AVX2 void rows(const Problem& p, int64_t blk0, int64_t blk1, int64_t begin, int64_t end) {
  thread_local std::vector<int8_t> signed_rows;  // the pool's threads persist: grown once per size
  const int64_t bytes = (end - begin) * p.k_padded;
  if (signed_rows.size() < static_cast<size_t>(2 * bytes)) signed_rows.resize(2 * bytes);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const uint8_t* xq = p.xq + begin * p.k_padded;
  int8_t* sign = signed_rows.data();
  int8_t* magnitude = sign + bytes;
  int64_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    const __m256i s = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i)), flip);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sign + i), s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(magnitude + i), _mm256_abs_epi8(s));
  }
  for (; i < bytes; ++i) {
    sign[i] = static_cast<int8_t>(xq[i] - 128);
    magnitude[i] = static_cast<int8_t>(std::abs(sign[i]));
  }
  const SignedRows x{sign, magnitude, begin, p.k_padded};
  p.w_up != nullptr ? product_rows<true>(p, x, blk0, blk1, begin, end) : product_rows<false>(p, x, blk0, blk1, begin, end);
}

}  // namespace tserve::int8::avx2
