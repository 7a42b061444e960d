// Panels of a product shared out among threads with stealing: each thread walks an even share front to back (its
// weights in order, so its prefetches of the next panel hold), and a thread done with its own takes the others'
// last panels one at a time from the back, so that no thread waits at the join for a slower one (a core slowed by
// other work on the machine, a share whose first blocks came from memory). On a Zen 3 with an even split alone,
// each of two threads spent 5-7% of a loop of 64-row products waiting in the join for the other; shared so,
// flan-t5-base float32 decoding gained 1.04-1.12x (docs/benchmarks.md, session 39).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace tserve {

class PanelShares {
 public:
  PanelShares(int64_t panels, int64_t threads) : threads_(threads), shares_(new std::atomic<uint64_t>[threads]) {
    for (int64_t t = 0; t < threads; ++t)
      shares_[t].store(pack(panels * t / threads, panels * (t + 1) / threads), std::memory_order_relaxed);
  }

  // The next panel for thread `t` (its own share's front, else another's back), or -1 when none is left.
  int64_t next(int64_t t) {
    const int64_t own = take(t, true);
    if (own >= 0) return own;
    for (int64_t i = 1; i < threads_; ++i) {
      const int64_t stolen = take((t + i) % threads_, false);
      if (stolen >= 0) return stolen;
    }
    return -1;
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) { return (uint64_t(front) << 32) | uint64_t(back); }

  // A share's front (the owner) or back (a thief) panel, taken atomically, or -1 when the share is empty.
  int64_t take(int64_t share, bool front) {
    std::atomic<uint64_t>& range = shares_[share];
    uint64_t seen = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t first = int64_t(seen >> 32), end = int64_t(seen & 0xffffffffu);
      if (first >= end) return -1;
      const uint64_t left = front ? pack(first + 1, end) : pack(first, end - 1);
      if (range.compare_exchange_weak(seen, left, std::memory_order_relaxed)) return front ? first : end - 1;
    }
  }

  int64_t threads_;
  std::unique_ptr<std::atomic<uint64_t>[]> shares_;
};

}  // namespace tserve
