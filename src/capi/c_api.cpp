// The C ABI: converts plain structs into the C++ API's types, catches every exception at the
// boundary and keeps its message for epmoe_last_error().
#include "epmoe/c_api.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "capi/c_api_internal.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/memory_plan.h"
#include "epmoe/transport.h"
#include "epmoe/prepared_weights.h"

namespace epmoe::capi {

namespace {
thread_local std::string g_last_error;
}  // namespace

void set_last_error(std::string message) { g_last_error = std::move(message); }

Config to_config(const epmoe_config& c) {
  ConfigFields f;
  f.max_tokens_per_rank = c.max_tokens_per_rank;
  f.hidden_dim = c.hidden_dim;
  f.intermediate_dim = c.intermediate_dim;
  f.top_k = c.top_k;
  f.num_experts = c.num_experts;
  f.activation = c.activation == 1 ? Activation::swiglu_clamped(c.alpha, c.limit)
                                   : Activation::swiglu();
  f.capacity_factor = c.capacity_factor;
  f.slots.num_slots = c.num_slots;
  f.slots.max_layers_per_slot = c.layers_per_slot;
  f.fuse_epilogues = c.fuse_epilogues != 0;
  f.check_inputs = c.check_inputs != 0;
  f.wgrad_dtype = c.wgrad_f32 ? DType::f32 : DType::bf16;
  f.barrier_timeout_ms = c.barrier_timeout_ms;
  f.arrival_gated_w13 = c.arrival_gated_w13 != 0;
  if (c.scratch_device_bytes != -1) f.scratch_device_bytes = c.scratch_device_bytes;
  // Negative: unset. NaN is passed on, so that Config names it.
  if (!(c.slot_capacity_factor < 0.0)) f.slots.slot_capacity_factor = c.slot_capacity_factor;
  if (c.slot_bytes >= 0) f.slots.slot_bytes = c.slot_bytes;
  EPMOE_CHECK_ARG(c.precision >= 0 && c.precision <= 3, "epmoe_config.precision",
                  "0 (bf16), 1 (fp8_block), 2 (mxfp8) or 3 (nvfp4)", c.precision);
  f.precision = c.precision == 1   ? Precision::fp8_block
                : c.precision == 2 ? Precision::mxfp8
                : c.precision == 3 ? Precision::nvfp4
                                   : Precision::bf16;
  f.inference = c.inference != 0;
  f.prepared_weights = c.prepared_weights != 0;
  f.combine = static_cast<CombineMode>(c.combine);  // Config validates the value
  f.fp8_wgrad = static_cast<Fp8Wgrad>(c.fp8_wgrad);  // Config validates the value
  return Config(f);
}

}  // namespace epmoe::capi

