// One decoding step through every decoder layer in one call (model/fast_step.py's native path), and an encoder's
// forward over short rows (DecoderStack::encode: a sentence of up to 16 tokens to classify or embed).
//
// The computation of the decode plan's Python replay (DecodePlan), in the same order: the layer loop, the
// head split/merge views and the cache writes run here instead of in the interpreter, which cost about
// 0.5 ms per step at d_model 512 / 6 layers (a fifth of a batch-1 step). Projections are float32 (weight,
// bias) pairs (few_rows_linear.cpp: the same sums as F.linear in another order), our bf16 layers (packed, bias:
// bf16_linear.cpp) or our int8 layers (packed, scales, sums, bias: int8_vnni.cpp), plus LoRA deltas
// (lora_delta.cpp); attention is decode_attention.cpp; LayerNorm / RMSNorm, activations, gates, rotary positions,
// residual adds and uniform cache writes are elementwise.cpp's. The Llama blocks: RMSNorm, q and k rotated at each row's positions (cos and sin
// computed once per step by model/fast_step.py), grouped-query attention (the cache and k/v hold the KV heads),
// a gated FFN (kUp), a head width other than d_model / heads; Qwen3's and Gemma 3's: RMSNorms of each head of q and
// k before rotation, Gemma's (1 + weight) RMSNorms, norms of each sub-layer's output before the residual add, a
// scale of q.k other than 1/sqrt(Dh) (q scaled after rotation, as MultiHeadAttention does), sliding-window layers
// (their own mask, built per step by model/fast_step.py) with their own rotary cos/sin. T5's: the scale of q.k in
// cross-attention too, and a relative position bias as a float self-attention mask (StepCache::self_mask, built per
// step by model/fast_step.py; decode_attention.cpp adds it to the scores).
// Beyond a few rows the float32 projections take the weights' packed copies when given (packed_linear.cpp).
// One new token per row; the caller has begun the cache step.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

using c10::optional;

optional<torch::Tensor> maybe(const torch::Tensor& t) { return t.numel() ? optional<torch::Tensor>(t) : c10::nullopt; }

