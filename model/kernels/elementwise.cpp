// The native step's LayerNorm and RMSNorm, activations, residual adds, gates and rotary positions on (rows, D)
// float32 activations (AVX-512, or AVX2: avx2_math.h), and its uniform KV-cache writes.
//
// At a few rows ATen's versions of these cost 3-8 us a call in allocations and dispatch (LayerNorm also
// makes its mean and rstd tensors), about as long as one of the step's smaller GEMVs reads its weights;
// these take well under a microsecond at d_model 512. Rows are spread over ATen's threads once there are
// enough of them. Anything but contiguous float32 CPU tensors goes to the ATen op. Beam search's reordering of
// the cache copies each moved row's window of every buffer in one call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "activation_math.h"
#include "kernels.h"
#include "avx2_math.h"
#include "simd_math.h"

#include <cmath>
#include <cstring>

#define AVX512 __attribute__((target("avx512f")))

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task before rows are spread over threads

bool fits(const torch::Tensor& t) {
  return has_vector_kernels() && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() &&
         !(at::GradMode::is_enabled() && t.requires_grad());
}

// Whether y (a caller's buffer for a norm of x) takes the norm: x's sizes, contiguous float32 on the CPU, not x.
bool into_fits(const torch::Tensor& y, const torch::Tensor& x) {
  return y.defined() && y.scalar_type() == at::kFloat && y.device().is_cpu() && y.is_contiguous() &&
         y.sizes() == x.sizes() && y.data_ptr() != x.data_ptr();
}

template <class F>
void over_rows(int64_t rows, int64_t width, F f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

AVX512 void layer_norm_row(const float* x, const float* w, const float* b, float* y, int64_t d, float eps) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(tserve::first_lanes(d - c), x + c));
  const float mean = _mm512_reduce_add_ps(sum) / static_cast<float>(d);
  const __m512 m = _mm512_set1_ps(mean);
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 k = tserve::first_lanes(d - c);
    const __m512 centred = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + c), m);
    squares = _mm512_fmadd_ps(centred, centred, squares);
  }
  const __m512 rstd = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(d) + eps));
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 k = tserve::first_lanes(d - c);
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), m), rstd);
    if (w != nullptr) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, w + c));
    if (b != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, b + c));
    _mm512_mask_storeu_ps(y + c, k, v);
  }
}

// model.layers.RMSNorm: w * (x / sqrt(mean(x^2) + eps)), or (x / sqrt(mean(x^2) + eps)) * (1 + w) with `offset`
AVX512 void rms_norm_row(const float* x, const float* w, float* y, int64_t d, float eps, bool offset) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(tserve::first_lanes(d - c), x + c);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(d) + eps));
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 k = tserve::first_lanes(d - c);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + c), r);
    const __m512 weight = _mm512_maskz_loadu_ps(k, w + c);
    _mm512_mask_storeu_ps(y + c, k, _mm512_mul_ps(offset ? _mm512_add_ps(one, weight) : weight, v));
  }
}

// a * b, rounded to float32 before any sum takes it when kRounded (an opaque register: the compiler cannot fuse it
// into an FMA, so the sum rounds twice as ATen's separate mul and add do); else free to fuse.
template <bool kRounded>
AVX512 inline __m512 product(__m512 a, __m512 b) {
  __m512 p = _mm512_mul_ps(a, b);
  if constexpr (kRounded) __asm__("" : "+v"(p));
  return p;
}

// One head's first 2 * half features rotated as half-split pairs (model.rope.apply_rotary's operations:
// x1 c1 - x2 s1, x2 c2 + x1 s2; kRounded: each product rounded as ATen rounds it, the same bits), c and s its cos
// and sin (2 * half); then, with `scaled`, the whole head times `scale` (MultiHeadAttention's query_scale, after
// rotation), dh features.
template <bool kRounded>
AVX512 void rotate_row(float* x, const float* c, const float* s, int64_t half, int64_t dh, bool scaled, float scale) {
  const __m512 by = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < half; j += 16) {
    const __mmask16 k = tserve::first_lanes(half - j);
    const __m512 x1 = _mm512_maskz_loadu_ps(k, x + j), x2 = _mm512_maskz_loadu_ps(k, x + half + j);
    __m512 y1 = _mm512_sub_ps(product<kRounded>(x1, _mm512_maskz_loadu_ps(k, c + j)),
                              product<kRounded>(x2, _mm512_maskz_loadu_ps(k, s + j)));
    __m512 y2 = _mm512_add_ps(product<kRounded>(x2, _mm512_maskz_loadu_ps(k, c + half + j)),
                              product<kRounded>(x1, _mm512_maskz_loadu_ps(k, s + half + j)));
    if (scaled) y1 = _mm512_mul_ps(y1, by), y2 = _mm512_mul_ps(y2, by);
    _mm512_mask_storeu_ps(x + j, k, y1);
    _mm512_mask_storeu_ps(x + half + j, k, y2);
  }
  if (!scaled) return;
  for (int64_t j = 2 * half; j < dh; j += 16) {  // the features a partial rotary passes through
    const __mmask16 k = tserve::first_lanes(dh - j);
    _mm512_mask_storeu_ps(x + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + j), by));
  }
}