namespace {

using epmoe::capi::guarded;
using epmoe::capi::to_config;

epmoe::TensorRef ref(const void* p, epmoe::DType dtype, std::initializer_list<int64_t> shape,
                     const epmoe::Device& device) {
  return epmoe::TensorRef::contiguous(const_cast<void*>(p), dtype, shape, device);
}

// fp8_block_fp32 prepared-weight views of caller memory (the transposed copy when qt or
// scales_t is given).
epmoe::PreparedWeights prepared_fp8(const void* q, const float* scales, int64_t G, int64_t N,
                                    int64_t L, const epmoe::Device& device,
                                    const void* qt = nullptr, const float* scales_t = nullptr) {
  const epmoe::PreparedWeightShapes sh =
      epmoe::prepared_weight_shapes(epmoe::WeightFormat::fp8_block_fp32, G, N, L);
  epmoe::PreparedWeights p{epmoe::WeightFormat::fp8_block_fp32, G, N, L, sh.data, sh.scales,
                           {}, {}, {}};
  p.data.data = const_cast<void*>(q);
  p.scales.data = const_cast<float*>(scales);
  p.data.device = p.scales.device = device;
  if (qt != nullptr || scales_t != nullptr) {
    p.data_t = sh.data_t;
    p.scales_t = sh.scales_t;
    p.data_t.data = const_cast<void*>(qt);
    p.scales_t.data = const_cast<float*>(scales_t);
    p.data_t.device = p.scales_t.device = device;
  }
  return p;
}

// nvfp4 prepared-weight views of caller memory.
epmoe::PreparedWeights prepared_nvfp4(const void* q, const void* scales, const float* global,
                                      int64_t G, int64_t N, int64_t L,
                                      const epmoe::Device& device) {
  const epmoe::PreparedWeightShapes sh =
      epmoe::prepared_weight_shapes(epmoe::WeightFormat::nvfp4, G, N, L);
  epmoe::PreparedWeights p{epmoe::WeightFormat::nvfp4, G, N, L, sh.data, sh.scales,
                           sh.global_scale, {}, {}};
  p.data.data = const_cast<void*>(q);
  p.scales.data = const_cast<void*>(scales);
  p.global_scale.data = const_cast<float*>(global);
  p.data.device = p.scales.device = p.global_scale.device = device;
  return p;
}

// mxfp8 prepared-weight views of caller memory.
epmoe::PreparedWeights prepared_mxfp8(const void* q, const void* scales, int64_t G, int64_t N,
                                      int64_t L, const epmoe::Device& device) {
  const epmoe::PreparedWeightShapes sh =
      epmoe::prepared_weight_shapes(epmoe::WeightFormat::mxfp8, G, N, L);
  epmoe::PreparedWeights p{epmoe::WeightFormat::mxfp8, G, N, L, sh.data, sh.scales, {}, {}, {}};
  p.data.data = const_cast<void*>(q);
  p.scales.data = const_cast<void*>(scales);
  p.data.device = p.scales.device = device;
  return p;
}

}  // namespace

