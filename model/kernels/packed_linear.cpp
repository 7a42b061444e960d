// float32 linear layers over weights packed in 32-column panels: the decoding step's GEMMs beyond a few rows.
//
// At 5-64 rows a step is bound by the FMAs, yet MKL's GEMM ran the causal step's weights at about half of
// this CPU's FMA rate: a third of its time went to copying each weight into its own packed form on every
// call. Kernels of ours over the weights as stored (input-major, model/layout.py) did no better, because a
// 32-column strip of an input-major weight is 128 bytes every N x 4 bytes, which the hardware prefetchers
// do not follow. pack_weight lays W (N, K) out once as panels (ceil(N / 32), K, 32), so each strip is one
// contiguous run; packed_linear then computes y = x W^T + b with tiles of up to 12 rows x 32 columns held
// in registers (a broadcast of x and two weight vectors per k, software prefetch ahead by the CPU's rule below),
// panels spread over ATen's threads: 1.3-1.45x MKL on the causal step's 37 weights at 8-64 rows. The packed copy
// is as large as the weight: model/packed_weights.py makes it only for batched steps and refreshes it when the
// weight changes.
// On CPUs with AVX2 and FMA but not AVX-512 (AMD Zen 2 and 3, Intel before Skylake-SP) the same panels go through
// 256-bit tiles of up to 6 rows (16 registers: R x V accumulators, V weight vectors and a broadcast; a batched step's
// 5-24 rows all over one block of a panel before the next, tile256_interleaved), where MKL's
// GEMV and GEMM took its generic code path on AMD: 10-18 GB/s at one row, 35-90 GFLOP/s at 16-64 rows on a Zen 3
// (docs/benchmarks.md, "float32 on AVX2 CPUs"). The tuning's vector_bits caps the width (tests run both).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "panel_shares.h"
#include "simd_math.h"
#include "spread_prefetch.h"

#include <algorithm>
#include <type_traits>

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))
#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int64_t kPanel = 32;         // columns per panel: two vectors
constexpr int64_t kMaxTileRows = 12;   // 12 x 2 accumulators + 2 weight vectors + a broadcast fit 32 registers
constexpr int64_t kMaxGemvRows = 2;    // tiles that may walk several panels at once (2 x 4 x 2 accumulators at most)
constexpr int64_t kMaxTileRows256 = 6;  // AVX2: 6 x 2 accumulators over half a panel + 2 weight vectors + a broadcast
constexpr int64_t kMaxWholePanelRows256 = 2;  // AVX2 tiles of up to 2 rows take the whole panel (2 x 4 + 4 + 1)
constexpr int64_t kBlock256 = 64;  // panel rows (8 KB) an AVX2 tile of 3-4 rows takes for rows 1-2, then for the rest
// AVX2 products of a few rows more than the streaming tiles' up to kMaxInterleavedRows256: each panel in blocks of
// kInterleavedBlock256 panel rows (24 KB), every row tile over a block before the next, the block after it prefetched
// into L2 meanwhile (see tile256_interleaved). Past 24 rows the half-panel tiles ran 1.04-1.12x faster in generation
// (beam 4 at batch 16: 64 rows; docs/benchmarks.md, session 39).
constexpr int64_t kMaxInterleavedRows256 = 24;
constexpr int64_t kInterleavedBlock256 = 192;

// The blocking and prefetch rule, chosen per CPU at run time (model/cpu.py sets it through set_panel_tuning when
// the kernels load): rows of x a thread keeps in L2 while it walks its panels (3/4 of the L2 the CPU reports); panel
// rows prefetched ahead (into the next panel near the end: harmless) by wide tiles, into L1; tiles of up to
// streaming_tile_rows rows (a decoding step at batch 1, beams of one source) are bound by reading the panel, not by
// their FMAs, and on Zen 4 read faster prefetching farther ahead into L2 (docs/benchmarks.md, lever 11); tiles of
// 1-2 rows walk gemv_panels panels side by side, for more streams from memory in flight per core (lever 12), and
// prefetch nothing ahead unless gemv_prefetch (a Zen 3's hardware prefetchers alone read faster). The defaults are
// Zen 4's. Each call takes a copy, so a rule set meanwhile never changes a call halfway.
PanelTuning tuning{768 * 1024, 32, 4, 64, true, 4, 512, true};

