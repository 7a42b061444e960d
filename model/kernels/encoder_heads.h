// The contract the encoder attention kernels share (encoder_attention.cpp in float32, encoder_attention_bf16.cpp with
// bf16 products): q, k, v (B, H, T, 64) float32 with unit stride along the head dim (views of a fused q/k/v
// projection are fine), k and v alike; a bool key mask (B or 1, 1, 1, T) or none; the output written (B, T, H, 64)
// and returned as its (B, H, T, 64) view, so merging the heads afterwards copies nothing. One (row, head) at a time.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <string>

namespace tserve {

constexpr int kEncoderHeadDim = 64;

// One head of one row: where its queries, keys, values, key mask and output lie.
struct EncoderHead {
  const float* q;  // first query; queries q_row apart
  const float* k;  // first key; keys and values kv_row apart
  const float* v;
  const bool* keep;  // (T,) or null: every key
  float* out;        // first query's output; out_row apart
  int64_t q_row, kv_row, out_row, t;
};

// The checked inputs of a call and its output; head(i) for i in [0, B * H).
class EncoderHeads {
 public:
  EncoderHeads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
               const c10::optional<torch::Tensor>& mask, const std::string& kernel)
      : q_(q), k_(k), v_(v) {
    TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && k.sizes() == v.sizes() && q.size(3) == kEncoderHeadDim,
                kernel, ": q, k, v must be (B, H, T, ", kEncoderHeadDim, ") alike");
    for (const auto* x : {&q, &k, &v})
      TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->stride(3) == 1, kernel,
                  ": float32 CPU tensors with unit stride along the head dim");
    TORCH_CHECK(k.strides() == v.strides(), kernel, ": k and v must have the same strides");
    rows_ = q.size(0), heads_ = q.size(1), t_ = q.size(2);
    if (mask.has_value()) {
      TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && (mask->size(0) == rows_ || mask->size(0) == 1) &&
                  mask->size(1) == 1 && mask->size(2) == 1 && mask->size(3) == t_,
                  kernel, ": mask must be bool (B or 1, 1, 1, T)");
      keep_ = mask->reshape({mask->size(0), t_}).contiguous();
    }
    out_ = torch::empty({rows_, t_, heads_, kEncoderHeadDim}, q.options());
  }

  int64_t count() const { return rows_ * heads_; }
  int64_t tokens() const { return t_; }

  EncoderHead head(int64_t i) const {
    const int64_t row = i / heads_, head = i % heads_;
    const bool* keep = keep_.defined() ? keep_.data_ptr<bool>() + (keep_.size(0) == rows_ ? row * t_ : 0) : nullptr;
    return EncoderHead{q_.data_ptr<float>() + row * q_.stride(0) + head * q_.stride(1),
                       k_.data_ptr<float>() + row * k_.stride(0) + head * k_.stride(1),
                       v_.data_ptr<float>() + row * v_.stride(0) + head * v_.stride(1), keep,
                       out_.data_ptr<float>() + (row * t_ * heads_ + head) * kEncoderHeadDim,
                       q_.stride(2), k_.stride(2), heads_ * kEncoderHeadDim, t_};
  }

  torch::Tensor result() const { return out_.transpose(1, 2); }

 private:
  const torch::Tensor &q_, &k_, &v_;
  torch::Tensor keep_, out_;
  int64_t rows_ = 0, heads_ = 0, t_ = 0;
};

#define TSERVE_ENCODER_TILE __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq")))

// A score tile's epilogue: the first nc (1 or 2) key vectors of each query's sums (key vectors c0, c0 + 1) scaled by
// 1 / sqrt(64), the keys' bias added (0 or -inf), stored into the query's row of p (tp apart), its maximum kept in tops.
template <int Q, int K>
TSERVE_ENCODER_TILE inline void store_scores(const __m512 (&acc)[Q][K], int nc, const float* bias, int64_t c0,
                                             int64_t tp, float* p, __m512 (&tops)[Q]) {
  const __m512 scale = _mm512_set1_ps(0.125f);
#pragma GCC unroll 16
  for (int r = 0; r < Q; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < K; ++c)
      if (c < nc) {
        const __m512 s = _mm512_fmadd_ps(acc[r][c], scale, _mm512_loadu_ps(bias + (c0 + c) * 16));
        tops[r] = _mm512_max_ps(tops[r], s);
        _mm512_storeu_ps(p + r * tp + (c0 + c) * 16, s);
      }
}

// The p @ V tile's epilogue: the first `rows` queries' sums over the dims of vectors half .. half + K - 1 times their
// softmax's 1 / sum (inverse), stored into the head's output from query i0.
template <int Q, int K>
TSERVE_ENCODER_TILE inline void store_outputs(const __m512 (&acc)[Q][K], const EncoderHead& h, int64_t i0, int rows,
                                              int half, const float* inverse) {
#pragma GCC unroll 16
  for (int r = 0; r < Q; ++r) {
    if (r >= rows) break;
    const __m512 by = _mm512_set1_ps(inverse[r]);
#pragma GCC unroll 16
    for (int c = 0; c < K; ++c)
      _mm512_storeu_ps(h.out + (i0 + r) * h.out_row + (half + c) * 16, _mm512_mul_ps(acc[r][c], by));
  }
}

}  // namespace tserve