extern "C" {

epmoe_config epmoe_config_default(int64_t T, int64_t D, int64_t F, int32_t K, int32_t num_experts) {
  const epmoe::ConfigFields d;
  epmoe_config c{};
  c.max_tokens_per_rank = T;
  c.hidden_dim = D;
  c.intermediate_dim = F;
  c.top_k = K;
  c.num_experts = num_experts;
  c.activation = 0;
  c.alpha = d.activation.alpha;
  c.limit = d.activation.limit;
  c.capacity_factor = d.capacity_factor;
  c.num_slots = d.slots.num_slots;
  c.layers_per_slot = d.slots.max_layers_per_slot;
  c.fuse_epilogues = d.fuse_epilogues ? 1 : 0;
  c.check_inputs = d.check_inputs ? 1 : 0;
  c.wgrad_f32 = 0;
  c.barrier_timeout_ms = d.barrier_timeout_ms;
  c.arrival_gated_w13 = d.arrival_gated_w13 ? 1 : 0;
  c.scratch_device_bytes = -1;
  c.slot_capacity_factor = -1.0;
  c.slot_bytes = -1;
  c.precision = 0;
  c.inference = d.inference ? 1 : 0;
  c.prepared_weights = d.prepared_weights ? 1 : 0;
  c.combine = static_cast<int32_t>(d.combine);
  c.fp8_wgrad = static_cast<int32_t>(d.fp8_wgrad);
  return c;
}

const char* epmoe_last_error(void) { return epmoe::capi::g_last_error.c_str(); }

int epmoe_prepare_weights_fp8(const void* w_GNL, int64_t G, int64_t N, int64_t L, void* q_GNL,
                              float* scales_GBS, void* qt_GLN, float* scales_t_GSB, int device,
                              void* stream) {
  return guarded([&] {
    const epmoe::Device dev = epmoe::Device::cuda(device);
    epmoe::prepare_weights(
        ref(w_GNL, epmoe::DType::bf16, {G, N, L}, dev),
        prepared_fp8(q_GNL, scales_GBS, G, N, L, dev, qt_GLN, scales_t_GSB), stream);
  });
}

int epmoe_prepare_weights_nvfp4(const void* w_GNL, int64_t G, int64_t N, int64_t L, void* q_GNP,
                                void* scales_GCN8, float* global_G, int device, void* stream) {
  return guarded([&] {
    const epmoe::Device dev = epmoe::Device::cuda(device);
    epmoe::prepare_weights(ref(w_GNL, epmoe::DType::bf16, {G, N, L}, dev),
                           prepared_nvfp4(q_GNP, scales_GCN8, global_G, G, N, L, dev), stream);
  });
}

int epmoe_prepare_weights_mxfp8(const void* w_GNL, int64_t G, int64_t N, int64_t L, void* q_GNL,
                                void* scales_GNS, int device, void* stream) {
  return guarded([&] {
    const epmoe::Device dev = epmoe::Device::cuda(device);
    epmoe::prepare_weights(ref(w_GNL, epmoe::DType::bf16, {G, N, L}, dev),
                           prepared_mxfp8(q_GNL, scales_GNS, G, N, L, dev), stream);
  });
}

int epmoe_cuda_device_count(void) { return epmoe::cuda_device_count(); }

int epmoe_context_create_single_gpu(const epmoe_config* config, int device, epmoe_context** out) {
  return guarded([&] {
    auto h = std::make_unique<epmoe_context>();
    h->ctx = epmoe::Context::create(to_config(*config), epmoe::make_single_gpu_transport(device));
    h->device = epmoe::Device::cuda(device);
    *out = h.release();
  });
}

int epmoe_context_create_cpu(const epmoe_config* config, epmoe_context** out) {
  return guarded([&] {
    EPMOE_CHECK_ARG(config != nullptr, "config", "an epmoe_config", "nullptr");
    epmoe::ThreadTransportGroup group(1);  // its transport keeps the shared state alive
    auto h = std::make_unique<epmoe_context>();
    h->ctx = epmoe::Context::create(to_config(*config), group.transport(0));
    h->device = epmoe::Device::cpu();
    *out = h.release();
  });
}

void epmoe_context_destroy(epmoe_context* ctx) {
  guarded([&] { delete ctx; });
}

int epmoe_forward(epmoe_context* h, const epmoe_forward_args* a, epmoe_saved* saved) {
  return guarded([&] {
    const epmoe::Config& c = h->ctx->config();
    const int64_t T = a->tokens, K = c.K();
    const int E = c.local_experts(h->ctx->ep_size());
    epmoe::ForwardArgs f;
    f.x_TD = ref(a->x_TD, epmoe::DType::bf16, {T, c.D()}, h->device);
    if (a->num_tokens_1) f.num_tokens_1 = ref(a->num_tokens_1, epmoe::DType::i32, {1}, h->device);
    f.topk_ids_TK = ref(a->topk_ids_TK, a->ids_int64 ? epmoe::DType::i64 : epmoe::DType::i32, {T, K}, h->device);
    f.topk_scores_TK = ref(a->topk_scores_TK, a->scores_bf16 ? epmoe::DType::bf16 : epmoe::DType::f32, {T, K}, h->device);
    f.w13_EFD = ref(a->w13_EFD, epmoe::DType::bf16, {E, 2 * c.F(), c.D()}, h->device);
    f.w2_EDF = ref(a->w2_EDF, epmoe::DType::bf16, {E, c.D(), c.F()}, h->device);
    f.y_TD = ref(a->y_TD, epmoe::DType::bf16, {T, c.D()}, h->device);
    f.save_for_backward = a->save_for_backward != 0;
    f.slot = a->slot;
    f.stream = a->stream;
    epmoe::PreparedWeights w13, w2;
    if (c.fields().precision == epmoe::Precision::nvfp4) {
      w13 = prepared_nvfp4(a->w13_q, a->w13_block_scales, a->w13_global, E, 2 * c.F(), c.D(),
                           h->device);
      w2 = prepared_nvfp4(a->w2_q, a->w2_block_scales, a->w2_global, E, c.D(), c.F(), h->device);
      f.w13_prepared = &w13;
      f.w2_prepared = &w2;
    } else if (c.fields().precision == epmoe::Precision::mxfp8) {
      w13 = prepared_mxfp8(a->w13_q, a->w13_block_scales, E, 2 * c.F(), c.D(), h->device);
      w2 = prepared_mxfp8(a->w2_q, a->w2_block_scales, E, c.D(), c.F(), h->device);
      f.w13_prepared = &w13;
      f.w2_prepared = &w2;
    } else if (c.fields().prepared_weights) {
      w13 = prepared_fp8(a->w13_q, a->w13_scales, E, 2 * c.F(), c.D(), h->device);
      w2 = prepared_fp8(a->w2_q, a->w2_scales, E, c.D(), c.F(), h->device);
      f.w13_prepared = &w13;
      f.w2_prepared = &w2;
    }
    const epmoe::SavedLayer s = h->ctx->forward(f);
    if (saved) *saved = epmoe_saved{s.slot, s.layer, s.step, s.tokens};
  });
}

int epmoe_backward(epmoe_context* h, const epmoe_backward_args* a) {
  return guarded([&] {
    const epmoe::Config& c = h->ctx->config();
    const int64_t T = a->saved.tokens, K = c.K();
    const int E = c.local_experts(h->ctx->ep_size());
    const epmoe::DType wg = c.fields().wgrad_dtype;
    epmoe::BackwardArgs b;
    b.saved = epmoe::SavedLayer{a->saved.slot, a->saved.layer, a->saved.step, a->saved.tokens};
    b.grad_y_TD = ref(a->grad_y_TD, epmoe::DType::bf16, {T, c.D()}, h->device);
    if (a->num_tokens_1) b.num_tokens_1 = ref(a->num_tokens_1, epmoe::DType::i32, {1}, h->device);
    b.topk_ids_TK = ref(a->topk_ids_TK, a->ids_int64 ? epmoe::DType::i64 : epmoe::DType::i32, {T, K}, h->device);
    b.topk_scores_TK = ref(a->topk_scores_TK, a->scores_bf16 ? epmoe::DType::bf16 : epmoe::DType::f32, {T, K}, h->device);
    b.w13_EFD = ref(a->w13_EFD, epmoe::DType::bf16, {E, 2 * c.F(), c.D()}, h->device);
    b.w2_EDF = ref(a->w2_EDF, epmoe::DType::bf16, {E, c.D(), c.F()}, h->device);
    b.grad_x_TD = ref(a->grad_x_TD, epmoe::DType::bf16, {T, c.D()}, h->device);
    b.grad_scores_TK = ref(a->grad_scores_TK, epmoe::DType::f32, {T, K}, h->device);
    b.grad_w13_EFD = ref(a->grad_w13_EFD, wg, {E, 2 * c.F(), c.D()}, h->device);
    b.grad_w2_EDF = ref(a->grad_w2_EDF, wg, {E, c.D(), c.F()}, h->device);
    b.accumulate_wgrad = a->accumulate_wgrad != 0;
    b.stream = a->stream;
    epmoe::PreparedWeights w13, w2;
    if (c.fields().prepared_weights) {
      w13 = prepared_fp8(a->w13_q, a->w13_scales, E, 2 * c.F(), c.D(), h->device, a->w13_qt,
                         a->w13_scales_t);
      w2 = prepared_fp8(a->w2_q, a->w2_scales, E, c.D(), c.F(), h->device, a->w2_qt,
                        a->w2_scales_t);
      b.w13_prepared = &w13;
      b.w2_prepared = &w2;
    }
    h->ctx->backward(b);
  });
}

int epmoe_check(epmoe_context* h) {
  return guarded([&] { h->ctx->check(); });
}

int epmoe_set_stage_timing(epmoe_context* h, int on) {
  return guarded([&] { h->ctx->set_stage_timing(on != 0); });
}

int epmoe_stage_times(epmoe_context* h, const char** names, double* ms, int capacity, int* count) {
  return guarded([&] {
    const auto& times = h->ctx->stage_times();
    const int n = static_cast<int>(times.size());
    *count = n;
    for (int i = 0; i < n && i < capacity; ++i) {
      names[i] = times[i].stage;
      ms[i] = times[i].ms;
    }
  });
}

int epmoe_explain_plan(const epmoe_config* config, int ep_size, char* buf, size_t len) {
  return guarded([&] {
    const std::string s = epmoe::plan_memory(to_config(*config), ep_size).explain();
    if (len == 0) return;
    const size_t n = s.size() < len - 1 ? s.size() : len - 1;
    std::memcpy(buf, s.data(), n);
    buf[n] = '\0';
  });
}

int epmoe_explain_kernels(const epmoe_config* config, int ep_size, char* buf, size_t len) {
  return guarded([&] {
    EPMOE_CHECK_ARG(config != nullptr, "config", "an epmoe_config", "nullptr");
    const std::string s = epmoe::explain_cuda_kernels(to_config(*config), ep_size);
    if (len == 0) return;
    EPMOE_CHECK_ARG(buf != nullptr, "buf", "a buffer of len bytes", "nullptr");
    const size_t n = s.size() < len - 1 ? s.size() : len - 1;
    std::memcpy(buf, s.data(), n);
    buf[n] = '\0';
  });
}

int epmoe_resolved_fp8_wgrad(const epmoe_config* config, int ep_size, int32_t* out) {
  return guarded([&] {
    EPMOE_CHECK_ARG(config != nullptr, "config", "an epmoe_config", "nullptr");
    EPMOE_CHECK_ARG(out != nullptr, "out", "an int32_t to write", "nullptr");
    *out = static_cast<int32_t>(epmoe::plan_memory(to_config(*config), ep_size).fp8_wgrad);
  });
}

int epmoe_plan_slots(const epmoe_config* config, int ep_size, epmoe_slot_plan* out) {
  return guarded([&] {
    EPMOE_CHECK_ARG(config != nullptr, "config", "an epmoe_config", "nullptr");
    EPMOE_CHECK_ARG(out != nullptr, "out", "an epmoe_slot_plan", "nullptr");
    const epmoe::MemoryPlan p = epmoe::plan_memory(to_config(*config), ep_size);
    *out = epmoe_slot_plan{p.minimum_slot_bytes, p.balanced_full_save_slot_bytes,
                           p.maximum_useful_slot_bytes, p.slot_bytes, p.activation_bytes,
                           p.scratch_bytes, p.arena_bytes, p.total_bytes, p.device_total_bytes};
  });
}

int epmoe_context_memory_held(const epmoe_context* h, epmoe_context_memory* out) {
  return guarded([&] {
    EPMOE_CHECK_ARG(out != nullptr, "out", "an epmoe_context_memory", "nullptr");
    const epmoe::ArenaMemory a = h->ctx->arena_memory();
    const epmoe::MemoryPlan& p = h->ctx->plan();
    *out = epmoe_context_memory{a.device_bytes, a.host_bytes, a.device_held_bytes,
                                a.host_held_bytes, p.total_bytes - p.arena_bytes};
  });
}

int epmoe_recomputes(epmoe_context* h, const epmoe_saved* saved, int32_t* recompute) {
  return guarded([&] {
    EPMOE_CHECK_ARG(saved != nullptr, "saved", "an epmoe_saved", "nullptr");
    EPMOE_CHECK_ARG(recompute != nullptr, "recompute", "an int32_t to write", "nullptr");
    const epmoe::SavedLayer s{saved->slot, saved->layer, saved->step, saved->tokens};
    *recompute = h->ctx->recomputes(s) ? 1 : 0;
  });
}

int epmoe_slot_peak_bytes(epmoe_context* h, int slot, int64_t* bytes) {
  return guarded([&] {
    EPMOE_CHECK_ARG(bytes != nullptr, "bytes", "an int64_t to write", "nullptr");
    *bytes = h->ctx->slot_peak_bytes(slot);
  });
}

}  // extern "C"