int64_t panels_for(int64_t n) { return (n + kPanel - 1) / kPanel; }

struct Problem {
  const float* x;       // (rows, k) contiguous
  const float* panels;  // (panels, k, 32)
  const float* bias;    // (n,) or null
  float* y;             // (rows, n) contiguous
  int64_t rows, k, n;
  PanelTuning rule;     // the rule in force when the call began
};

// y[r0 .. r0 + R, 32 p .. 32 (p + S)) for the S panels p .. p + S - 1 walked side by side (S streams of weights
// from memory at once), the columns past n left out; prefetching `ahead` floats ahead in each panel.
template <int R, int S, _mm_hint Hint>
AVX512 void tile(const Problem& q, int64_t p, int64_t r0, int64_t ahead) {
  __m512 acc[R][S][2];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s][0] = acc[r][s][1] = _mm512_setzero_ps();
  const float* panel = q.panels + p * q.k * kPanel;
  const float* x = q.x + r0 * q.k;
  for (int64_t i = 0; i < q.k; ++i) {
    __m512 w[S][2];
    for (int s = 0; s < S; ++s) {
      const float* row = panel + (s * q.k + i) * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead), Hint);
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead + 16), Hint);
      w[s][0] = _mm512_loadu_ps(row), w[s][1] = _mm512_loadu_ps(row + 16);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * q.k + i]);
      for (int s = 0; s < S; ++s) {
        acc[r][s][0] = _mm512_fmadd_ps(xr, w[s][0], acc[r][s][0]);
        acc[r][s][1] = _mm512_fmadd_ps(xr, w[s][1], acc[r][s][1]);
      }
    }
  }
  tserve::store_panel_tile<R, S>(acc, q.bias, q.y, q.n, r0, p);
}

// fn(hint, ahead) under the tuning's prefetch rule for a tile of `rows` rows: wide tiles prefetch prefetch_rows panel
// rows ahead into L1, streaming ones streaming_prefetch_rows ahead into L2 or L1 (tiles of 1-2 rows none ahead
// unless gemv_prefetch: the row being read, a no-op); the hint a compile-time constant.
template <typename Fn>
void with_prefetch_rule(const Problem& q, int rows, Fn&& fn) {
  using L1 = std::integral_constant<_mm_hint, _MM_HINT_T0>;
  using L2 = std::integral_constant<_mm_hint, _MM_HINT_T1>;
  if (rows > q.rule.streaming_tile_rows) return fn(L1{}, q.rule.prefetch_rows * kPanel);
  const int64_t ahead = streaming_ahead(q.rule, rows) * kPanel;
  if (q.rule.streaming_into_l2) return fn(L2{}, ahead);
  fn(L1{}, ahead);
}

// fn(std::integral_constant<int, R>) with R = rows, 1 .. Max (Max for more): a tile's rows as a template argument.
template <int Max, int R = 1, typename Fn>
void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (R == Max) {
    fn(std::integral_constant<int, R>{});
  } else {
    if (rows <= R) return fn(std::integral_constant<int, R>{});
    with_rows<Max, R + 1>(rows, fn);
  }
}

// A tile of R rows over S panels under the tuning's prefetch rule for its width.
template <int R, int S = 1>
void tile(const Problem& q, int64_t p, int64_t r0) {
  with_prefetch_rule(q, R, [&](auto hint, int64_t ahead) { tile<R, S, decltype(hint)::value>(q, p, r0, ahead); });
}

// Rows r0 .. r0 + rows over `panels` panels from p: several only for tiles of up to kMaxGemvRows rows.
void tile_rows(const Problem& q, int64_t p, int64_t r0, int64_t rows, int64_t panels) {
  if (panels == 4) return rows == 1 ? tile<1, 4>(q, p, r0) : tile<2, 4>(q, p, r0);
  if (panels == 2) return rows == 1 ? tile<1, 2>(q, p, r0) : tile<2, 2>(q, p, r0);
  with_rows<kMaxTileRows>(rows, [&](auto r) { tile<decltype(r)::value>(q, p, r0); });
}

