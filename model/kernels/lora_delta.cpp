// LoRA deltas added into a projection's output, row by row (the native step's adapters, AVX-512).
//
// y (rows, N) += ((x (rows, K) . A^T) * scales) . B^T with A (C, K) and B (N, C), C the adapters' summed ranks
// (model.lora.RowDeltas). The three ATen calls this replaces (mm, mul_, addmm_) took about 30 us per
// projection at a few rows, 24 projections a step with adapters on q/k/v/out, against 1-2 us of work here;
// and with adapters mixed per row, a row computes only its own adapter's columns (the others' scales are
// 0), where the GEMMs computed every adapter's for every row. A and B may each be stored row-major or
// input-major (model/layout.py); other dtypes or layouts, or autograd, take the ATen calls.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "simd_math.h"

#include <vector>

#define AVX512 __attribute__((target("avx512f")))

namespace {

constexpr int64_t kRowsPerTask = 4;  // rows per thread's task: a row costs about as much as a thread's start

AVX512 float dot(const float* a, const float* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tserve::first_lanes(n - i);
    sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), sum);
  }
  return _mm512_reduce_add_ps(sum);
}

// h[j] = x . A[j, :] for A stored input-major (At = A^T (K, C) contiguous), before scaling.
AVX512 void project_input_major(const float* x, const float* at, int64_t k, int64_t c, float* h) {
  for (int64_t j = 0; j < c; j += 16) {
    const __mmask16 lanes = tserve::first_lanes(c - j);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; ++i)
      sum = _mm512_fmadd_ps(_mm512_set1_ps(x[i]), _mm512_maskz_loadu_ps(lanes, at + i * c + j), sum);
    _mm512_mask_storeu_ps(h + j, lanes, sum);
  }
}

// y[n] += h . B[n, :] for B (N, C) row-major.
AVX512 void add_rows_major(const float* h, const float* b, int64_t n, int64_t c, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += dot(h, b + i * c, c);
}

// y[:] += sum_j h[j] * Bt[j, :] for B stored input-major (Bt = B^T (C, N) contiguous).
AVX512 void add_input_major(const float* h, const float* bt, int64_t n, int64_t c, float* y) {
  for (int64_t j = 0; j < c; ++j) {
    if (h[j] == 0.f) continue;  // a column of another adapter than the row's
    const __m512 s = _mm512_set1_ps(h[j]);
    const float* row = bt + j * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = tserve::first_lanes(n - i);
      const __m512 sum = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(k, row + i), _mm512_maskz_loadu_ps(k, y + i));
      _mm512_mask_storeu_ps(y + i, k, sum);
    }
  }
}

bool is_float_cpu(const torch::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

// Whether a 2-D tensor is stored row-major or input-major (its transpose contiguous), the two layouts here.
bool row_major(const torch::Tensor& t) { return t.stride(1) == 1 && t.stride(0) == t.size(1); }
bool input_major(const torch::Tensor& t) { return t.stride(0) == 1 && t.stride(1) == t.size(0); }

}  // namespace

// y (..., N) contiguous, updated in place; x (..., K); a (C, K); b (N, C); scales (rows or 1, C).
// A scale of 0 leaves the row untouched by that column (as the mask of the stacked adapters means it).
void lora_delta_add_(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                     const torch::Tensor& scales) {
  static const bool avx512 = has_avx512();
  const int64_t k = x.size(-1), n = y.size(-1), c = a.size(0), rows = k ? x.numel() / k : 0;
  TORCH_CHECK(a.dim() == 2 && a.size(1) == k && b.dim() == 2 && b.size(0) == n && b.size(1) == c && scales.dim() == 2 &&
                  scales.size(1) == c && (scales.size(0) == 1 || scales.size(0) == rows) && y.numel() == rows * n,
              "lora_delta_add_: shapes disagree");
  const bool fits = avx512 && is_float_cpu(y) && is_float_cpu(x) && is_float_cpu(a) &&
                    is_float_cpu(b) && is_float_cpu(scales) && y.is_contiguous() && x.is_contiguous() &&
                    scales.is_contiguous() && (row_major(a) || input_major(a)) && (row_major(b) || input_major(b)) &&
                    !at::GradMode::is_enabled();
  if (!fits) {
    torch::Tensor h = at::mm(x.reshape({rows, k}), a.t());
    h.mul_(scales);
    y.view({rows, n}).addmm_(h, b.t());
    return;
  }
  const float *xs = x.data_ptr<float>(), *as = a.data_ptr<float>(), *bs = b.data_ptr<float>();
  const float* ss = scales.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> h(c);
    for (int64_t r = begin; r < end; ++r) {
      const float* scale = ss + (scales.size(0) == 1 ? 0 : r * c);
      if (row_major(a)) {  // only the row's own columns (the others' scales are 0)
        for (int64_t j = 0; j < c; ++j) h[j] = scale[j] == 0.f ? 0.f : dot(xs + r * k, as + j * k, k);
      } else {
        project_input_major(xs + r * k, as, k, c, h.data());
      }
      for (int64_t j = 0; j < c; ++j) h[j] = scale[j] == 0.f ? 0.f : h[j] * scale[j];  // 0, never 0 x inf
      if (row_major(b)) add_rows_major(h.data(), bs, n, c, ys + r * n);
      else add_input_major(h.data(), bs, n, c, ys + r * n);
    }
  });
}
