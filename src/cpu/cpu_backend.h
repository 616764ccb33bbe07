// CPU reference backend: every stage of core/backend.h as plain loops on the calling thread.
// The CUDA backend mirrors these numerics (see gemm_reference.h for the accumulation rules).
#pragma once

#include <cstdint>
#include <vector>

#include "core/backend.h"
#include "core/layout.h"
#include "core/step.h"

namespace epmoe::cpu {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::cpu(); }
  const char* name() const override { return "cpu"; }
  bool places_saved_state() const override { return true; }

  void* allocate(std::size_t bytes) override;
  void release(void* ptr) override;
  // Host memory for both parts (the CPU's 'device' memory is host memory): one allocation of the
  // same total, reporting the requested split.
  HostBacked allocate_host_backed(std::size_t device_bytes, std::size_t host_bytes) override;
  void release_host_backed(void* ptr) override;
  void copy_to_device(void* dst, const void* src, std::size_t bytes) override;
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override;
  void synchronize(void* stream) override;

  void publish_forward(const Step& s) override;
  void route(const Step& s) override;
  void plan_forward(const Step& s) override;
  void save_input(const Step& s) override;
  void dispatch(const Step& s) override;
  void w13_gemm(const Step& s) override;
  void swiglu_forward(const Step& s) override;
  void w13_swiglu(const Step& s) override;
  void w2_gemm(const Step& s) override;
  void scatter_rows(const Step& s) override;
  void w2_scatter(const Step& s) override;
  void combine_send_forward(const Step& s) override;
  void combine_send_backward(const Step& s) override;
  void reduce_forward(const Step& s) override;

  void plan_backward(const Step& s) override;
  void restore_input(const Step& s) override;
  void publish_backward(const Step& s) override;
  void grad_scores(const Step& s) override;
  void gather_grad(const Step& s) override;
  void w2_dgrad(const Step& s) override;
  void swiglu_backward(const Step& s) override;
  void w2_dgrad_swiglu(const Step& s) override;
  void w2_wgrad(const Step& s) override;
  void w13_dgrad(const Step& s) override;
  void w13_dgrad_scatter(const Step& s) override;
  void w13_wgrad(const Step& s) override;
  void reduce_backward(const Step& s) override;
};

// ---- helpers shared by the stage files ----

// One rank's routing buffer: header, ids [T, K] i32, scores [T, K] f32 (T = Config T).
struct RoutingView {
  RoutingHeader* header;
  int32_t* ids_TK;
  float* scores_TK;
};
inline RoutingView routing_view(const Step& s, int rank) {
  const RoutingBufferLayout l = routing_buffer_layout(s.dims.T, s.dims.K);
  char* base = s.routing_R[rank];
  return {reinterpret_cast<RoutingHeader*>(base), reinterpret_cast<int32_t*>(base + l.ids_offset),
          reinterpret_cast<float*>(base + l.scores_offset)};
}

inline bool skipped(const Step& s) {
  return s.layout.header[kLayoutSkip] != 0 || (s.replay && s.layer_plan->replay_skip != 0);
}
// The step with x_gathered, h13 and h3 where the planner put them (read at run time, as the CUDA
// kernels read them from device memory); unchanged without a layer plan.
inline Step placed(const Step& s) {
  if (s.layer_plan == nullptr) return s;
  Step r = s;
  const LayerPlan& p = *s.layer_plan;
  r.x_gathered_MD = reinterpret_cast<bf16_t*>(s.arena + p.x_gathered_offset);
  r.h13_M2F = reinterpret_cast<bf16_t*>(s.arena + p.h13_offset);
  bf16_t* h3 = p.h3_offset >= 0 ? reinterpret_cast<bf16_t*>(s.arena + p.h3_offset) : nullptr;
  if (s.combine_per_rank) {
    r.h3_MD = h3;  // [rows, D]: the slot, or the call scratch's rows_MD for a replayed layer
  } else {
    r.h3_TKD = h3;
  }
  return r;
}
inline int64_t received_rows(const Step& s) { return s.layout.header[kLayoutRows]; }
inline int64_t live_rows(const Step& s) { return s.layout.header[kLayoutLive]; }

// Pulls of this rank's layout (core/layout.h), clamped to the arrays.
inline int64_t pull_count(const Step& s) {
  const int64_t p = s.layout.header[kLayoutPulls];
  const int64_t cap = pull_capacity(s.capacity_rows, s.dims.T, s.dims.R);
  return p < cap ? p : cap;
}

// Where received row m came from, and the owner's combine slot it returns to.
struct RowSource {
  int rank;
  int64_t token;
  int64_t slot;  // t*K + k
};
inline RowSource row_source(const Step& s, int64_t m) {
  const int32_t src = s.layout.recv_src_M[m];
  const int64_t slot = src_slot(src, s.dims.T, s.dims.K);
  return {src_rank(src, s.dims.T, s.dims.K), slot / s.dims.K, slot};
}
inline bf16_t* combine_slot(const Step& s, const RowSource& src) {
  return s.combine_R[src.rank] + src.slot * s.dims.D;
}