// The AVX2 tile: y[r0 .. r0 + R, 32 p + 8 v0 .. 32 (p + S - 1) + 8 (v0 + V)), V of the four 8-column vectors of each of
// the S panels p .. p + S - 1 from v0 (S > 1: one row over several panels side by side, more streams from memory),
// the columns past n left out; prefetching `ahead` floats ahead in each panel.
template <int R, int V, int S, _mm_hint Hint>
AVX2 void tile256(const Problem& q, int64_t p, int64_t v0, int64_t r0, int64_t ahead) {
  __m256 acc[R][S][V];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int s = 0; s < S; ++s)
      UNROLL for (int v = 0; v < V; ++v) acc[r][s][v] = _mm256_setzero_ps();
  const int64_t k = q.k;
  const float* panel = q.panels + p * k * kPanel + v0 * 8;
  const float* x = q.x + r0 * k;
  for (int64_t i = 0; i < k; ++i) {
    UNROLL for (int s = 0; s < S; ++s) {
      const float* row = panel + (s * k + i) * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead), Hint);
      if (V > 2) _mm_prefetch(reinterpret_cast<const char*>(row + ahead + 16), Hint);
      __m256 w[V];
      UNROLL for (int v = 0; v < V; ++v) w[v] = _mm256_loadu_ps(row + 8 * v);
      UNROLL for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * k + i);
        UNROLL for (int v = 0; v < V; ++v) acc[r][s][v] = _mm256_fmadd_ps(xr, w[v], acc[r][s][v]);
      }
    }
  }
  // The sums leave the registers through a buffer, stored at once: a store loop that indexed the accumulators at
  // run time (a partial panel's early exit) made GCC keep them on the stack, stored at every k (3x slower).
  alignas(32) float sums[R][S][V * 8];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int s = 0; s < S; ++s)
      UNROLL for (int v = 0; v < V; ++v) _mm256_store_ps(sums[r][s] + 8 * v, acc[r][s][v]);
  for (int s = 0; s < S; ++s) {
    const int64_t c0 = (p + s) * kPanel + v0 * 8, width = std::min<int64_t>(V * 8, q.n - c0);
    for (int r = 0; r < R; ++r) {
      float* out = q.y + (r0 + r) * q.n + c0;
      for (int64_t c = 0; c < width; ++c) out[c] = sums[r][s][c] + (q.bias != nullptr ? q.bias[c0 + c] : 0.f);
    }
  }
}

// Rows x[0 .. R) (row stride k) times the panel rows k0 .. k1 of a whole panel, added to sums (R x 32, zeros
// instead when `first`), prefetching `ahead` floats ahead in the panel when `prefetch`.
template <int R, _mm_hint Hint>
AVX2 inline void panel_block256(const float* panel, const float* x, int64_t k, int64_t k0, int64_t k1, float* sums,
                                bool first, bool prefetch, int64_t ahead) {
  __m256 acc[R][4];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 4; ++v)
      acc[r][v] = first ? _mm256_setzero_ps() : _mm256_load_ps(sums + r * kPanel + 8 * v);
  for (int64_t i = k0; i < k1; ++i) {
    const float* row = panel + i * kPanel;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead), Hint);
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead + 16), Hint);
    }
    __m256 w[4];
    UNROLL for (int v = 0; v < 4; ++v) w[v] = _mm256_loadu_ps(row + 8 * v);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * k + i);
      UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xr, w[v], acc[r][v]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 4; ++v) _mm256_store_ps(sums + r * kPanel + 8 * v, acc[r][v]);
}

// An AVX2 tile of R = 3 or 4 rows over panel p: the whole panel in blocks of kBlock256 panel rows, each block for
// rows r0, r0 + 1 (reading it from memory) and then for the rest (from L1), the sums kept between blocks in a buffer.
// Half-panel tiles (R x 2 accumulators), which read a panel's lines in two strided passes, took 1.1-1.25x this one's
// time at 3-4 rows streaming the weights from memory (beams of one source; docs/benchmarks.md, session 36).
template <int R, _mm_hint Hint>
void tile256_blocked(const Problem& q, int64_t p, int64_t r0, int64_t ahead) {
  static_assert(R == 3 || R == 4);
  alignas(32) float sums[R * kPanel];
  const int64_t k = q.k;
  const float* panel = q.panels + p * k * kPanel;
  const float* x = q.x + r0 * k;
  for (int64_t k0 = 0; k0 < k; k0 += kBlock256) {
    const int64_t k1 = std::min(k, k0 + kBlock256);
    panel_block256<2, Hint>(panel, x, k, k0, k1, sums, k0 == 0, true, ahead);
    panel_block256<R - 2, Hint>(panel, x + 2 * k, k, k0, k1, sums + 2 * kPanel, k0 == 0, false, ahead);
  }
  const int64_t c0 = p * kPanel, width = std::min<int64_t>(kPanel, q.n - c0);
  for (int r = 0; r < R; ++r) {
    float* out = q.y + (r0 + r) * q.n + c0;
    for (int64_t c = 0; c < width; ++c) out[c] = sums[r * kPanel + c] + (q.bias != nullptr ? q.bias[c0 + c] : 0.f);
  }
}