AVX512 void mul_row(float* y, const float* x, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 k = tserve::first_lanes(n - c);
    _mm512_mask_storeu_ps(y + c, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, y + c), _mm512_maskz_loadu_ps(k, x + c)));
  }
}

AVX512 void activate_row(float* y, int64_t n, Activation activation) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 k = tserve::first_lanes(n - c);
    _mm512_mask_storeu_ps(y + c, k, tserve::activate(_mm512_maskz_loadu_ps(k, y + c), activation));
  }
}

AVX512 void add_row(float* y, const float* x, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 k = tserve::first_lanes(n - c);
    _mm512_mask_storeu_ps(y + c, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, y + c), _mm512_maskz_loadu_ps(k, x + c)));
  }
}

// The rows above on 8-lane AVX2 vectors (avx2_math.h), for CPUs without AVX-512.
namespace avx2 {

using tserve::avx2::load_first;
using tserve::avx2::store_first;

TSERVE_AVX2 void layer_norm_row(const float* x, const float* w, const float* b, float* y, int64_t d, float eps) {
  __m256 sum = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) sum = _mm256_add_ps(sum, load_first(x + c, d - c));
  const __m256 m = _mm256_set1_ps(tserve::avx2::reduce_add(sum) / static_cast<float>(d));
  __m256 squares = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 keep = _mm256_castsi256_ps(tserve::avx2::first_lanes8(d - c));
    const __m256 centred = _mm256_and_ps(keep, _mm256_sub_ps(load_first(x + c, d - c), m));
    squares = _mm256_fmadd_ps(centred, centred, squares);
  }
  const __m256 rstd = _mm256_set1_ps(1.f / std::sqrt(tserve::avx2::reduce_add(squares) / static_cast<float>(d) + eps));
  for (int64_t c = 0; c < d; c += 8) {
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(load_first(x + c, d - c), m), rstd);
    if (w != nullptr) v = _mm256_mul_ps(v, load_first(w + c, d - c));
    if (b != nullptr) v = _mm256_add_ps(v, load_first(b + c, d - c));
    store_first(y + c, v, d - c);
  }
}

TSERVE_AVX2 void rms_norm_row(const float* x, const float* w, float* y, int64_t d, float eps, bool offset) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 v = load_first(x + c, d - c);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(tserve::avx2::reduce_add(squares) / static_cast<float>(d) + eps));
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 v = _mm256_mul_ps(load_first(x + c, d - c), r), weight = load_first(w + c, d - c);
    store_first(y + c, _mm256_mul_ps(offset ? _mm256_add_ps(one, weight) : weight, v), d - c);
  }
}

template <bool kRounded>
TSERVE_AVX2 inline __m256 product(__m256 a, __m256 b) {
  __m256 p = _mm256_mul_ps(a, b);
  if constexpr (kRounded) __asm__("" : "+x"(p));
  return p;
}

template <bool kRounded>
TSERVE_AVX2 void rotate_row(float* x, const float* c, const float* s, int64_t half, int64_t dh, bool scaled,
                            float scale) {
  const __m256 by = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < half; j += 8) {
    const int64_t left = half - j;
    const __m256 x1 = load_first(x + j, left), x2 = load_first(x + half + j, left);
    __m256 y1 = _mm256_sub_ps(product<kRounded>(x1, load_first(c + j, left)),
                              product<kRounded>(x2, load_first(s + j, left)));
    __m256 y2 = _mm256_add_ps(product<kRounded>(x2, load_first(c + half + j, left)),
                              product<kRounded>(x1, load_first(s + half + j, left)));
    if (scaled) y1 = _mm256_mul_ps(y1, by), y2 = _mm256_mul_ps(y2, by);
    store_first(x + j, y1, left);
    store_first(x + half + j, y2, left);
  }
  if (!scaled) return;
  for (int64_t j = 2 * half; j < dh; j += 8) store_first(x + j, _mm256_mul_ps(load_first(x + j, dh - j), by), dh - j);
}

