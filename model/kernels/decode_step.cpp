// One decoding step through every decoder layer in one call (model/fast_step.py's native path), and an encoder's
// forward over short rows (DecoderStack::encode: a sentence of up to 16 tokens to classify or embed).
//
// The computation of the decode plan's Python replay (DecodePlan), in the same order: the layer loop, the
// head split/merge views and the cache writes run here instead of in the interpreter, which cost about
// 0.5 ms per step at d_model 512 / 6 layers (a fifth of a batch-1 step). Projections are float32 (weight,
// bias) pairs (few_rows_linear.cpp: the same sums as F.linear in another order) or our int8 layers
// (packed, scales, sums, bias: int8_vnni.cpp), plus LoRA deltas (lora_delta.cpp); attention is
// decode_attention.cpp; LayerNorm, activations, residual adds and uniform cache writes are elementwise.cpp's.
// Beyond a few rows the float32 projections take the weights' packed copies when given (packed_linear.cpp).
// One new token per row; the caller has begun the cache step.
#include <torch/extension.h>

#include <utility>
#include <vector>

#include "kernels.h"

namespace {

using c10::optional;

optional<torch::Tensor> maybe(const torch::Tensor& t) { return t.numel() ? optional<torch::Tensor>(t) : c10::nullopt; }

// A projection: {weight, bias} float32 (bias empty when absent) or {packed, scales, sums, bias} int8; a float32
// weight's panels (packed_linear.cpp) when the caller gives them (more rows than the few-rows GEMV takes).
torch::Tensor project(const torch::Tensor& x, const Tensors& p, const torch::Tensor* panels) {
  if (p.size() == 4) return int8_linear(x, p[0], p[1], p[2], maybe(p[3]));
  if (panels != nullptr && panels->numel()) return packed_linear(x, *panels, p[0].size(0), maybe(p[1]));
  return few_rows_linear(x, p[0], maybe(p[1]));  // MKL beyond a few rows
}

// The projection plus its LoRA deltas when `deltas` holds {A (C, in), B (out, C), scales (rows or 1, C)}:
// ((x A^T) * scales) B^T added to every row (model.lora.RowDeltas).
torch::Tensor project(const torch::Tensor& x, const Tensors& p, const Tensors* deltas, const torch::Tensor* panels) {
  torch::Tensor y = project(x, p, panels);
  if (deltas != nullptr && !deltas->empty()) lora_delta_add_(y, x, (*deltas)[0], (*deltas)[1], (*deltas)[2]);
  return y;
}

struct Step {
  int64_t rows, tokens, heads, d, dh;  // tokens per row: 1, or a speculative draft's verification (model/speculative.py)
  bool pre_norm;
  Activation activation;

  torch::Tensor split(const torch::Tensor& t) const { return t.view({rows, tokens, heads, dh}).transpose(1, 2); }
  torch::Tensor merge(const torch::Tensor& t) const { return t.transpose(1, 2).reshape({rows, tokens, d}); }

  // Pre-LN: x + f(LN(x)); post-LN: LN(x + f(x)). f's result is fresh: the residual is added into it.
  template <class F>
  torch::Tensor sublayer(const torch::Tensor& x, const Tensors& norm, double eps, F f) const {
    return sublayer(x, x, norm, eps, f);
  }

  // The same with another residual: the positions f computes (an encoder's kept first position) of x.
  template <class F>
  torch::Tensor sublayer(const torch::Tensor& x, const torch::Tensor& residual, const Tensors& norm, double eps,
                         F f) const {
    if (pre_norm) return rows_add_(f(rows_layer_norm(x, norm[0], norm[1], eps)), residual);
    return rows_layer_norm(rows_add_(f(x), residual), norm[0], norm[1], eps);
  }

  torch::Tensor activate(const torch::Tensor& h) const { return rows_activate_(h, activation); }
};

// SDPA of q over per-row K/V whose rows repeat in runs of `group` (beams of one source): the g queries of
// a run attend together to its first row (fast_step._grouped_attention).
torch::Tensor grouped_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                const optional<torch::Tensor>& mask, int64_t group) {
  if (group == 1) return decode_attention(q, keys, values, mask);
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), dh = q.size(3);
  auto grouped = q.view({b / group, group, h, t, dh}).transpose(1, 2).reshape({b / group, h, group * t, dh});
  auto first = [&](const torch::Tensor& x) { return x.slice(0, 0, b, group); };
  auto out = decode_attention(grouped, first(keys), first(values),
                              mask.has_value() ? optional<torch::Tensor>(first(*mask)) : c10::nullopt);
  return out.view({b / group, h, group, t, dh}).transpose(1, 2).reshape({b, h, t, dh});
}

}  // namespace

