// float32 linear layers for a few rows (one decoding step) on AVX-512: the native step's and the head's GEMV.
//
// y (R, N) = x (R, K) . W^T + bias for the input-major weights of model/layout.py (W.t() is a contiguous
// (K, N) matrix). At a few rows a decoding step is bound by reading its weights once; MKL's GEMV read them
// at about 49 GB/s on this project's 2-core CPU, called once per weight. Here the K rows of W are split
// into one contiguous range per ATen thread, each thread streams its range front to back (4 rows at a
// time, with software prefetch) into partial sums of its own, and the partials are added at the end: the
// same weights read at 58-64 GB/s. More rows take MKL's GEMM (at::mm, then the bias); other layouts, dtypes
// or autograd go to at::linear.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

#define AVX512 __attribute__((target("avx512f")))

namespace {

constexpr int64_t kMaxRows = 4;      // rows handled here (4 x 4 broadcasts fill the registers); MKL beyond
constexpr int64_t kPrefetchRows = 6;  // weight rows prefetched ahead (past the end is harmless: no fault)
constexpr int64_t kRowGroup = 4;     // weight rows consumed per pass over the partial sums

struct Problem {
  const float* x;  // (rows, k) contiguous
  const float* w;  // (k, n) contiguous
  int64_t rows, k, n;
};

// acc[r][:] += sum over weight rows [k0, k1) of x[r][i] * w[i][:], for every row r.
template <int R>
AVX512 void accumulate(const Problem& p, int64_t k0, int64_t k1, float* acc) {
  const int64_t n = p.n, vectors = n / 16;
  int64_t i = k0;
  for (; i + kRowGroup <= k1; i += kRowGroup) {
    __m512 xs[R][kRowGroup];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kRowGroup; ++j) xs[r][j] = _mm512_set1_ps(p.x[r * p.k + i + j]);
    const float* w = p.w + i * n;
    for (int64_t c = 0; c < vectors * 16; c += 16) {
      __m512 wv[kRowGroup];
      for (int j = 0; j < kRowGroup; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchRows + j) * n + c), _MM_HINT_T0);
        wv[j] = _mm512_loadu_ps(w + j * n + c);
      }
      for (int r = 0; r < R; ++r) {
        __m512 a = _mm512_loadu_ps(acc + r * n + c);
        for (int j = 0; j < kRowGroup; ++j) a = _mm512_fmadd_ps(xs[r][j], wv[j], a);
        _mm512_storeu_ps(acc + r * n + c, a);
      }
    }
    for (int64_t c = vectors * 16; c < n; ++c)  // the last n % 16 columns
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < kRowGroup; ++j) acc[r * n + c] += p.x[r * p.k + i + j] * w[j * n + c];
  }
  for (; i < k1; ++i)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < n; ++c) acc[r * n + c] += p.x[r * p.k + i] * p.w[i * n + c];
}

void accumulate_rows(const Problem& p, int64_t k0, int64_t k1, float* acc) {
  std::memset(acc, 0, sizeof(float) * p.rows * p.n);
  switch (p.rows) {
    case 1: return accumulate<1>(p, k0, k1, acc);
    case 2: return accumulate<2>(p, k0, k1, acc);
    case 3: return accumulate<3>(p, k0, k1, acc);
    default: return accumulate<4>(p, k0, k1, acc);
  }
}

// out (rows, n) += each of `count` partial sums laid out like it.
AVX512 void add_partials(float* out, const float* partials, int64_t count, int64_t size) {
  for (int64_t part = 0; part < count; ++part) {
    const float* partial = partials + part * size;
    int64_t i = 0;
    for (; i + 16 <= size; i += 16)
      _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_loadu_ps(out + i), _mm512_loadu_ps(partial + i)));
    for (; i < size; ++i) out[i] += partial[i];
  }
}

AVX512 void add_bias_row(float* row, int64_t n, const float* bias) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) _mm512_storeu_ps(row + c, _mm512_add_ps(_mm512_loadu_ps(row + c), _mm512_loadu_ps(bias + c)));
  for (; c < n; ++c) row[c] += bias[c];
}

// out (rows, n) += bias (n,) on every row, rows spread over ATen's threads when there are many.
void add_bias(float* out, int64_t rows, int64_t n, const float* bias) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) add_bias_row(out + r * n, n, bias);
  });
}

}  // namespace

// x (..., K) float32; weight (N, K) float32 stored input-major (weight.t() contiguous); bias (N,) or None.
// Raw checks instead of tensor ops: at a few rows every ATen call costs a noticeable share of the GEMV.
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  static const bool avx512 = has_avx512();
  const int64_t k = x.size(-1), n = weight.size(0), rows = k ? x.numel() / k : 0;
  const bool fits = avx512 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                    weight.device().is_cpu() && weight.dim() == 2 && weight.size(1) == k && n > 1 &&
                    weight.stride(0) == 1 && weight.stride(1) == n && rows >= 1 && !at::GradMode::is_enabled() &&
                    (!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n));
  if (!fits) return at::linear(x, weight, bias);
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (rows > kMaxRows) {  // MKL's GEMM, the bias added after it (addmm first copies it into the output: slower)
    torch::Tensor y = at::mm(x.reshape({rows, k}), weight.t());
    if (bias_data != nullptr) add_bias(y.data_ptr<float>(), rows, n, bias_data);
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    return y.view(sizes);
  }
  const torch::Tensor input = x.is_contiguous() ? x : x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  torch::Tensor y = at::empty(sizes, x.options());
  float* out = y.data_ptr<float>();
  const Problem p{input.data_ptr<float>(), weight.data_ptr<float>(), rows, k, n};
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), k / kRowGroup));
  const int64_t span = (k / parts + kRowGroup - 1) / kRowGroup * kRowGroup;  // weight rows per part
  thread_local std::vector<float> scratch;  // the other parts' sums (kept: at most threads x 4 rows x N)
  scratch.resize(std::max<size_t>(scratch.size(), static_cast<size_t>((parts - 1) * rows * n)));
  float* partials = scratch.data();
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      float* acc = part == 0 ? out : partials + (part - 1) * rows * n;
      accumulate_rows(p, std::min(k, part * span), part == parts - 1 ? k : std::min(k, (part + 1) * span), acc);
    }
  });
  add_partials(out, partials, parts - 1, rows * n);
  if (bias_data != nullptr) add_bias(out, rows, n, bias_data);
  return y;
}