TSERVE_AVX2 void mul_row(float* y, const float* x, int64_t n) {
  for (int64_t c = 0; c < n; c += 8)
    store_first(y + c, _mm256_mul_ps(load_first(y + c, n - c), load_first(x + c, n - c)), n - c);
}

TSERVE_AVX2 void activate_row(float* y, int64_t n, Activation activation) {
  for (int64_t c = 0; c < n; c += 8)
    store_first(y + c, tserve::avx2::activate(load_first(y + c, n - c), activation), n - c);
}

TSERVE_AVX2 void add_row(float* y, const float* x, int64_t n) {
  for (int64_t c = 0; c < n; c += 8)
    store_first(y + c, _mm256_add_ps(load_first(y + c, n - c), load_first(x + c, n - c)), n - c);
}

}  // namespace avx2

}  // namespace

// LayerNorm over the last dim of x with weight/bias (absent: empty tensors), as at::layer_norm.
torch::Tensor rows_layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps) {
  return rows_layer_norm_into(x, weight, bias, eps, torch::Tensor());
}

// rows_layer_norm into y (x's shape, contiguous float32; undefined: a fresh tensor), returned.
torch::Tensor rows_layer_norm_into(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                   double eps, torch::Tensor y) {
  const int64_t d = x.size(-1);
  const bool affine_fits = (!weight.defined() || !weight.numel() || (fits(weight) && weight.numel() == d)) &&
                           (!bias.defined() || !bias.numel() || (fits(bias) && bias.numel() == d));
  if (!fits(x) || !affine_fits || d == 0) {
    const auto maybe = [](const torch::Tensor& t) { return t.defined() && t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt; };
    return at::layer_norm(x, {d}, maybe(weight), maybe(bias), eps);
  }
  if (!into_fits(y, x)) y = at::empty_like(x);
  const float* w = weight.defined() && weight.numel() ? weight.data_ptr<float>() : nullptr;
  const float* b = bias.defined() && bias.numel() ? bias.data_ptr<float>() : nullptr;
  const float* in = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const auto row = wide_vectors() ? layer_norm_row : avx2::layer_norm_row;
  over_rows(x.numel() / d, d, [&](int64_t r) { row(in + r * d, w, b, out + r * d, d, static_cast<float>(eps)); });
  return y;
}

// RMSNorm over the last dim of x with its weight (model.layers.RMSNorm; `offset`: scaled by 1 + weight, Gemma's).
torch::Tensor rows_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool offset) {
  return rows_rms_norm_into(x, weight, eps, offset, torch::Tensor());
}

// rows_rms_norm into y (x's shape, contiguous float32; undefined: a fresh tensor), returned.
torch::Tensor rows_rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool offset,
                                 torch::Tensor y) {
  const int64_t d = x.size(-1);
  if (!fits(x) || !fits(weight) || weight.numel() != d || d == 0) {
    auto h = x * at::rsqrt(x.pow(2).mean(-1, true) + eps);
    return offset ? h * (1.0 + weight) : weight * h;
  }
  if (!into_fits(y, x)) y = at::empty_like(x);
  const float* w = weight.data_ptr<float>();
  const float* in = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const auto row = wide_vectors() ? rms_norm_row : avx2::rms_norm_row;
  over_rows(x.numel() / d, d, [&](int64_t r) { row(in + r * d, w, out + r * d, d, static_cast<float>(eps), offset); });
  return y;
}

// x (B, H, t, Dh) with unit stride along Dh (a view of a fresh projection) normalized in place over each head's Dh
// features: the q/k norms of Qwen3 and Gemma 3 (model.layers.RMSNorm of width Dh; `offset`: by 1 + weight).
void rows_head_rms_norm_(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool offset) {
  TORCH_CHECK(has_vector_kernels() && x.dim() == 4 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(3) == 1,
              "head norm: x must be a float32 CPU (B, H, t, Dh) tensor with unit stride along Dh");
  TORCH_CHECK(fits(weight) && weight.numel() == x.size(3), "head norm: the weight must be float32 (Dh,)");
  const int64_t heads = x.size(1), t = x.size(2), dh = x.size(3);
  float* data = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const auto norm = wide_vectors() ? rms_norm_row : avx2::rms_norm_row;
  over_rows(x.size(0) * heads * t, dh, [&](int64_t i) {
    float* row = data + i / (heads * t) * x.stride(0) + i / t % heads * x.stride(1) + i % t * x.stride(2);
    norm(row, w, row, dh, static_cast<float>(eps), offset);  // in place: each lane read before written
  });
}