DecoderStack::DecoderStack(std::vector<Tensors> projections, std::vector<Tensors> norms, std::vector<double> eps,
                           int64_t heads, bool pre_norm, Activation activation)
    : projections(std::move(projections)), norms(std::move(norms)), eps(std::move(eps)), heads(heads),
      pre_norm(pre_norm), activation(activation) {
  const int64_t count = layers();
  TORCH_CHECK(static_cast<int64_t>(this->eps.size()) == count * kNorms &&
              static_cast<int64_t>(this->norms.size()) == count * kNorms &&
              static_cast<int64_t>(this->projections.size()) == count * kSlots && heads > 0,
              "decode step: per-layer argument counts disagree");
  for (int64_t l = 0; l < count; ++l) {
    const Tensors* n = &this->norms[l * kNorms];
    TORCH_CHECK(n[kSelfAttnNorm].size() == 2 && n[kFfnNorm].size() == 2 &&
                n[kCrossAttnNorm].size() == (this->projections[l * kSlots + kCrossQ].empty() ? 0u : 2u),
                "decode step: a LayerNorm is {weight, bias}");
  }
  for (const Tensors& p : this->projections) {
    TORCH_CHECK(p.empty() || p.size() == 2 || p.size() == 4, "decode step: a projection is 2 (float32) or 4 (int8) tensors");
  }
}

torch::Tensor DecoderStack::step(torch::Tensor x, const StepCache& cache, const std::vector<Tensors>& deltas,
                                 const Tensors& panels) const {
  const int64_t count = layers();
  TORCH_CHECK(x.dim() == 3 && x.size(1) >= 1 && x.size(1) <= kMaxStepTokens, "decode step: x must be (B, t, D), t <= ",
              kMaxStepTokens);
  TORCH_CHECK(static_cast<int64_t>(cache.keys.size()) == count && static_cast<int64_t>(cache.values.size()) == count &&
              (deltas.empty() || deltas.size() == projections.size()) &&
              (panels.empty() || panels.size() == projections.size()) &&
              cache.cross_keys.size() == cache.cross_values.size() && cache.group >= 1,
              "decode step: per-layer argument counts disagree");
  const Step s{x.size(0), x.size(1), heads, x.size(2), x.size(2) / heads, pre_norm, activation};
  const Tensors &keys = cache.keys, &values = cache.values;
  const optional<torch::Tensor>& positions = cache.write_positions;
  torch::Tensor rows;
  if (positions.has_value()) rows = torch::arange(s.rows, positions->options()).unsqueeze(1);
  for (int64_t l = 0; l < count; ++l) {
    const Tensors* p = &projections[l * kSlots];
    const Tensors* lora = deltas.empty() ? nullptr : &deltas[l * kSlots];
    const torch::Tensor* packed = panels.empty() ? nullptr : &panels[l * kSlots];
    auto delta = [&](Slot slot) { return lora == nullptr ? nullptr : &lora[slot]; };
    auto panel = [&](Slot slot) { return packed == nullptr ? nullptr : &packed[slot]; };
    const Tensors* n = &norms[l * kNorms];
    const double* e = &eps[l * kNorms];
    x = s.sublayer(x, n[kSelfAttnNorm], e[kSelfAttnNorm], [&](const torch::Tensor& h) {
      torch::Tensor q, k, v;
      if (!p[kQkv].empty()) {
        auto qkv = project(h, p[kQkv], panel(kQkv)).view({s.rows, s.tokens, 3, heads, s.dh}).permute({2, 0, 3, 1, 4});
        q = qkv[0], k = qkv[1], v = qkv[2];
      } else {
        q = s.split(project(h, p[kQ], delta(kQ), panel(kQ))), k = s.split(project(h, p[kK], delta(kK), panel(kK)));
        v = s.split(project(h, p[kV], delta(kV), panel(kV)));
      }
      if (rows.defined()) {  // advanced indices on dims 0 and 2: (B, t, H, Dh) values
        torch::Tensor layer_keys = keys[l], layer_values = values[l];  // handles to the cache buffers
        layer_keys.index_put_({rows, torch::indexing::Slice(), *positions}, k.transpose(1, 2));
        layer_values.index_put_({rows, torch::indexing::Slice(), *positions}, v.transpose(1, 2));
      } else {
        rows_cache_write(keys[l], cache.start, k);
        rows_cache_write(values[l], cache.start, v);
      }
      auto out = decode_attention(q, keys[l].narrow(2, 0, cache.visible), values[l].narrow(2, 0, cache.visible),
                                  cache.self_mask, cache.prefix_blocks, cache.prefix_table, l);
      return project(s.merge(out), p[kOut], delta(kOut), panel(kOut));
    });
    if (!p[kCrossQ].empty()) {
      TORCH_CHECK(l < static_cast<int64_t>(cache.cross_keys.size()), "decode step: no cross-attention keys/values");
      x = s.sublayer(x, n[kCrossAttnNorm], e[kCrossAttnNorm], [&](const torch::Tensor& h) {
        auto q = s.split(project(h, p[kCrossQ], delta(kCrossQ), panel(kCrossQ)));
        auto out = grouped_attention(q, cache.cross_keys[l], cache.cross_values[l], cache.memory_mask, cache.group);
        return project(s.merge(out), p[kCrossOut], delta(kCrossOut), panel(kCrossOut));
      });
    }
    x = s.sublayer(x, n[kFfnNorm], e[kFfnNorm], [&](const torch::Tensor& h) {
      return project(s.activate(project(h, p[kFc1], delta(kFc1), panel(kFc1))), p[kFc2], delta(kFc2), panel(kFc2));
    });
  }
  return x;
}

