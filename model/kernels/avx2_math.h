// simd_math.h's and activation_math.h's vector math on 8-lane AVX2 + FMA vectors: the AVX2 twins of the decoding
// step's kernels (CPUs without AVX-512: AMD Zen 2 and 3, Intel before Skylake-SP). The same formulas and polynomials
// (simd_math.h's kExp2Poly, kErfPoly), so both widths give values within the same error of the exact ones. A row's
// last, partial vector is read and written through a lane mask (first_lanes8), as the AVX-512 kernels do with theirs.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "simd_math.h"

#define TSERVE_AVX2 __attribute__((target("avx2,fma")))
#define TSERVE_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

namespace tserve::avx2 {

// The mask of the first `left` of 8 lanes (all 8 when left >= 8), for maskload / maskstore.
TSERVE_AVX2_INLINE __m256i first_lanes8(int64_t left) {
  const int32_t n = left >= 8 ? 8 : static_cast<int32_t>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The first `left` floats at p (zeros past them), and their store.
TSERVE_AVX2_INLINE __m256 load_first(const float* p, int64_t left) {
  return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes8(left));
}
TSERVE_AVX2_INLINE void store_first(float* p, __m256 v, int64_t left) {
  if (left >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, first_lanes8(left), v);
}

// The first `left` floats at p, -inf past them (a maximum's or a comparison's last, partial vector).
TSERVE_AVX2_INLINE __m256 load_first_or_lowest(const float* p, int64_t left) {
  if (left >= 8) return _mm256_loadu_ps(p);
  return _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), _mm256_maskload_ps(p, first_lanes8(left)),
                          _mm256_castsi256_ps(first_lanes8(left)));
}

TSERVE_AVX2_INLINE float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

TSERVE_AVX2_INLINE float reduce_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0 (scores minus their maximum): 2^n * p(f), relative error about 2e-7 (simd_math.h's).
TSERVE_AVX2_INLINE __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  // 2^n for n in [-126, 0] (x >= -87): the exponent field n + 127
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// exp(p[i] - shift) for the first `left` floats at p (each at most shift), zeros past them: a softmax's terms.
TSERVE_AVX2_INLINE __m256 exp_first(const float* p, int64_t left, __m256 shift) {
  const __m256 e = exp_nonpositive(_mm256_sub_ps(load_first(p, left), shift));
  return left >= 8 ? e : _mm256_and_ps(e, _mm256_castsi256_ps(first_lanes8(left)));
}

TSERVE_AVX2_INLINE __m256 abs(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }

// |r| with the sign of x
TSERVE_AVX2_INLINE __m256 with_sign_of(__m256 r, __m256 x) {
  return _mm256_or_ps(r, _mm256_and_ps(x, _mm256_set1_ps(-0.f)));
}

// erf(x), |error| < 3e-7 (Abramowitz & Stegun 7.1.26)
TSERVE_AVX2_INLINE __m256 erf_approx(__m256 x) {
  const __m256 a = abs(x);
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(kErfP), a, one));
  __m256 p = _mm256_set1_ps(kErfPoly[0]);
  for (int i = 1; i < 5; ++i) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kErfPoly[i]));
  p = _mm256_mul_ps(p, t);
  const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), a));
  return with_sign_of(_mm256_fnmadd_ps(p, e, one), x);
}

// tanh(u) = sign(u) (1 - e^{-2|u|}) / (1 + e^{-2|u|})
TSERVE_AVX2_INLINE __m256 tanh_approx(__m256 u) {
  const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.f), abs(u)));
  const __m256 one = _mm256_set1_ps(1.f);
  return with_sign_of(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), u);
}

// FeedForward's activations (activation_math.h's `activate`).
TSERVE_AVX2_INLINE __m256 activate(__m256 x, Activation activation) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
  if (activation == kRelu) return _mm256_max_ps(x, _mm256_setzero_ps());
  if (activation == kGelu)  // x/2 (1 + erf(x / sqrt 2))
    return _mm256_mul_ps(_mm256_mul_ps(half, x),
                         _mm256_add_ps(one, erf_approx(_mm256_mul_ps(x, _mm256_set1_ps(0.7071067811865476f)))));
  if (activation == kSilu) {  // x sigmoid(x), with e = exp(-|x|): sigmoid = 1/(1+e) for x >= 0, e/(1+e) below
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), abs(x)));
    const __m256 inverse = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_mul_ps(x, _mm256_blendv_ps(inverse, _mm256_mul_ps(inverse, e), negative));
  }
  // x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  const __m256 cubic = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x);
  const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), cubic);
  return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh_approx(inner)));
}

}  // namespace tserve::avx2
