// The Python module of model/kernels (built and loaded by model/native.py).
#include <torch/extension.h>
#include <pybind11/functional.h>

#include "kernels.h"

// The computing functions release the GIL (as PyTorch's own ops do), so the service's event loop and other
// Python threads run while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  module.def("has_vnni", &has_vnni, "whether this CPU has AVX512-VNNI (the int8 kernel's wide tiles)");
  module.def("has_int8_kernel", &has_int8_kernel, "whether int8_linear runs here (AVX512-VNNI, or AVX2 with FMA)");
  module.def("int8_linear", &int8_linear, "int8 linear: x float32 (..., in) -> (..., out) float32", release());
  module.def("int8_linear_activated", &int8_linear_activated,
             "an Activation of int8_linear, applied to each output tile in the GEMM", release());
  module.def("int8_linear_activated_quantized", &int8_linear_activated_quantized,
             "int8_linear_activated's rows quantised for the next int8 GEMM: (uint8 rows, scales)", release());
  module.def("int8_linear_quantized", &int8_linear_quantized,
             "int8_linear of rows already quantised (uint8 rows, scales)", release());
  module.def("int8_gated_quantized", &int8_gated_quantized,
             "a gated FFN's hidden rows act(x gate^T + b) * (x up^T + b') quantised for the next int8 GEMM", release());
  module.def("has_avx512", &has_avx512, "whether this CPU has AVX-512 F/BW/VL/DQ (decode_attention)");
  module.def("has_avx2", &has_avx2, "whether this CPU has AVX2 and FMA (the float32 kernels' 8-lane twins)");
  module.def("has_vector_kernels", &has_vector_kernels, "whether this CPU runs the float32 kernels (AVX-512 or AVX2)");
  module.def("decode_attention", &decode_attention,
             "attention of a few queries per head over a KV cache (and a shared prefix's blocks), float32",
             pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"),
             pybind11::arg("prefix_blocks") = std::vector<torch::Tensor>{},
             pybind11::arg("prefix_table") = c10::nullopt, pybind11::arg("layer") = 0, pybind11::arg("beam_lead") = c10::nullopt,
             pybind11::arg("beam_shared") = c10::nullopt, release());
  module.def("encoder_attention", &encoder_attention,
             "bidirectional self-attention of (B, H, T, 64) rows under a key mask (B|1, 1, 1, T), float32",
             pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), release());
  module.def("encoder_attention_bf16", &encoder_attention_bf16,
             "encoder_attention with q, k, v and the softmax's weights rounded to bf16, float32 sums (AVX512-BF16)",
             pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), release());
  module.def("prefill_attention", &prefill_attention,
             "self-attention of (B, H, Tq, Dh) queries over (B, H_kv, Tk, Dh) keys under a bool mask (B|1, 1, Tq|1, Tk) "
             "(causal: only the key spans each block of queries keeps), float32",
             pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), release());
  module.def("few_rows_linear", &few_rows_linear, "float32 linear of a few rows over input-major weights (else at::linear)",
             release());
  module.def("pack_weight", &pack_weight, "an (N, K) float32 weight as (ceil(N / 32), K, 32) panels (into out)",
             pybind11::arg("weight"), pybind11::arg("out") = c10::nullopt, release());
  module.def("packed_linear", &packed_linear, "float32 linear over pack_weight's panels: x (..., K) -> (..., n)",
             release());
  module.def("set_panel_tuning", &set_panel_tuning, "packed_linear's blocking and prefetch rule (model/cpu.py)");
  module.def("panel_tuning", &panel_tuning, "packed_linear's blocking and prefetch rule in force");
  module.def("has_avx512_bf16", &has_avx512_bf16, "whether this CPU has AVX512-BF16 (bf16_linear)");
  module.def("bf16_linear", &bf16_linear,
             "bf16 linear: x float32 (..., K) rounded to bf16, times model.bf16_linear.pack's weights, float32 sums "
             "-> (..., n)", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias"),
             release());
  module.def("greedy_pick", &greedy_pick, "greedy choice per row: (first argmax outside banned, its log-prob)", release());
  module.def("beam_topk", &beam_topk,
             "per sentence of width rows: the best k of log_softmax(logits) + scores outside banned (values, ids)",
             release());
  module.def("rows_layer_norm", &rows_layer_norm, "LayerNorm over the last dim (the native step's)", release());
  module.def("rows_rms_norm", &rows_rms_norm, "RMSNorm over the last dim (model.layers.RMSNorm; offset: by 1 + weight)",
             pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("offset") = false, release());
  module.def("rows_head_rms_norm_", &rows_head_rms_norm_,
             "x (B, H, t, Dh) RMS-normalized in place over each head's Dh features (q/k norms; offset: by 1 + weight)",
             release());
  module.def("rows_activate_", &rows_activate_, "an Activation in place", release());
  module.def("rows_add_", &rows_add_, "y += x in place", release());
  module.def("rows_mul_", &rows_mul_, "y *= x in place", release());
  module.def("rows_rotate_", &rows_rotate_,
             "x (B, H, t, Dh) rotated in place by cos/sin (B|1, t, R) on its first R features (model.rope.apply_rotary), "
             "then times scale", pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
             pybind11::arg("scale") = 1.0, release());
  module.def("rows_rotate_rounded_", &rows_rotate_rounded_,
             "rows_rotate_ with each product rounded before its sum: model.rope.apply_rotary's bits, in place", release());
  module.def("rows_cache_write", &rows_cache_write, "cache[:, :, position:position + t] = src (B, H, t, Dh)", release());
  module.def("rows_copy_windows", &rows_copy_windows,
             "buffers[targets[j], :, start:end] = buffers[sources[j], :, start:end] in every (B, H, C, Dh) buffer; "
             "False: not copied", release());
  module.def("lora_delta_add_", &lora_delta_add_, "y += ((x A^T) * scales) B^T in place (LoRA deltas)", release());

  // The native step's contract (kernels.h), by name: model/fast_step.py reads the values from here.
  using pybind11::arg;
  module.attr("MAX_STEP_TOKENS") = kMaxStepTokens;
  module.attr("MAX_ENCODE_TOKENS") = kMaxEncodeTokens;
  module.attr("PREFILL_HEAD_DIM_MULTIPLE") = kPrefillHeadDimMultiple;
  module.attr("PREFILL_MAX_KEYS") = kPrefillMaxKeys;
  pybind11::enum_<Activation>(module, "Activation", "FeedForward's activations, by their config names")
      .value("relu", kRelu)
      .value("gelu", kGelu)
      .value("gelu_tanh", kGeluTanh)
      .value("silu", kSilu);
  pybind11::enum_<Slot>(module, "Slot", "a decoder layer's projections, in the order DecoderStack takes them")
      .value("q", kQ)
      .value("k", kK)
      .value("v", kV)
      .value("out", kOut)
      .value("cross_q", kCrossQ)
      .value("cross_out", kCrossOut)
      .value("fc1", kFc1)
      .value("fc2", kFc2)
      .value("qkv", kQkv)
      .value("up", kUp);
  pybind11::enum_<Norm>(module, "Norm", "a decoder layer's norms (TransformerLayer's attribute names), in order")
      .value("self_attn_norm", kSelfAttnNorm)
      .value("cross_attn_norm", kCrossAttnNorm)
      .value("ffn_norm", kFfnNorm)
      .value("self_attn_post_norm", kSelfAttnPostNorm)
      .value("ffn_post_norm", kFfnPostNorm)
      .value("q_norm", kQNorm)
      .value("k_norm", kKNorm);
  pybind11::class_<PanelTuning>(module, "PanelTuning", "model.cpu.PanelTuning's fields, for the kernel")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, bool, int64_t, int64_t, bool>(), arg("row_block_bytes"),
           arg("prefetch_rows"), arg("streaming_tile_rows"), arg("streaming_prefetch_rows"), arg("streaming_into_l2"),
           arg("gemv_panels"), arg("vector_bits"), arg("gemv_prefetch"))
      .def_readonly("row_block_bytes", &PanelTuning::row_block_bytes)
      .def_readonly("prefetch_rows", &PanelTuning::prefetch_rows)
      .def_readonly("streaming_tile_rows", &PanelTuning::streaming_tile_rows)
      .def_readonly("streaming_prefetch_rows", &PanelTuning::streaming_prefetch_rows)
      .def_readonly("streaming_into_l2", &PanelTuning::streaming_into_l2)
      .def_readonly("gemv_panels", &PanelTuning::gemv_panels)
      .def_readonly("vector_bits", &PanelTuning::vector_bits)
      .def_readonly("gemv_prefetch", &PanelTuning::gemv_prefetch);
  pybind11::class_<StepCache>(module, "StepCache", "one step's KV cache and masks, as DecoderStack.step reads them")
      .def(pybind11::init<Tensors, Tensors, Tensors, Tensors, int64_t, int64_t, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, Tensors,
                          c10::optional<torch::Tensor>, Tensors, Tensors, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>(),
           arg("keys"), arg("values"), arg("cross_keys"), arg("cross_values"), arg("start"), arg("visible"),
           arg("write_positions"), arg("self_mask"), arg("memory_mask"), arg("group"), arg("prefix_blocks") = Tensors{},
           arg("prefix_table") = c10::nullopt, arg("rotary_cos") = Tensors{}, arg("rotary_sin") = Tensors{},
           arg("window_mask") = c10::nullopt, arg("beam_lead") = c10::nullopt, arg("beam_shared") = c10::nullopt,
           arg("cross_lead") = c10::nullopt);
  pybind11::class_<DecoderStack>(module, "DecoderStack", "a decoder stack's weights bound for the native step")
      .def(pybind11::init<std::vector<Tensors>, std::vector<Tensors>, std::vector<double>, int64_t, bool, Activation,
                          int64_t, int64_t, std::vector<int64_t>, std::vector<bool>, bool, double>(),
           arg("projections"), arg("norms"), arg("eps"), arg("heads"), arg("pre_norm"), arg("activation"),
           arg("kv_heads") = 0, arg("head_dim") = 0, arg("rotary") = std::vector<int64_t>{},
           arg("windowed") = std::vector<bool>{}, arg("norm_offset") = false, arg("query_scale") = 1.0)
      .def("step", &DecoderStack::step, "one decoding step through every decoder layer (model/fast_step.py)",
           arg("x"), arg("cache"), arg("deltas"), arg("panels"), release())
      .def("encode", &DecoderStack::encode, "an encoder's forward over short rows, no cache (model/fast_step.py)",
           arg("x"), arg("mask"), arg("panels"), arg("keep_first"), arg("attention"), release());
}
