// Beam search's candidates in one pass over each row of logits, float32 on AVX-512 or AVX2 (model/beam_search.py).
//
// A beam search step needs, per sentence, the best k of (log_softmax(logits[r]) + score[r]) over its `width`
// rows and every column outside `banned`. torch makes a (R, V) tensor of log-probs, adds the scores into it and
// runs top-k over (S, width * V). Here each row is read once, in blocks that stay in L1: a block's maximum decides
// whether any of its columns can enter the row's best k (a sorted list of at most k; rarely, after the first
// blocks) and rescales the running sum of exp(x - max) (online log-sum-exp). The row's best k raw logits become
// log-probs plus the row's score, and each sentence's width * k of them are sorted: the same k candidates as the
// top-k of the full scores, best first, equal scores in column order (of row-in-sentence * V + column).
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
constexpr int64_t kBlock = 512;  // columns per block: 2 KiB, read twice from L1

struct Candidate {
  float value;     // raw logit, then score
  int64_t column;  // column in the row, then row-in-sentence * V + column
};

// Ranks a before b: the larger value, then the smaller column; NaN ranks below everything.
bool ranks_before(const Candidate& a, const Candidate& b) {
  const float x = std::isnan(a.value) ? kNegInf : a.value, y = std::isnan(b.value) ? kNegInf : b.value;
  return x > y || (x == y && a.column < b.column);
}

// A row's best k columns (largest logit first, the first column among equal ones) outside `banned`.
struct RowBest {
  std::vector<Candidate> best;  // sorted, at most k
  int64_t k;
  float threshold = kNegInf;  // a column enters only above it: the k-th value once k are held

  void offer(float value, int64_t column, const std::vector<int64_t>& banned) {
    if (!(value > threshold) || std::find(banned.begin(), banned.end(), column) != banned.end()) return;
    auto at = std::upper_bound(best.begin(), best.end(), Candidate{value, column}, ranks_before);
    best.insert(at, Candidate{value, column});
    if (static_cast<int64_t>(best.size()) > k) best.pop_back();
    if (static_cast<int64_t>(best.size()) == k) threshold = best.back().value;
  }

  // Fewer than k finite columns outside `banned` (a forced token, a tiny vocabulary): the first columns not held
  // fill up, as -inf ties in column order.
  void fill(int64_t v) {
    for (int64_t c = 0; static_cast<int64_t>(best.size()) < std::min(k, v) && c < v; ++c)
      if (std::none_of(best.begin(), best.end(), [c](const Candidate& h) { return h.column == c; }))
        best.push_back(Candidate{kNegInf, c});
  }
};

// One row: its best k (raw logits) in `out`, and its log-sum-exp. `shift` = the row's maximum.
AVX512 void scan_row(const float* row, int64_t v, const std::vector<int64_t>& banned, RowBest& out, float& shift,
                     float& log_sum) {
  float running = kNegInf;  // the maximum so far
  __m512 sum = _mm512_setzero_ps();  // per lane: sum of exp(x - running)
  for (int64_t start = 0; start < v; start += kBlock) {
    const int64_t end = std::min(start + kBlock, v);
    __m512 top = _mm512_set1_ps(kNegInf);
    for (int64_t c = start; c < end; c += 16)
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), tserve::first_lanes(end - c), row + c));
    const float block_max = _mm512_reduce_max_ps(top);
    if (block_max > out.threshold) {  // some column here may enter the best k
      for (int64_t c = start; c < end; c += 16) {
        const __mmask16 valid = tserve::first_lanes(end - c);
        const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), valid, row + c);
        __mmask16 above = _mm512_mask_cmp_ps_mask(valid, x, _mm512_set1_ps(out.threshold), _CMP_GT_OQ);
        while (above) {
          const int lane = __builtin_ctz(above);
          above &= above - 1;
          out.offer(row[c + lane], c + lane, banned);
        }
      }
    }
    if (block_max > running) {  // a new maximum: rescale the sum so far
      sum = _mm512_mul_ps(sum, _mm512_set1_ps(std::exp(running - block_max)));
      running = block_max;
    }
    if (running == kNegInf) continue;
    const __m512 shift_v = _mm512_set1_ps(running);
    for (int64_t c = start; c < end; c += 16) {
      const __mmask16 valid = tserve::first_lanes(end - c);
      const __m512 x = _mm512_maskz_loadu_ps(valid, row + c);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(valid, tserve::exp_nonpositive(_mm512_sub_ps(x, shift_v))));
    }
  }
  shift = running;
  log_sum = std::log(_mm512_reduce_add_ps(sum));
}

