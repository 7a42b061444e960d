// One greedy decoding choice per row, float32 on AVX-512 or AVX2 (model/logits.py greedy_choice).
//
// token = the first column of the row's maximum, leaving out `banned` columns (EOS and stop tokens before
// min_new_tokens); logprob = logits[token] - logsumexp(logits) over every column, i.e. the token's
// log-probability in the unmasked distribution. torch needs three passes and two (R, V) tensors for this
// (log_softmax, the mask, max); here it is two passes over the row and no tensor of that size.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_math.h"
#include "kernels.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#define AVX512 __attribute__((target("avx512f")))

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Choice {
  int64_t token;
  float logprob;
};

// The first index of the row's maximum over the columns not in `banned` (the first column if none is left).
int64_t first_max_allowed(const float* row, int64_t v, const std::vector<int64_t>& banned) {
  int64_t best = -1;
  for (int64_t c = 0; c < v; ++c) {
    if (std::find(banned.begin(), banned.end(), c) != banned.end()) continue;
    if (best < 0 || row[c] > row[best]) best = c;
  }
  return best < 0 ? 0 : best;
}

AVX512 Choice pick(const float* row, int64_t v, const std::vector<int64_t>& banned) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_set1_ps(kNegInf);
  __m512i best_at = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
  for (int64_t c = 0; c < v; c += 16) {  // per lane: the maximum and its first column
    const __mmask16 valid = tserve::first_lanes(v - c);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), valid, row + c);
    const __mmask16 better = _mm512_mask_cmp_ps_mask(valid, x, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, better, x);
    best_at = _mm512_mask_mov_epi32(best_at, better, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(c))));
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  int64_t token = _mm512_mask_reduce_min_epi32(at_top, best_at);  // the first column among the lanes' maxima
  if (top == kNegInf || token >= v) token = 0;
  if (std::find(banned.begin(), banned.end(), token) != banned.end()) token = first_max_allowed(row, v, banned);
  if (top == kNegInf) return {token, kNegInf};
  __m512 sum = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t c = 0; c < v; c += 16) {
    const __mmask16 valid = tserve::first_lanes(v - c);
    const __m512 x = _mm512_maskz_loadu_ps(valid, row + c);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(valid, tserve::exp_nonpositive(_mm512_sub_ps(x, shift))));
  }
  return {token, row[token] - (top + std::log(_mm512_reduce_add_ps(sum)))};
}

// pick() on 8-lane AVX2 vectors (avx2_math.h), for CPUs without AVX-512: the same choice, the sum in another order.
namespace avx2 {

TSERVE_AVX2 Choice pick(const float* row, int64_t v, const std::vector<int64_t>& banned) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best = _mm256_set1_ps(kNegInf);
  __m256i best_at = _mm256_set1_epi32(std::numeric_limits<int32_t>::max());
  for (int64_t c = 0; c < v; c += 8) {  // per lane: the maximum and its first column
    const __m256 x = tserve::avx2::load_first_or_lowest(row + c, v - c);
    const __m256 better = _mm256_cmp_ps(x, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, x, better);
    const __m256i at = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(c)));
    best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), better));
  }
  const float top = tserve::avx2::reduce_max(best);
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_at[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), best_at);
  int64_t token = std::numeric_limits<int32_t>::max();  // the first column among the lanes' maxima
  for (int j = 0; j < 8; ++j)
    if (lane_best[j] == top) token = std::min<int64_t>(token, lane_at[j]);
  if (top == kNegInf || token >= v) token = 0;
  if (std::find(banned.begin(), banned.end(), token) != banned.end()) token = first_max_allowed(row, v, banned);
  if (top == kNegInf) return {token, kNegInf};
  __m256 sum = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (int64_t c = 0; c < v; c += 8) sum = _mm256_add_ps(sum, tserve::avx2::exp_first(row + c, v - c, shift));
  return {token, row[token] - (top + std::log(tserve::avx2::reduce_add(sum)))};
}

}  // namespace avx2

}  // namespace

// logits (R, V) float32 CPU, unit stride along V; banned: column ids in [0, V). -> (tokens int64 (R,), logprobs (R,))
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(const torch::Tensor& logits, const std::vector<int64_t>& banned) {
  TORCH_CHECK(has_vector_kernels(), "greedy pick: this CPU has neither AVX-512 nor AVX2");
  const bool avx512 = wide_vectors();
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() && logits.stride(1) == 1,
              "greedy pick: logits must be (R, V) float32 on CPU with unit stride along V");
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0 && v <= std::numeric_limits<int32_t>::max(), "greedy pick: vocabulary size ", v, " out of range");
  for (const int64_t id : banned) TORCH_CHECK(id >= 0 && id < v, "greedy pick: banned id ", id, " outside [0, ", v, ")");
  auto tokens = torch::empty({rows}, logits.options().dtype(at::kLong));
  auto logprobs = torch::empty({rows}, logits.options());
  const float* data = logits.data_ptr<float>();
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* logprob_out = logprobs.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * logits.stride(0);
      const Choice choice = avx512 ? pick(row, v, banned) : avx2::pick(row, v, banned);
      token_out[r] = choice.token;
      logprob_out[r] = choice.logprob;
    }
  });
  return {tokens, logprobs};
}