// Rows [first, last) of local expert e.
inline int64_t expert_first_row(const Step& s, int e) { return s.layout.expert_offsets_E1[e]; }
inline int64_t expert_last_row(const Step& s, int e) { return s.layout.expert_offsets_E1[e + 1]; }

inline const bf16_t* w13_of(const Step& s, int e) {
  return s.w13_EFD + e * 2 * s.dims.F * s.dims.D;
}
inline const bf16_t* w2_of(const Step& s, int e) { return s.w2_EDF + e * s.dims.D * s.dims.F; }

// Records an input error in this rank's header unless an earlier one is there.
void record_input_error(RoutingHeader& h, StatusCode code, StatusArg arg, int64_t value,
                        int64_t bound, int64_t index);
// Publishes this rank's ids (int32; -1 for inactive routes, out-of-range ids and every row past
// the live count up to Config T) and scores (f32; 0 past the live count) into its routing buffer.
// errors != nullptr: the first out-of-range id is recorded there.
void publish_routing(const Step& s, int64_t live, RoutingHeader* errors);

// ---- FP8 path (stages_fp8.cpp; the steps themselves are in fp8_steps.h) ----
// live rows of x (bf16) quantized into this rank's dispatch buffer (codes + row-major scales).
void fp8_publish_rows(const Step& s, const bf16_t* x_TD, int64_t live);
// Received rows: codes and scales pulled from the owners into x_gathered.
void fp8_dispatch(const Step& s);
// h13 = W13 FPROP of the received rows (bf16, rounded once).
void fp8_w13(const Step& s);
// h quantized along F for the W2 FPROP (from the bf16 h, after SwiGLU).
void fp8_quantize_h(const Step& s);
// W2 FPROP: into rows_MD or, with scatter, the owners' combine slots.
void fp8_w2(const Step& s, bool scatter);
// grad_h3 quantized along D for the W2 DGRAD (from the bf16 grad_h3).
void fp8_quantize_grad_h3(const Step& s);
// W2 DGRAD: grad_h_MF [rows, F] (bf16) for every received row.
void fp8_w2_dgrad(const Step& s, bf16_t* grad_h_MF);
// grad_h13 quantized along 2F for the W13 DGRAD (from the bf16 grad_h13).
void fp8_quantize_grad_h13(const Step& s);
// W13 DGRAD: into rows_MD or, with scatter, the owners' combine slots.
void fp8_w13_dgrad(const Step& s, bool scatter);
// Weight gradients from column-quantized operands: W2 (grad_h3, h) and W13 (grad_h13, x).
void fp8_w2_wgrad(const Step& s);
void fp8_w13_wgrad(const Step& s);
// Config.fp8_wgrad = bf16: the received E4M3 x rows decoded to bf16 (cpu::fp8_decode_rows_bf16)
// into the FP8 scratch's x_bf16 [capacity, D]; returns it (the bf16 W13 WGRAD's x operand).
const bf16_t* fp8_decode_x_bf16(const Step& s);

// ---- per-rank combine (stages_combine.cpp) ----
// Each pull's routes' rows_MD summed (score-weighted when scaled) into one row of its owner's
// [T, R, D] combine buffer at [t, this rank].
void send_partials(const Step& s, const bf16_t* rows_MD, bool scaled);
// out[t] = the sum of the partial rows of t's ranks, ascending rank (fp32, one rounding).
void reduce_partials(const Step& s, bf16_t* out_TD);
// The owner's grad_scores from its routing buffer (written by the expert ranks' grad_scores).
void copy_grad_scores(const Step& s);

// ---- NVFP4 weight-only inference (stages_nvfp4.cpp) ----
// Expert e's W13 [2F, D] / W2 [D, F] decoded from the NVFP4 prepared weights into fp32.
std::vector<float> nvfp4_w13_of(const Step& s, int e);
std::vector<float> nvfp4_w2_of(const Step& s, int e);

// ---- MXFP8 inference (stages_mxfp8.cpp; docs/formats.md "MXFP8 inference") ----
// Expert e's W13 [2F, D] / W2 [D, F] of the MXFP8 prepared weights: the E4M3 codes decoded
// without their scales (v_NL) and the E8M0 scale codes, one per 32 along L (scales_NS).
struct Mxfp8Expert {
  int64_t N = 0, L = 0;
  std::vector<float> v_NL;
  const uint8_t* scales_NS = nullptr;
};
Mxfp8Expert mxfp8_w13_of(const Step& s, int e);
Mxfp8Expert mxfp8_w2_of(const Step& s, int e);
// out_N[n] = the MXFP8 product of the bf16 row a_L, quantized 1x32 here, and row n of w.
void row_times_nt(const bf16_t* a_L, const Mxfp8Expert* w, int64_t N, int64_t L, float* out_N);

// Writes the status word unless an earlier error of this step is already there.
inline void report(const Step& s, const Status& st) {
  if (s.status->code == 0) *s.status = st;
}

}  // namespace epmoe::cpu