// scan_row() on 8-lane AVX2 vectors (avx2_math.h), for CPUs without AVX-512: the same best k, the sum in another
// order.
namespace avx2 {

using tserve::avx2::load_first_or_lowest;

TSERVE_AVX2 void scan_row(const float* row, int64_t v, const std::vector<int64_t>& banned, RowBest& out, float& shift,
                          float& log_sum) {
  float running = kNegInf;  // the maximum so far
  __m256 sum = _mm256_setzero_ps();  // per lane: sum of exp(x - running)
  for (int64_t start = 0; start < v; start += kBlock) {
    const int64_t end = std::min(start + kBlock, v);
    __m256 top = _mm256_set1_ps(kNegInf);
    for (int64_t c = start; c < end; c += 8) top = _mm256_max_ps(top, load_first_or_lowest(row + c, end - c));
    const float block_max = tserve::avx2::reduce_max(top);
    if (block_max > out.threshold) {  // some column here may enter the best k
      for (int64_t c = start; c < end; c += 8) {
        const __m256 above =
            _mm256_cmp_ps(load_first_or_lowest(row + c, end - c), _mm256_set1_ps(out.threshold), _CMP_GT_OQ);
        for (unsigned bits = _mm256_movemask_ps(above); bits; bits &= bits - 1) {
          const int lane = __builtin_ctz(bits);
          out.offer(row[c + lane], c + lane, banned);
        }
      }
    }
    if (block_max > running) {  // a new maximum: rescale the sum so far
      sum = _mm256_mul_ps(sum, _mm256_set1_ps(std::exp(running - block_max)));
      running = block_max;
    }
    if (running == kNegInf) continue;
    const __m256 shift_v = _mm256_set1_ps(running);
    for (int64_t c = start; c < end; c += 8)
      sum = _mm256_add_ps(sum, tserve::avx2::exp_first(row + c, end - c, shift_v));
  }
  shift = running;
  log_sum = std::log(tserve::avx2::reduce_add(sum));
}

}  // namespace avx2

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> beam_topk(const torch::Tensor& logits, const torch::Tensor& scores,
                                                   int64_t width, int64_t k, const std::vector<int64_t>& banned) {
  TORCH_CHECK(has_vector_kernels(), "beam top-k: this CPU has neither AVX-512 nor AVX2");
  const bool avx512 = wide_vectors();
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() && logits.stride(1) == 1,
              "beam top-k: logits must be (R, V) float32 on CPU with unit stride along V");
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0 && width > 0 && rows % width == 0 && k > 0, "beam top-k: ", rows, " rows of ", v,
              " columns are not sentences of width ", width, ", or k = ", k, " < 1");
  TORCH_CHECK(scores.dim() == 1 && scores.size(0) == rows && scores.scalar_type() == at::kFloat && scores.is_cpu(),
              "beam top-k: scores must be (R,) float32 on CPU");
  for (const int64_t id : banned) TORCH_CHECK(id >= 0 && id < v, "beam top-k: banned id ", id, " outside [0, ", v, ")");
  const int64_t sentences = rows / width, kept = std::min(k, width * v);
  const auto score = scores.contiguous();
  const float* data = logits.data_ptr<float>();
  const float* score_of = score.data_ptr<float>();
  std::vector<RowBest> best(rows, RowBest{{}, std::min(k, v)});
  std::vector<float> shift(rows), log_sum(rows);
  const auto scan = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * logits.stride(0);
      if (avx512)
        scan_row(row, v, banned, best[r], shift[r], log_sum[r]);
      else
        avx2::scan_row(row, v, banned, best[r], shift[r], log_sum[r]);
      best[r].fill(v);
    }
  };
  // Rows in parallel only when each thread gets 2^20 logits or more: a few rows' work (NLLB's 4 beams, 1M logits) is
  // below a thread wake-up on a busy machine, so no parallel region is opened for it; OPUS-MT's 16 x 4 beams (3.7M
  // logits, ~1.2 ms on one thread) take both threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / v);
  if (rows < 2 * grain) {
    scan(0, rows);
  } else {
    at::parallel_for(0, rows, grain, scan);
  }
  auto values = torch::empty({sentences, kept}, logits.options());
  auto ids = torch::empty({sentences, kept}, logits.options().dtype(at::kLong));
  float* value_out = values.data_ptr<float>();
  int64_t* id_out = ids.data_ptr<int64_t>();
  std::vector<Candidate> pool;
  for (int64_t s = 0; s < sentences; ++s) {
    pool.clear();
    for (int64_t j = 0; j < width; ++j) {
      const int64_t r = s * width + j;
      for (const Candidate& c : best[r].best) {
        // As torch's log_softmax: (x - max) - log(sum exp(x - max)); banned columns (filler only) are -inf.
        const bool is_banned = std::find(banned.begin(), banned.end(), c.column) != banned.end();
        const float logprob = is_banned ? kNegInf : (c.value - shift[r]) - log_sum[r];
        pool.push_back(Candidate{logprob + score_of[r], j * v + c.column});
      }
    }
    std::sort(pool.begin(), pool.end(), ranks_before);
    for (int64_t i = 0; i < kept; ++i) {
      value_out[s * kept + i] = pool[i].value;
      id_out[s * kept + i] = pool[i].column;
    }
  }
  return {values, ids};
}