// A projection: {weight, bias} float32 (bias empty when absent), {packed, bias} bf16 (bf16_linear.cpp: the bias
// always given, float32 zeros where the layer has none, its length the output width) or {packed, scales, sums, bias}
// int8; a float32 weight's panels (packed_linear.cpp) when the caller gives them (more rows than the few-rows GEMV
// takes).
torch::Tensor project(const torch::Tensor& x, const Tensors& p, const torch::Tensor* panels) {
  if (p.size() == 4) return int8_linear(x, p[0], p[1], p[2], maybe(p[3]));
  if (p[0].scalar_type() == at::kBFloat16) return bf16_linear(x, p[0], p[1].size(0), p[1]);
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

// The buffers of a step's int8 projections (their outputs and their inputs' quantised rows) and of its pre-norms,
// one set per thread (thread_local: engines stepping from two threads never share one), kept across layers and
// steps while their shapes stay: an at::empty per op was ~4% of a SmolLM2 int8 batch-1 step. Each role's buffer is
// written once per layer; none is read after the next layer writes it except the residual stream, whose buffers
// (out, cross_out, fc2) alternate, and the step's result, which leaves as a copy (DecoderStack::step).
class Workspace {
 public:
  enum Role : int64_t { kOutput, kRowsQ, kRowsScale, kPerSlot };  // per projection: its output, x quantised, scales
  static constexpr int64_t kNormed = kSlots * kPerSlot, kHiddenQ = kNormed + 1, kHiddenScale = kNormed + 2,
                           kRoles = kNormed + 3;  // a pre-norm's output; a gated FFN's hidden rows quantised
  // At most this many rows (rows x tokens) take the workspace: decoding steps; a longer prefill allocates as before
  // rather than hold its larger buffers for the rest of the thread's life.
  static constexpr int64_t kMaxRows = 64;

  // The buffer of `role` with these sizes and dtype: the last one when it matches, else a fresh one kept. A normal
  // tensor even when made under inference mode: a later step outside it (torch.no_grad) updates it in place.
  const torch::Tensor& get(int64_t role, at::IntArrayRef sizes, at::ScalarType dtype) {
    torch::Tensor& t = buffers_[role];
    if (!t.defined() || t.scalar_type() != dtype || t.sizes() != sizes) {
      c10::InferenceMode normal(false);
      t = torch::empty(sizes, at::TensorOptions(dtype));
    }
    return t;
  }
  static int64_t role(Slot slot, Role r) { return slot * kPerSlot + r; }

 private:
  std::array<torch::Tensor, kRoles> buffers_;
};

struct Step {
  int64_t rows, tokens, heads, kv_heads, dh;  // tokens per row: 1, or a speculative draft's verification
  bool pre_norm;
  Activation activation;
  bool norm_offset;  // RMSNorms by 1 + weight
  double query_scale;
  Workspace* ws = nullptr;  // the thread's buffers (null: every op allocates its result)

  // A projection (as ::project) into the workspace where it is int8 and ws is set.
  torch::Tensor project(const torch::Tensor& x, const Tensors& p, Slot slot, const Tensors* deltas,
                        const torch::Tensor* panels) const {
    if (ws == nullptr || p.size() != 4 || !x.is_contiguous()) return ::project(x, p, deltas, panels);
    const int64_t m = x.numel() / x.size(-1);
    c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = p[1].size(0);
    const torch::Tensor& out = ws->get(Workspace::role(slot, Workspace::kOutput), sizes, at::kFloat);
    int8_linear_out(x, p[0], p[1], p[2], maybe(p[3]), out, rows_q(slot, m, p[0].size(1) * 4), rows_scale(slot, m));
    if (deltas != nullptr && !deltas->empty()) lora_delta_add_(out, x, (*deltas)[0], (*deltas)[1], (*deltas)[2]);
    return out;
  }
  const torch::Tensor& rows_q(Slot slot, int64_t m, int64_t k_padded) const {
    return ws->get(Workspace::role(slot, Workspace::kRowsQ), {m, k_padded}, at::kByte);
  }
  const torch::Tensor& rows_scale(Slot slot, int64_t m) const {
    return ws->get(Workspace::role(slot, Workspace::kRowsScale), {m}, at::kFloat);
  }

  // A norm as the stack holds it: {weight, bias} a LayerNorm, {weight} an RMSNorm.
  torch::Tensor norm_rows(const torch::Tensor& x, const Tensors& norm, double eps) const {
    return norm.size() == 1 ? rows_rms_norm(x, norm[0], eps, norm_offset) : rows_layer_norm(x, norm[0], norm[1], eps);
  }
  // A pre-norm (its output the sub-layer's input alone) into the workspace's buffer where ws is set.
  torch::Tensor pre_norm_rows(const torch::Tensor& x, const Tensors& norm, double eps) const {
    if (ws == nullptr) return norm_rows(x, norm, eps);
    const torch::Tensor& y = ws->get(Workspace::kNormed, x.sizes(), at::kFloat);
    return norm.size() == 1 ? rows_rms_norm_into(x, norm[0], eps, norm_offset, y)
                            : rows_layer_norm_into(x, norm[0], norm[1], eps, y);
  }

  // q (B, H, t, Dh) and k (B, H_kv, t, Dh), views of this step's fresh projections, in place as MultiHeadAttention
  // takes them before the cache write: each head's norm (n: the layer's norms), rotation at the rows' positions
  // (cos and sin; undefined: none), q times query_scale.
  void prepare(const torch::Tensor& q, const torch::Tensor& k, const Tensors* n, const double* e,
               const torch::Tensor& cos, const torch::Tensor& sin) const {
    if (!n[kQNorm].empty()) {
      rows_head_rms_norm_(q, n[kQNorm][0], e[kQNorm], norm_offset);
      rows_head_rms_norm_(k, n[kKNorm][0], e[kKNorm], norm_offset);
    }
    if (cos.defined()) {
      rows_rotate_(q, cos, sin, query_scale);
      rows_rotate_(k, cos, sin);
    } else if (query_scale != 1.0) {
      q.mul_(query_scale);
    }
  }

  // (B, t, n * Dh) -> (B, n, t, Dh) for n query or KV heads; one token a row: one view, no transpose (the two differ
  // only in the stride of a size-1 dim: the same elements), one ATen op less per projection (90 a SmolLM2 step).
  torch::Tensor split(const torch::Tensor& t, int64_t n) const {
    return tokens == 1 ? t.view({rows, n, 1, dh}) : t.view({rows, tokens, n, dh}).transpose(1, 2);
  }
  torch::Tensor split(const torch::Tensor& t) const { return split(t, heads); }
  torch::Tensor merge(const torch::Tensor& t) const {
    return tokens == 1 ? t.reshape({rows, 1, heads * dh}) : t.transpose(1, 2).reshape({rows, tokens, heads * dh});
  }

  // The fused projection's output (B, t, (H + 2 H_kv) Dh) -> q, k, v, each (B, heads, t, Dh).
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> split_qkv(const torch::Tensor& qkv) const {
    const int64_t q = heads * dh, kv = kv_heads * dh;
    return {split(qkv.narrow(2, 0, q)), split(qkv.narrow(2, q, kv), kv_heads), split(qkv.narrow(2, q + kv, kv), kv_heads)};
  }

  // The FFN of h: fc2(act(fc1 h)), or fc2(act(fc1 h) * up(h)) when the layer has kUp. `lora`: the layer's deltas
  // (null: none).
  template <class P>
  torch::Tensor ffn(const torch::Tensor& h, const Tensors* p, const Tensors* lora, P projection) const {
    const bool int8 = p[kFc1].size() == 4 && p[kFc2].size() == 4 && (p[kUp].empty() || p[kUp].size() == 4);
    if (int8 && (lora == nullptr || (lora[kFc1].empty() && lora[kUp].empty() && lora[kFc2].empty())))
      return int8_ffn(h, p);
    torch::Tensor inner = activate(projection(h, kFc1));
    if (!p[kUp].empty()) inner = rows_mul_(inner, projection(h, kUp));
    return projection(inner, kFc2);
  }

  // An int8 FFN without LoRA deltas: h quantised once, fc1's rows (activated, times up's when gated) quantised for fc2
  // inside fc1's GEMM (int8_vnni.cpp): the same bytes as fc2 quantising the float hidden state, which never goes to
  // memory (docs/benchmarks.md, "The int8 feed-forward in one pass").
  torch::Tensor int8_ffn(const torch::Tensor& h, const Tensors* p) const {
    const Tensors &fc1 = p[kFc1], &up = p[kUp], &fc2 = p[kFc2];
    if (ws != nullptr && !up.empty() && h.is_contiguous()) return int8_gated_ffn_into(h, p);
    const torch::Tensor rows = h.reshape({-1, h.size(-1)}).contiguous();
    auto [hq, hs] = up.empty() ? int8_linear_activated_quantized(rows, fc1[0], fc1[1], fc1[2], maybe(fc1[3]), activation)
                               : int8_gated_quantized(rows, fc1[0], fc1[1], fc1[2], maybe(fc1[3]), up[0], up[1], up[2],
                                                      maybe(up[3]), activation);
    std::vector<int64_t> sizes = h.sizes().vec();
    sizes.back() = fc2[1].size(0);
    return int8_linear_quantized(hq, hs, fc2[0], fc2[1], fc2[2], maybe(fc2[3])).view(sizes);
  }

  // int8_ffn of a gated FFN into the workspace's buffers.
  torch::Tensor int8_gated_ffn_into(const torch::Tensor& h, const Tensors* p) const {
    const Tensors &fc1 = p[kFc1], &up = p[kUp], &fc2 = p[kFc2];
    const int64_t m = h.numel() / h.size(-1), hidden = fc1[1].size(0);
    const torch::Tensor& hq = ws->get(Workspace::kHiddenQ, {m, (hidden + 3) / 4 * 4}, at::kByte);
    const torch::Tensor& hs = ws->get(Workspace::kHiddenScale, {m}, at::kFloat);
    int8_gated_quantized_out(h, fc1[0], fc1[1], fc1[2], maybe(fc1[3]), up[0], up[1], up[2], maybe(up[3]), activation,
                             rows_q(kFc1, m, fc1[0].size(1) * 4), rows_scale(kFc1, m), hq, hs);
    c10::SmallVector<int64_t, 4> sizes(h.sizes().begin(), h.sizes().end());
    sizes.back() = fc2[1].size(0);
    const torch::Tensor& out = ws->get(Workspace::role(kFc2, Workspace::kOutput), sizes, at::kFloat);
    int8_linear_quantized_out(hq, hs, fc2[0], fc2[1], fc2[2], maybe(fc2[3]), out);
    return out;
  }

  // Pre-LN: x + f(LN(x)), with a post norm (sandwich: norms[post] not empty) x + LN'(f(LN(x))); post-LN:
  // LN(x + f(x)). f's result is fresh: the residual is added into it. norms, eps: the layer's.
  template <class F>
  torch::Tensor sublayer(const torch::Tensor& x, const Tensors* norms, const double* eps, Norm norm, Norm post,
                         F f) const {
    return sublayer(x, x, norms, eps, norm, post, f);
  }

  // The same with another residual: the positions f computes (an encoder's kept first position) of x.
  template <class F>
  torch::Tensor sublayer(const torch::Tensor& x, const torch::Tensor& residual, const Tensors* norms, const double* eps,
                         Norm norm, Norm post, F f) const {
    if (!pre_norm) return norm_rows(rows_add_(f(x), residual), norms[norm], eps[norm]);
    torch::Tensor out = f(pre_norm_rows(x, norms[norm], eps[norm]));
    if (post != kNorms && !norms[post].empty()) out = norm_rows(out, norms[post], eps[post]);
    return rows_add_(out, residual);
  }

  torch::Tensor activate(const torch::Tensor& h) const { return rows_activate_(h, activation); }
};

// The step of x (B, t, D) through `stack`.
Step step_shape(const DecoderStack& stack, const torch::Tensor& x) {
  return Step{x.size(0), x.size(1), stack.heads, stack.kv_heads, stack.head_dim ? stack.head_dim : x.size(2) / stack.heads,
              stack.pre_norm, stack.activation, stack.norm_offset, stack.query_scale};
}

// SDPA of q over per-row K/V copies of the rows' sources, in runs of rows of one source (beams of a sentence): with
// every run `group` rows long, the g queries of a run attend together to its first row (fast_step._grouped_attention);
// with runs of different lengths (requests of different beam widths side by side), each row reads its run's first
// row (`lead`, model.kv_cache.CrossAttentionMemory.leads: decode_attention's beam_lead, with `whole` every position
// shared), the run's rows one after another, so the first row's K/V come from memory once.
torch::Tensor grouped_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                const optional<torch::Tensor>& mask, int64_t group, const optional<torch::Tensor>& lead,
                                const optional<torch::Tensor>& whole) {
  if (group == 1) return decode_attention(q, keys, values, mask, {}, c10::nullopt, 0, lead, whole);
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), dh = q.size(3);
  auto grouped = q.view({b / group, group, h, t, dh}).transpose(1, 2).reshape({b / group, h, group * t, dh});
  auto first = [&](const torch::Tensor& x) { return x.slice(0, 0, b, group); };
  auto out = decode_attention(grouped, first(keys), first(values),
                              mask.has_value() ? optional<torch::Tensor>(first(*mask)) : c10::nullopt);
  return out.view({b / group, h, group, t, dh}).transpose(1, 2).reshape({b, h, t, dh});
}

}  // namespace

