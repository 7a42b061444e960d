// The int8 GEMM's problem, shared by its tiles (int8_tiles.cpp: the AVX512-VNNI inner loops; int8_tiles_avx2.cpp:
// their AVX2 twins) and its entry points (int8_gemm.cpp: checks, quantised inputs, the task split over threads). The
// scheme is int8_gemm.cpp's comment.
#pragma once

#include <cstdint>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace tserve::int8 {

constexpr int64_t kRowChunk = 64;  // activation rows per task: their uint8 copy stays in L2 across blocks
// Products of up to this many rows read the weights (from memory) slower than their vpdpbusd run: they take their
// rows 1-8 at a time in one pass over the weights (tile_stream), block after block, one sequential stream (4 blocks
// side by side, 4 streams 9-24 KB apart, took a quarter longer at 1 row on Zen 4). Wider products are bound by their
// vpdpbusd: tiles of 4 rows x 4 blocks.
constexpr int64_t kStreamingRows = 16;
constexpr int64_t kNoActivation = -1;  // Problem::activation of a product stored as it is

struct Problem {
  const uint8_t* xq;   // (m, k_padded)
  const float* sx;     // (m,)
  const int8_t* w;     // packed
  const float* sw;     // (n,)
  const int32_t* w_sum;
  const float* bias;   // (n,) or null
  float* out;          // rows [out_row0, ...) of the (m, n) result, n floats apart
  int64_t out_row0;
  int64_t m, n, k_padded, blocks;
  int64_t activation;  // an Activation of each output vector before it is stored, or kNoActivation
  bool streaming;      // m <= kStreamingRows: rows 1-8 at a time, one block at a time (tile_stream)
  // A gated FFN's up projection (int8_gated_quantized), read side by side with the gate (w, sw, w_sum, bias; the
  // same shape): each output vector stored is activation(gate) * up. Null: one product.
  const int8_t* w_up = nullptr;
  const float* sw_up = nullptr;
  const int32_t* w_sum_up = nullptr;
  const float* bias_up = nullptr;
};

// Each tile set's two functions, the same values from either (int8_gemm.cpp picks per CPU):
// quantize_row: x (k floats) -> q (k_padded uint8 around 128, zero after the offset past k) and its scale max|x| / 127;
// rows: rows [begin, end) of p against blocks [blk0, blk1) (blk0 a multiple of 4), into p.out.
namespace vnni {
VNNI void quantize_row(const float* x, int64_t k, int64_t k_padded, uint8_t* q, float* scale);
void rows(const Problem& p, int64_t blk0, int64_t blk1, int64_t begin, int64_t end);
}  // namespace vnni

namespace avx2 {
void quantize_row(const float* x, int64_t k, int64_t k_padded, uint8_t* q, float* scale);
void rows(const Problem& p, int64_t blk0, int64_t blk1, int64_t begin, int64_t end);
}  // namespace avx2

}  // namespace tserve::int8