// An AVX2 tile of R rows over S panels from p: each panel whole up to kMaxWholePanelRows256 rows, in blocks at 3-4
// rows, else its two halves one after the other.
template <int R, int S, _mm_hint Hint>
void tile256_panel(const Problem& q, int64_t p, int64_t r0, int64_t ahead) {
  if constexpr (S == 1 && (R == 3 || R == 4)) {
    tile256_blocked<R, Hint>(q, p, r0, ahead);
  } else {
    constexpr int V = R <= kMaxWholePanelRows256 ? 4 : 2;
    for (int64_t v0 = 0; v0 < 4; v0 += V) tile256<R, V, S, Hint>(q, p, v0, r0, ahead);
  }
}

// Rows x[0 .. R) (row stride k) times the panel rows k0 .. k1 of half v0 (16 of the 32 columns) of a panel, added to
// sums (R rows of 32 floats; zeros instead when `first`), prefetching its share of the next block.
template <int R>
AVX2 void half_block256(const float* panel, const float* x, int64_t k, int64_t k0, int64_t k1, int64_t v0, float* sums,
                        bool first, tserve::SpreadPrefetch prefetch) {
  __m256 acc[R][2];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 2; ++v)
      acc[r][v] = first ? _mm256_setzero_ps() : _mm256_load_ps(sums + r * kPanel + 8 * (v0 + v));
  const float* half = panel + v0 * 8;
  for (int64_t i = k0; i < k1; ++i) {
    prefetch.step();
    const float* row = half + i * kPanel;
    const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 2; ++v) _mm256_store_ps(sums + r * kPanel + 8 * (v0 + v), acc[r][v]);
}

// Every row of q (5 to kMaxInterleavedRows256, in tiles of per_tile <= 6) over panel p, into y. A step's weights
// come from memory: walking the whole panel once per tile (tile256) reads it at the first tile's pace, a cache line
// every 6 cycles a core, and leaves the memory idle through the others (the panel then in L2). Here the panel goes in
// blocks of kInterleavedBlock256 rows, each block for every tile (its two halves, from L1 or L2 after the first pass)
// before the next, and the next block (or the next panel's first) is prefetched into L2 meanwhile, spread over the
// block's passes: the reads overlap the FMAs. Each output the same FMAs in the same order as tile256's (the sums
// through `sums`, R x 32 floats per tile), so the same bits. Measured on a Zen 3 over 12 layers' weights from memory,
// 2 threads: 1.13-1.39x tile256's GFLOP/s at 5-24 rows (docs/benchmarks.md, session 38); at 32-64 rows 0.88-0.96x
// of tile256 in one process (session 39), so they keep it.
void tile256_interleaved(const Problem& q, int64_t p, int64_t per_tile, float* sums) {
  const int64_t k = q.k, passes = 2 * ((q.rows + per_tile - 1) / per_tile);
  const float* panel = q.panels + p * k * kPanel;
  for (int64_t k0 = 0; k0 < k; k0 += kInterleavedBlock256) {
    const int64_t k1 = std::min(k, k0 + kInterleavedBlock256);
    const char* next = reinterpret_cast<const char*>(panel + k1 * kPanel);  // or the next panel's start
    const int64_t lines = tserve::next_block_lines(k1, k, kInterleavedBlock256, p + 1 < panels_for(q.n), kPanel * 4);
    int64_t pass = 0;
    for (int64_t r0 = 0; r0 < q.rows; r0 += per_tile) {
      with_rows<kMaxTileRows256>(std::min(per_tile, q.rows - r0), [&](auto r) {
        for (int64_t v0 = 0; v0 < 4; v0 += 2, ++pass)
          half_block256<decltype(r)::value>(panel, q.x + r0 * k, k, k0, k1, v0, sums + r0 * kPanel, k0 == 0,
                                            tserve::SpreadPrefetch(next, lines, pass, passes, k1 - k0));
      });
    }
  }
  const int64_t c0 = p * kPanel, width = std::min<int64_t>(kPanel, q.n - c0);
  for (int64_t r = 0; r < q.rows; ++r) {
    float* out = q.y + r * q.n + c0;
    for (int64_t c = 0; c < width; ++c) out[c] = sums[r * kPanel + c] + (q.bias != nullptr ? q.bias[c0 + c] : 0.f);
  }
}