// y *= x in place (y freshly computed by the caller, same shape as x: a gated FFN's act(fc1 x) * up(x)); returns y.
torch::Tensor rows_mul_(torch::Tensor y, const torch::Tensor& x) {
  if (!fits(y) || !fits(x) || y.sizes() != x.sizes()) return y * x;
  const int64_t n = y.size(-1);
  float* out = y.data_ptr<float>();
  const float* in = x.data_ptr<float>();
  const auto row = wide_vectors() ? mul_row : avx2::mul_row;
  over_rows(n ? y.numel() / n : 0, n, [&](int64_t r) { row(out + r * n, in + r * n, n); });
  return y;
}

namespace {

// x (B, H, t, Dh) with unit stride along Dh (a view of a fresh projection), rotated in place at its rows'
// positions: cos and sin (B or 1, t, R) contiguous float32, R even and at most Dh; the first R features of each
// head rotate, the rest pass through; then every feature is multiplied by `scale` unless it is 1.
template <bool kRounded>
void rotate_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, double scale) {
  TORCH_CHECK(has_vector_kernels() && x.dim() == 4 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(3) == 1,
              "rotate: x must be a float32 CPU (B, H, t, Dh) tensor with unit stride along Dh");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && (cos.size(0) == 1 || cos.size(0) == x.size(0)) &&
              cos.size(1) == x.size(2) && cos.size(2) % 2 == 0 && cos.size(2) <= x.size(3) &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.device().is_cpu() && sin.device().is_cpu(),
              "rotate: cos and sin must be contiguous float32 (B or 1, t, R), R even, R <= Dh");
  const int64_t heads = x.size(1), t = x.size(2), r = cos.size(2), per_row = cos.size(0) == 1 ? 0 : t * r;
  float* data = x.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const bool scaled = scale != 1.0;
  const auto rotate = wide_vectors() ? rotate_row<kRounded> : avx2::rotate_row<kRounded>;
  over_rows(x.size(0) * heads * t, r, [&](int64_t i) {
    const int64_t b = i / (heads * t), h = i / t % heads, j = i % t, row = b * per_row + j * r;
    rotate(data + b * x.stride(0) + h * x.stride(1) + j * x.stride(2), c + row, s + row, r / 2,
                         x.size(3), scaled, static_cast<float>(scale));
  });
}

}  // namespace

void rows_rotate_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, double scale) {
  rotate_rows<false>(x, cos, sin, scale);
}

// The same rotation with each product rounded before its sum, as model.rope.apply_rotary's ATen ops compute it: the
// same bits as apply_rotary, in place and without its temporaries (the PyTorch layer path's prompts: model.attention).
void rows_rotate_rounded_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  rotate_rows<true>(x, cos, sin, 1.0);
}

// h = activation(h) in place (h freshly computed by the caller); returns h.
torch::Tensor rows_activate_(torch::Tensor h, Activation activation) {
  if (!fits(h)) {
    if (activation == kRelu) return at::relu(h);
    if (activation == kSilu) return at::silu(h);
    return at::gelu(h, activation == kGeluTanh ? "tanh" : "none");
  }
  const int64_t n = h.size(-1);
  float* data = h.data_ptr<float>();
  const auto row = wide_vectors() ? activate_row : avx2::activate_row;
  over_rows(n ? h.numel() / n : 0, n, [&](int64_t r) { row(data + r * n, n, activation); });
  return h;
}

// y += x in place (y freshly computed by the caller, same shape as x); returns y.
torch::Tensor rows_add_(torch::Tensor y, const torch::Tensor& x) {
  if (!fits(y) || !fits(x) || y.sizes() != x.sizes()) return y + x;
  const int64_t n = y.size(-1);
  float* out = y.data_ptr<float>();
  const float* in = x.data_ptr<float>();
  const auto row = wide_vectors() ? add_row : avx2::add_row;
  over_rows(n ? y.numel() / n : 0, n, [&](int64_t r) { row(out + r * n, in + r * n, n); });
  return y;
}

