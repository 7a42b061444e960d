// Vector math shared by the kernels (AVX-512).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tserve {

// The polynomials of the kernels' exp and erf, at both vector widths (here and avx2_math.h), highest degree first:
// 2^f for f in [-1/2, 1/2] (relative error about 2e-7), and Abramowitz & Stegun 7.1.26's erf (|error| < 3e-7: its
// t = 1 / (1 + kErfP |x|) and the five coefficients of t^5 .. t).
inline constexpr float kExp2Poly[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                      5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};
inline constexpr float kErfP = 0.3275911f;
inline constexpr float kErfPoly[] = {1.061405429f, -1.453152027f, 1.421413741f, -0.284496736f, 0.254829592f};

// The mask of the first `left` of 16 lanes (all 16 when left >= 16): a row's last, partial vector.
inline __mmask16 first_lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x) for x <= 0 (scores minus their maximum): 2^n * p(f), relative error about 2e-7.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// A row of attention scores -> exp(score - largest) in place (width a multiple of 16); returns 1 / their sum, or 0 for
// a row that keeps no key (largest -inf: the row is zeroed, so its output is zeros).
__attribute__((target("avx512f"))) inline float softmax_row(float* p, int64_t width, float largest) {
  if (largest == -__builtin_inff()) {
    for (int64_t c = 0; c < width; ++c) p[c] = 0.f;
    return 0.f;
  }
  const __m512 shift = _mm512_set1_ps(largest);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < width; c += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + c), shift));
    _mm512_storeu_ps(p + c, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// The end of a panel tile (packed_linear.cpp, bf16_linear.cpp): R rows x S panels of 32 float32 sums, each panel
// two vectors, plus the bias (null: none), stored to y (rows of n) from row r0 and column 32 p; the columns past n
// (a last, partial panel) left out.
template <int R, int S>
__attribute__((target("avx512f"))) inline void store_panel_tile(const __m512 (&acc)[R][S][2], const float* bias,
                                                               float* y, int64_t n, int64_t r0, int64_t p) {
  for (int s = 0; s < S; ++s) {
    const int64_t c0 = (p + s) * 32;
    if (c0 >= n) break;
    const __mmask16 m0 = first_lanes(n - c0), m1 = first_lanes(n - c0 - 16 > 0 ? n - c0 - 16 : 0);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias != nullptr) b0 = _mm512_maskz_loadu_ps(m0, bias + c0), b1 = _mm512_maskz_loadu_ps(m1, bias + c0 + 16);
    for (int r = 0; r < R; ++r) {
      float* out = y + (r0 + r) * n + c0;
      _mm512_mask_storeu_ps(out, m0, _mm512_add_ps(acc[r][s][0], b0));
      _mm512_mask_storeu_ps(out + 16, m1, _mm512_add_ps(acc[r][s][1], b1));
    }
  }
}

}  // namespace tserve