// fn(p) for each of `panels` panels on ATen's threads: even shares walked front to back, a thread done with its own
// taking the others' last panels (panel_shares.h).
template <typename Fn>
void for_each_panel(int64_t panels, Fn&& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), panels);  // none for no panels
  tserve::PanelShares shares(panels, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t p = shares.next(t); p >= 0; p = shares.next(t)) fn(p);
  });
}

// An AVX2 tile of R rows over S panels under the tuning's prefetch rule for its width.
template <int R, int S = 1>
void tile256_ruled(const Problem& q, int64_t p, int64_t r0) {
  with_prefetch_rule(q, R, [&](auto hint, int64_t ahead) {
    tile256_panel<R, S, decltype(hint)::value>(q, p, r0, ahead);
  });
}

// Rows r0 .. r0 + rows over `panels` panels from p: 2 only for one row (2 x 4 accumulators, 4 weights, a broadcast).
void tile256_rows(const Problem& q, int64_t p, int64_t r0, int64_t rows, int64_t panels) {
  if (panels == 2) return tile256_ruled<1, 2>(q, p, r0);
  with_rows<kMaxTileRows256>(rows, [&](auto r) { tile256_ruled<decltype(r)::value>(q, p, r0); });
}

// Whether packed_linear runs 512-bit tiles: on an AVX-512 CPU unless the tuning caps the width at 256.
bool wide_tiles(const PanelTuning& rule) {
  static const bool avx512 = has_avx512();
  return avx512 && rule.vector_bits == 512;
}

}  // namespace

void set_panel_tuning(const PanelTuning& chosen) {
  TORCH_CHECK(chosen.row_block_bytes > 0 && chosen.prefetch_rows >= 0 && chosen.streaming_prefetch_rows >= 0 &&
                  chosen.streaming_tile_rows >= 0 && chosen.streaming_tile_rows <= kMaxTileRows,
              "set_panel_tuning: sizes must be positive, streaming_tile_rows at most ", kMaxTileRows);
  TORCH_CHECK(chosen.gemv_panels == 1 || chosen.gemv_panels == 2 || chosen.gemv_panels == 4,
              "set_panel_tuning: gemv_panels must be 1, 2 or 4");
  TORCH_CHECK(chosen.vector_bits == 512 || chosen.vector_bits == 256,
              "set_panel_tuning: vector_bits must be 512 or 256");
  tuning = chosen;
}

PanelTuning panel_tuning() { return tuning; }

int64_t streaming_ahead(const PanelTuning& rule, int64_t rows) {
  return rows > kMaxGemvRows || rule.gemv_prefetch ? rule.streaming_prefetch_rows : 0;
}

bool wide_vectors() { return wide_tiles(tuning); }

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

bool has_vector_kernels() {
  static const bool found = has_avx512() || has_avx2();
  return found;
}