// cache[:, :, position] = src for a (B, H, capacity, Dh) cache buffer and src (B, H, 1, Dh), both unit-stride along
// Dh: one copy per (row, head) where ATen's strided copy_ took 19 us at 32 rows.
void rows_cache_write(const torch::Tensor& cache, int64_t position, const torch::Tensor& src) {
  const bool direct = cache.dim() == 4 && src.dim() == 4 && src.size(2) == 1 && cache.size(0) == src.size(0) &&
                      cache.size(1) == src.size(1) && cache.size(3) == src.size(3) && position >= 0 &&
                      position < cache.size(2) && cache.scalar_type() == at::kFloat && src.scalar_type() == at::kFloat &&
                      cache.device().is_cpu() && src.device().is_cpu() && cache.stride(3) == 1 && src.stride(3) == 1 &&
                      !(at::GradMode::is_enabled() && (cache.requires_grad() || src.requires_grad()));
  if (!direct) {  // several positions (a verification step), or anything the copy below does not cover
    cache.narrow(2, position, src.size(2)).copy_(src);
    return;
  }
  const int64_t heads = cache.size(1), dh = cache.size(3);
  float* out = cache.data_ptr<float>() + position * cache.stride(2);
  const float* in = src.data_ptr<float>();
  over_rows(cache.size(0) * heads, dh, [&](int64_t i) {
    const int64_t b = i / heads, h = i % heads;
    std::memcpy(out + b * cache.stride(0) + h * cache.stride(1), in + b * src.stride(0) + h * src.stride(1), sizeof(float) * dh);
  });
}

// Beam search's reorder in place: in every buffer (B, H, capacity, Dh), row targets[j] takes row sources[j]'s
// positions [start, end). Each buffer's source windows are gathered before any is written (a row may be both),
// one copy per (row, head); ATen's index_select and index_put took about 10 us a buffer, 0.5 ms a step of a
// 12-layer model. False, and nothing copied, for buffers this does not cover: the caller uses tensor ops.
bool rows_copy_windows(const Tensors& buffers, const std::vector<int64_t>& targets, const std::vector<int64_t>& sources,
                       int64_t start, int64_t end) {
  if (targets.size() != sources.size() || start < 0 || end < start) return false;
  for (const auto& buffer : buffers) {
    if (buffer.dim() != 4 || !buffer.device().is_cpu() || !buffer.is_contiguous() || end > buffer.size(2) ||
        (at::GradMode::is_enabled() && buffer.requires_grad()))
      return false;
    for (size_t j = 0; j < targets.size(); ++j)
      if (targets[j] < 0 || targets[j] >= buffer.size(0) || sources[j] < 0 || sources[j] >= buffer.size(0)) return false;
  }
  const int64_t moved = static_cast<int64_t>(targets.size());
  if (moved == 0 || end == start || buffers.empty()) return true;
  // A beam's reorder moves a few KB a step: waking the second thread for it costs more than the copy (3-20 ms under
  // load against 0.03 ms), so threads share the layers only from about 1 MB of windows each.
  const int64_t window_bytes = 2 * moved * buffers[0].size(1) * (end - start) * buffers[0].stride(2) *
                               buffers[0].element_size();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, window_bytes));
  const int64_t layers = static_cast<int64_t>(buffers.size());
  const auto copy = [&](int64_t first, int64_t last) {
    std::vector<char> gathered;
    for (int64_t i = first; i < last; ++i) {
      const torch::Tensor& buffer = buffers[i];
      const int64_t heads = buffer.size(1), item = buffer.element_size();
      const int64_t head_bytes = buffer.stride(1) * item, row_bytes = buffer.stride(0) * item;
      const int64_t offset = start * buffer.stride(2) * item, window = (end - start) * buffer.stride(2) * item;
      char* data = static_cast<char*>(buffer.data_ptr());
      gathered.resize(static_cast<size_t>(moved * heads * window));
      for (int64_t j = 0; j < moved; ++j)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(gathered.data() + (j * heads + h) * window, data + sources[j] * row_bytes + h * head_bytes + offset,
                      window);
      for (int64_t j = 0; j < moved; ++j)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(data + targets[j] * row_bytes + h * head_bytes + offset, gathered.data() + (j * heads + h) * window,
                      window);
    }
  };
  if (layers < 2 * grain)
    copy(0, layers);  // at::parallel_for opens a parallel region even for one chunk
  else
    at::parallel_for(0, layers, grain, copy);
  return true;
}
