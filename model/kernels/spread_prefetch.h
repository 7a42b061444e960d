// The next block of a panel prefetched into L2 while the current one is multiplied, spread over the passes of its row
// tiles: the float32 (packed_linear.cpp, 5-24 rows) and bf16 (bf16_linear.cpp, past 4 rows) AVX2 GEMMs at a batched
// step, whose weights come from memory. All of a block's lines asked for at the start of a pass ran 0.9x the spread pattern's
// GFLOP/s on a Zen 3 (docs/benchmarks.md, session 38).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace tserve {

constexpr int64_t kLineBytes = 64;

// Cache lines of the block that follows rows .. `end` of a panel of `total` rows of `row_bytes`, in blocks of `block`
// rows: the panel's next block, or the next panel's first where `more_panels` (panels lie back to back); 0 after the
// last.
inline int64_t next_block_lines(int64_t end, int64_t total, int64_t block, bool more_panels, int64_t row_bytes) {
  const int64_t rows = end < total ? std::min(total, end + block) - end : (more_panels ? std::min(total, block) : 0);
  return rows * row_bytes / kLineBytes;
}

// Pass `pass` of `passes` over a block's share of the `lines` cache lines from `next`: every `every`-th step() (of
// `steps` in the pass) prefetches the next of them into L2.
class SpreadPrefetch {
 public:
  SpreadPrefetch(const char* next, int64_t lines, int64_t pass, int64_t passes, int64_t steps) {
    const int64_t share = (lines + passes - 1) / passes, start = std::min(lines, pass * share);
    const int64_t count = std::min(share, lines - start);
    next_ = next + start * kLineBytes;
    end_ = next_ + count * kLineBytes;
    every_ = count > 0 ? std::max<int64_t>(1, steps / count) : steps + 1;
  }

  inline void step() {
    if (--countdown_ != 0) return;
    countdown_ = every_;
    if (next_ < end_) _mm_prefetch(next_, _MM_HINT_T1);
    next_ += kLineBytes;
  }

 private:
  const char* next_;
  const char* end_;
  int64_t every_;
  int64_t countdown_ = 1;
};

}  // namespace tserve