torch::Tensor DecoderStack::encode(torch::Tensor x, const optional<torch::Tensor>& mask, const Tensors& panels,
                                   bool keep_first) const {
  const int64_t count = layers();
  TORCH_CHECK(x.dim() == 3 && x.size(1) >= 1 && x.size(1) <= kMaxStepTokens, "encode: x must be (B, T, D), T <= ",
              kMaxStepTokens);
  TORCH_CHECK(panels.empty() || panels.size() == projections.size(), "encode: one panel entry per projection");
  for (int64_t l = 0; l < count; ++l)
    TORCH_CHECK(projections[l * kSlots + kCrossQ].empty(), "encode: an encoder layer has no cross-attention");
  Step s{x.size(0), x.size(1), heads, x.size(2), x.size(2) / heads, pre_norm, activation};
  for (int64_t l = 0; l < count; ++l) {
    const Tensors* p = &projections[l * kSlots];
    const torch::Tensor* packed = panels.empty() ? nullptr : &panels[l * kSlots];
    auto panel = [&](Slot slot) { return packed == nullptr ? nullptr : &packed[slot]; };
    const Tensors* n = &norms[l * kNorms];
    const double* e = &eps[l * kNorms];
    // Self-attention over h (B, T, D) for the queries of `out`'s step: every position (s) or the first alone.
    auto attend = [&](const torch::Tensor& h, const Step& out) {
      torch::Tensor q, k, v;
      if (!p[kQkv].empty()) {
        auto qkv = project(h, p[kQkv], panel(kQkv)).view({s.rows, s.tokens, 3, heads, s.dh}).permute({2, 0, 3, 1, 4});
        q = qkv[0].narrow(2, 0, out.tokens), k = qkv[1], v = qkv[2];
      } else {
        q = out.split(project(h.narrow(1, 0, out.tokens), p[kQ], panel(kQ)));
        k = s.split(project(h, p[kK], panel(kK))), v = s.split(project(h, p[kV], panel(kV)));
      }
      return project(out.merge(decode_attention(q, k, v, mask, {}, c10::nullopt, 0)), p[kOut], panel(kOut));
    };
    if (keep_first && l == count - 1 && s.tokens > 1) {  // the kept position's sub-layer: its residual is x[:, :1]
      Step first = s;
      first.tokens = 1;
      x = s.sublayer(x, x.narrow(1, 0, 1).contiguous(), n[kSelfAttnNorm], e[kSelfAttnNorm],
                     [&](const torch::Tensor& h) { return attend(h, first); });
      s = first;
    } else {
      x = s.sublayer(x, n[kSelfAttnNorm], e[kSelfAttnNorm], [&](const torch::Tensor& h) { return attend(h, s); });
    }
    x = s.sublayer(x, n[kFfnNorm], e[kFfnNorm], [&](const torch::Tensor& h) {
      return project(s.activate(project(h, p[kFc1], panel(kFc1))), p[kFc2], panel(kFc2));
    });
  }
  return x;
}
