// FeedForward's activations on one AVX-512 vector: elementwise.cpp's pass over a row (rows_activate_) and the int8
// GEMM's epilogue (int8_linear_activated) compute them with these same operations, so both give the same values.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "simd_math.h"

namespace tserve {

// Always inlined: called, the int8 GEMM's gated tile (int8_tiles.cpp) made 8 calls with 228 vector spills and reloads
// around them; inlined, none, and a 512-row SmolLM2 gated FFN takes ~0.3 ms (~6%) less, its 512-token prefill ~3%.
#define TSERVE_ACTIVATION_TARGET __attribute__((target("avx512f"), always_inline))

// erf(x), |error| < 3e-7 (Abramowitz & Stegun 7.1.26 with exp(-x^2) from simd_math.h)
TSERVE_ACTIVATION_TARGET inline __m512 erf_approx(__m512 x) {
  const __m512 a = _mm512_abs_ps(x);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(_mm512_set1_ps(kErfP), a, _mm512_set1_ps(1.f)));
  __m512 p = _mm512_set1_ps(kErfPoly[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kErfPoly[i]));
  p = _mm512_mul_ps(p, t);
  const __m512 e = exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), a));
  const __m512 r = _mm512_fnmadd_ps(p, e, _mm512_set1_ps(1.f));  // erf(|x|)
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r),  // the sign of x
                                             _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
}

// tanh(u) = sign(u) (1 - e^{-2|u|}) / (1 + e^{-2|u|})
TSERVE_ACTIVATION_TARGET inline __m512 tanh_approx(__m512 u) {
  const __m512 e = exp_nonpositive(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(u)));
  const __m512 r = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r),
                                             _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(INT32_MIN))));
}

TSERVE_ACTIVATION_TARGET inline __m512 activate(__m512 x, Activation activation) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f);
  if (activation == kRelu) return _mm512_max_ps(x, _mm512_setzero_ps());
  if (activation == kGelu)  // x/2 (1 + erf(x / sqrt 2))
    return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, erf_approx(_mm512_mul_ps(x, _mm512_set1_ps(0.7071067811865476f)))));
  if (activation == kSilu) {  // x sigmoid(x), with e = exp(-|x|): sigmoid = 1/(1+e) for x >= 0, e/(1+e) below
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 inverse = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(x, _mm512_mask_mul_ps(inverse, negative, inverse, e));
  }
  // x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                     _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
  return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh_approx(inner)));
}

#undef TSERVE_ACTIVATION_TARGET

}  // namespace tserve