// weight (N, K) float32, any strides -> its panels (ceil(N / 32), K, 32), the columns past N zero; written into
// `out` where given (model.packed_weights places it in 2 MB pages, model.huge_pages).
torch::Tensor pack_weight(const torch::Tensor& weight, const c10::optional<torch::Tensor>& out) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_weight: weight must be a 2-D float32 CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1), panels = panels_for(n), full = n / kPanel;
  TORCH_CHECK(!out.has_value() || (out->sizes() == at::IntArrayRef({panels, k, kPanel}) && out->is_contiguous() &&
                                   out->scalar_type() == at::kFloat && out->device().is_cpu()),
              "pack_weight: out must be a contiguous float32 CPU (ceil(N / 32), K, 32) tensor");
  // Copied into place: the packed copy is the one allocation (a padded copy beside it doubled the peak).
  const torch::Tensor w = weight.detach();
  torch::Tensor packed = out.has_value() ? *out : at::empty({panels, k, kPanel}, weight.options());
  packed.narrow(0, 0, full).transpose(1, 2).copy_(w.narrow(0, 0, full * kPanel).reshape({full, kPanel, k}));
  if (full < panels) {  // the last panel's columns past N are zero
    torch::Tensor last = packed.select(0, full);
    last.zero_();
    last.transpose(0, 1).narrow(0, 0, n - full * kPanel).copy_(w.narrow(0, full * kPanel, n - full * kPanel));
  }
  return packed;
}

// x (..., K) float32; packed from pack_weight of an (N, K) weight; bias (N,) or None -> (..., N).
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias) {
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == panels_for(n) && packed.size(1) == k && packed.size(2) == kPanel &&
                  packed.is_contiguous() && packed.scalar_type() == at::kFloat && packed.device().is_cpu(),
              "packed_linear: packed weights must be pack_weight's (ceil(n / 32), K, 32) of an (n, K) weight");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->scalar_type() == at::kFloat && bias->device().is_cpu()),
              "packed_linear: bias must be a float32 CPU (n,) tensor");
  TORCH_CHECK(has_vector_kernels() && x.scalar_type() == at::kFloat && x.device().is_cpu() && !at::GradMode::is_enabled(),
              "packed_linear: float32 CPU input without autograd on an AVX-512 or AVX2 CPU only");
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  if (k == 0) return bias.has_value() ? bias->expand(sizes).contiguous() : at::zeros(sizes, x.options());
  const int64_t rows = x.numel() / k;
  torch::Tensor y = at::empty(sizes, x.options());
  if (rows == 0) return y;
  const torch::Tensor input = x.is_contiguous() ? x : x.contiguous();
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const Problem q{input.data_ptr<float>(), packed.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), rows, k, n, tuning};
  const bool wide = wide_tiles(q.rule);
  const int64_t max_tile = wide ? kMaxTileRows : kMaxTileRows256;
  const int64_t tiles = (rows + max_tile - 1) / max_tile, per_tile = (rows + tiles - 1) / tiles;  // even tiles
  if (!wide && rows > q.rule.streaming_tile_rows && rows <= kMaxInterleavedRows256) {
    for_each_panel(packed.size(0), [&](int64_t p) {
      alignas(32) float sums[kMaxInterleavedRows256 * kPanel];
      tile256_interleaved(q, p, per_tile, sums);
    });
    return y;
  }
  // Inputs larger than L2: each thread walks its panels once per block of rows that stays in L2, rather than all the
  // rows once per panel (a 4,096-token batch's x, 12-50 MB, streamed from L3 or memory for each of 24-96 panels).
  const int64_t block_bytes = q.rule.row_block_bytes;
  const int64_t block = rows * k * 4 <= block_bytes ? rows
                                                    : std::max<int64_t>(1, block_bytes / (k * 4) / per_tile) * per_tile;
  const int64_t together = wide ? (per_tile <= kMaxGemvRows ? q.rule.gemv_panels : 1)
                                : (per_tile == 1 ? std::min<int64_t>(q.rule.gemv_panels, 2) : 1);
  if (!wide && block == rows && together == 1) {  // a batched step's rows, each panel alone: shared with stealing
    for_each_panel(packed.size(0), [&](int64_t p) {
      for (int64_t r0 = 0; r0 < rows; r0 += per_tile) tile256_rows(q, p, r0, std::min(per_tile, rows - r0), 1);
    });
    return y;
  }
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += block)
      for (int64_t p = begin, step; p < end; p += step) {
        step = p + together <= end ? together : 1;
        for (int64_t r0 = first; r0 < std::min(first + block, rows); r0 += per_tile) {
          if (wide) tile_rows(q, p, r0, std::min(per_tile, rows - r0), step);
          else tile256_rows(q, p, r0, std::min(per_tile, rows - r0), step);
        }
      }
  });
  return y;
}