DecoderStack::DecoderStack(std::vector<Tensors> projections, std::vector<Tensors> norms, std::vector<double> eps,
                           int64_t heads, bool pre_norm, Activation activation, int64_t kv_heads, int64_t head_dim,
                           std::vector<int64_t> rotary, std::vector<bool> windowed, bool norm_offset,
                           double query_scale)
    : projections(std::move(projections)), norms(std::move(norms)), eps(std::move(eps)), heads(heads),
      pre_norm(pre_norm), activation(activation), kv_heads(kv_heads ? kv_heads : heads), head_dim(head_dim),
      rotary(std::move(rotary)), windowed(std::move(windowed)), norm_offset(norm_offset), query_scale(query_scale) {
  const int64_t count = layers();
  TORCH_CHECK(static_cast<int64_t>(this->eps.size()) == count * kNorms &&
              static_cast<int64_t>(this->norms.size()) == count * kNorms &&
              static_cast<int64_t>(this->projections.size()) == count * kSlots && heads > 0,
              "decode step: per-layer argument counts disagree");
  TORCH_CHECK(this->kv_heads > 0 && heads % this->kv_heads == 0 && head_dim >= 0,
              "decode step: the KV heads must divide the heads");
  TORCH_CHECK((this->rotary.empty() || static_cast<int64_t>(this->rotary.size()) == count) &&
              (this->windowed.empty() || static_cast<int64_t>(this->windowed.size()) == count) && query_scale > 0,
              "decode step: one rotary kind and one window flag per layer (or none), a positive query scale");
  for (int64_t kind : this->rotary) TORCH_CHECK(kind >= 0, "decode step: a rotary kind is an index");
  auto is_norm = [](const Tensors& n) { return n.size() == 1 || n.size() == 2; };
  for (int64_t l = 0; l < count; ++l) {
    const Tensors* n = &this->norms[l * kNorms];
    const bool cross = !this->projections[l * kSlots + kCrossQ].empty();
    TORCH_CHECK(is_norm(n[kSelfAttnNorm]) && is_norm(n[kFfnNorm]) && (cross ? is_norm(n[kCrossAttnNorm])
                                                                             : n[kCrossAttnNorm].empty()),
                "decode step: a norm is {weight, bias} (LayerNorm) or {weight} (RMSNorm)");
    TORCH_CHECK(n[kSelfAttnPostNorm].empty() == n[kFfnPostNorm].empty() && n[kQNorm].empty() == n[kKNorm].empty() &&
                (n[kSelfAttnPostNorm].empty() || (pre_norm && n[kSelfAttnPostNorm].size() <= 2 &&
                                                  n[kFfnPostNorm].size() <= 2)) &&
                (n[kQNorm].empty() || (n[kQNorm].size() == 1 && n[kKNorm].size() == 1)),
                "decode step: post norms both or neither (pre-LN), q/k norms both or neither (RMSNorms)");
  }
  for (const Tensors& p : this->projections) {
    TORCH_CHECK(p.empty() || p.size() == 2 || p.size() == 4,
                "decode step: a projection is 2 (float32 or bf16) or 4 (int8) tensors");
    TORCH_CHECK(p.size() != 2 || p[0].scalar_type() != at::kBFloat16 || (p[0].dim() == 4 && p[1].dim() == 1),
                "decode step: a bf16 projection is {packed, bias} with the bias always given");
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
  // Cross-attention over runs of one source of different lengths: every position of a row's source is its lead's.
  const optional<torch::Tensor> whole_source =
      cache.cross_lead.has_value() && !cache.cross_keys.empty()
          ? optional<torch::Tensor>(torch::full({x.size(0)}, cache.cross_keys[0].size(2), cache.cross_lead->options()))
          : c10::nullopt;
  for (int64_t kind : rotary)
    TORCH_CHECK(kind < static_cast<int64_t>(cache.rotary_cos.size()) && cache.rotary_cos.size() == cache.rotary_sin.size(),
                "decode step: a rotary stack needs this step's cos and sin of each rotary kind");
  thread_local Workspace workspace;
  Step s = step_shape(*this, x);
  if (s.rows * s.tokens <= Workspace::kMaxRows) s.ws = &workspace;
  const Tensors &keys = cache.keys, &values = cache.values;
  const optional<torch::Tensor>& positions = cache.write_positions;
  torch::Tensor rows;
  if (positions.has_value()) rows = torch::arange(s.rows, positions->options()).unsqueeze(1);
  for (int64_t l = 0; l < count; ++l) {
    const Tensors* p = &projections[l * kSlots];
    const Tensors* lora = deltas.empty() ? nullptr : &deltas[l * kSlots];
    const torch::Tensor* packed = panels.empty() ? nullptr : &panels[l * kSlots];
    auto panel = [&](Slot slot) { return packed == nullptr ? nullptr : &packed[slot]; };
    auto projection = [&](const torch::Tensor& in, Slot slot) {
      return s.project(in, p[slot], slot, lora == nullptr ? nullptr : &lora[slot], panel(slot));
    };
    const Tensors* n = &norms[l * kNorms];
    const double* e = &eps[l * kNorms];
    x = s.sublayer(x, n, e, kSelfAttnNorm, kSelfAttnPostNorm, [&](const torch::Tensor& h) {
      torch::Tensor q, k, v;
      if (!p[kQkv].empty()) {
        std::tie(q, k, v) = s.split_qkv(s.project(h, p[kQkv], kQkv, nullptr, panel(kQkv)));  // no deltas: unfused
      } else {
        q = s.split(projection(h, kQ));
        k = s.split(projection(h, kK), kv_heads);
        v = s.split(projection(h, kV), kv_heads);
      }
      const bool rotated = !rotary.empty();
      s.prepare(q, k, n, e, rotated ? cache.rotary_cos[rotary[l]] : torch::Tensor(),
                rotated ? cache.rotary_sin[rotary[l]] : torch::Tensor());
      if (rows.defined()) {  // advanced indices on dims 0 and 2: (B, t, H, Dh) values
        torch::Tensor layer_keys = keys[l], layer_values = values[l];  // handles to the cache buffers
        layer_keys.index_put_({rows, torch::indexing::Slice(), *positions}, k.transpose(1, 2));
        layer_values.index_put_({rows, torch::indexing::Slice(), *positions}, v.transpose(1, 2));
      } else {
        rows_cache_write(keys[l], cache.start, k);
        rows_cache_write(values[l], cache.start, v);
      }
      const bool window = !windowed.empty() && windowed[l];
      auto out = decode_attention(q, keys[l].narrow(2, 0, cache.visible), values[l].narrow(2, 0, cache.visible),
                                  window ? cache.window_mask : cache.self_mask, cache.prefix_blocks, cache.prefix_table, l,
                                  cache.beam_lead, cache.beam_shared);
      return projection(s.merge(out), kOut);
    });
    if (!p[kCrossQ].empty()) {
      TORCH_CHECK(l < static_cast<int64_t>(cache.cross_keys.size()), "decode step: no cross-attention keys/values");
      x = s.sublayer(x, n, e, kCrossAttnNorm, kNorms, [&](const torch::Tensor& h) {
        auto q = s.split(projection(h, kCrossQ));
        if (s.query_scale != 1.0) q.mul_(s.query_scale);  // the stack's scale of q.k, cross-attention's too (T5's)
        auto out = grouped_attention(q, cache.cross_keys[l], cache.cross_values[l], cache.memory_mask, cache.group,
                                     cache.cross_lead, whole_source);
        return projection(s.merge(out), kCrossOut);
      });
    }
    x = s.sublayer(x, n, e, kFfnNorm, kFfnPostNorm, [&](const torch::Tensor& h) {
      return s.ffn(h, p, lora, projection);
    });
  }
  return s.ws == nullptr ? x : x.clone();  // the result outlives the step: not a buffer the next step rewrites
}

torch::Tensor DecoderStack::encode(torch::Tensor x, const optional<torch::Tensor>& mask, const Tensors& panels,
                                   bool keep_first, const Attention& attention) const {
  const int64_t count = layers();
  TORCH_CHECK(x.dim() == 3 && x.size(1) >= 1 && x.size(1) <= kMaxEncodeTokens, "encode: x must be (B, T, D), T <= ",
              kMaxEncodeTokens);
  TORCH_CHECK(panels.empty() || panels.size() == projections.size(), "encode: one panel entry per projection");
  for (int64_t l = 0; l < count; ++l)
    TORCH_CHECK(projections[l * kSlots + kCrossQ].empty(), "encode: an encoder layer has no cross-attention");
  TORCH_CHECK(rotary.empty() && std::find(windowed.begin(), windowed.end(), true) == windowed.end(),
              "encode: no rotary positions, no sliding windows");
  Step s = step_shape(*this, x);
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
        std::tie(q, k, v) = s.split_qkv(project(h, p[kQkv], panel(kQkv)));
        q = q.narrow(2, 0, out.tokens);
      } else {
        q = out.split(project(h.narrow(1, 0, out.tokens), p[kQ], panel(kQ)));
        k = s.split(project(h, p[kK], panel(kK)), kv_heads), v = s.split(project(h, p[kV], panel(kV)), kv_heads);
      }
      s.prepare(q, k, n, e, torch::Tensor(), torch::Tensor());
      const torch::Tensor attended = attention ? attention(q, k, v) : decode_attention(q, k, v, mask, {}, c10::nullopt, 0);
      return project(out.merge(attended), p[kOut], panel(kOut));
    };
    if (keep_first && l == count - 1 && s.tokens > 1) {  // the kept position's sub-layer: its residual is x[:, :1]
      Step first = s;
      first.tokens = 1;
      x = s.sublayer(x, x.narrow(1, 0, 1).contiguous(), n, e, kSelfAttnNorm, kSelfAttnPostNorm,
                     [&](const torch::Tensor& h) { return attend(h, first); });
      s = first;
    } else {
      x = s.sublayer(x, n, e, kSelfAttnNorm, kSelfAttnPostNorm, [&](const torch::Tensor& h) { return attend(h, s); });
    }
    x = s.sublayer(x, n, e, kFfnNorm, kFfnPostNorm, [&](const torch::Tensor& h) {
      return s.ffn(h, p, nullptr, [&](const torch::Tensor& in, Slot slot) { return project(in, p[slot], panel(slot)); });
    });
  }
  return x;
}
