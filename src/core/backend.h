// Backend: the stages of DESIGN.md §3 behind one interface, implemented by the CPU reference
// (src/cpu) and by CUDA (src/cuda). The Context runs the same sequence on either; each stage reads
// its row counts from the layout (never from the host on CUDA) and does nothing when
// layout.header[kLayoutSkip] is set (or, for replayed stages, when the layer saved everything).
#pragma once

#include <cstddef>
#include <memory>

#include "core/step.h"
#include "epmoe/config.h"
#include "epmoe/tensor.h"

namespace epmoe {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual const char* name() const = 0;
  // Backend-specific limits of a config (e.g. 16-byte rows on CUDA); throws Error naming the field.
  virtual void validate(const Config& /*config*/, int /*ep_size*/) const {}

  // True when the stages take the saved buffers from the layer plans (Step::layer_plan) at run
  // time; false: the Context places every layer's full save at capacity rows itself.
  virtual bool places_saved_state() const = 0;

  // ---- memory of the compute device ----
  virtual void* allocate(std::size_t bytes) = 0;  // zero-filled
  virtual void release(void* ptr) = 0;
  // The arena with host-backed scratch (Config.scratch_device_bytes): one zero-filled range of
  // device_bytes of device memory followed by host_bytes of pinned host memory, the host part
  // starting exactly at ptr + device_bytes. *_held: physical bytes held for each part (CUDA:
  // rounded up to the VMM allocation granularity). Freed with release_host_backed(ptr).
  struct HostBacked {
    void* ptr = nullptr;
    std::size_t device_held_bytes = 0;
    std::size_t host_held_bytes = 0;
  };
  virtual HostBacked allocate_host_backed(std::size_t device_bytes, std::size_t host_bytes) = 0;
  virtual void release_host_backed(void* ptr) = 0;
  virtual void copy_to_device(void* dst, const void* src, std::size_t bytes) = 0;  // blocking
  virtual void copy_to_host(void* dst, const void* src, std::size_t bytes) = 0;    // blocking
  // Waits for the work of `stream`; nullptr: for all work of the device.
  virtual void synchronize(void* stream) = 0;

  // ---- forward ----
  // Own ids (int32; -1 for inactive routes and rows past the live count), scores (f32), header
  // (tokens, live, input-check result) into routing_R[rank]; x into dispatch_R[rank].
  virtual void publish_forward(const Step& s) = 0;
  // After the publish barrier: the layout from every rank's ids (core/layout.h), the step's
  // skip flag and the status word (input errors of any rank, capacity overflow of any rank).
  virtual void route(const Step& s) = 0;
  // save_for_backward, after route: the forward planner (core/slot_plan.h, one CTA on CUDA)
  // decides save-everything or input-only from every rank's received rows, advances the slot and
  // writes this layer's LayerPlan.
  virtual void plan_forward(const Step& s) = 0;
  // Input-only layers: the live rows of x into the slot at layer_plan->x_offset (else nothing).
  virtual void save_input(const Step& s) = 0;
  // x_gathered[m] = dispatch_R[src rank][t] for every received row m.
  virtual void dispatch(const Step& s) = 0;
  // h13 = x_gathered @ w13[e]^T per expert (unfused).
  virtual void w13_gemm(const Step& s) = 0;
  // h = act(h13) (unfused).
  virtual void swiglu_forward(const Step& s) = 0;
  // Fused: h13 and h from one GEMM (h is computed from the bf16-rounded h13, as unfused).
  virtual void w13_swiglu(const Step& s) = 0;
  // rows_MD = h @ w2[e]^T (unfused).
  virtual void w2_gemm(const Step& s) = 0;
  // combine_R[src rank][t*K + k] = rows_MD[m] (unfused scatter; also the W13-DGRAD scatter).
  virtual void scatter_rows(const Step& s) = 0;
  // Fused: W2 GEMM whose epilogue stores each row into its owner's combine slot.
  virtual void w2_scatter(const Step& s) = 0;
  // Per-rank combine (Step::combine_per_rank), after w2_gemm: for every pull (s, t), the routes'
  // rows_MD summed in ascending k as fp32 sum of score[t,k] * row, rounded to bf16 once, into
  // combine_R[s][t * R + rank] (one row per (token, rank) crosses to the owner).
  virtual void combine_send_forward(const Step& s) = 0;
  // Per-rank combine, after w13_dgrad: the same send of rows_MD, unscaled (the score is in
  // grad_h3 already).
  virtual void combine_send_backward(const Step& s) = 0;
  // After the combine barrier: y[t] = sum_k score[t,k] * combine[t,k] (fp32, one rounding);
  // rows past the live count are zero; h3_TKD (if set) = copy of this rank's combine slots.
  // Per-rank combine: y[t] = sum over the ranks q holding >= 1 of t's routes, ascending q, of
  // combine[t, q] (fp32, one rounding).
  virtual void reduce_forward(const Step& s) = 0;

  // ---- backward ----
  // Backward planner: the layer leaves its slot (LIFO). Its LayerPlan stays readable.
  virtual void plan_backward(const Step& s) = 0;
  // Replay (layer_plan->replay_skip == 0): the saved x back into dispatch_R[rank], so that the
  // replayed dispatch and W13 stages (Step::replay) rebuild x_gathered and h13; the
  // dispatch arrival counters back to zero (the replay does not rerun route, which zeroes them).
  virtual void restore_input(const Step& s) = 0;
  // grad_y into dispatch_R[rank]; scores (f32) and ids into routing_R[rank] (as forward).
  virtual void publish_backward(const Step& s) = 0;
  // With row scores (Step::row_scores_M; the Context's backward), after the W2 DGRAD: for every
  // received row, grad_scores = the sum of its score_parts_MC in ascending chunk order, stored
  // into the owner's routing buffer in place of the route's score. Without (layered API):
  // grad_scores[t,k] = <grad_y[t], h3[t,k]> in fp32 (0 for inactive routes and padding rows).
  virtual void grad_scores(const Step& s) = 0;
  // After the publish barrier: grad_h3[m] = grad_y[t] pulled from the owner, and row_scores_M[m]
  // = score[t,k] (with row scores), else grad_h3[m] = bf16(score[t,k] * grad_y[t]).
  virtual void gather_grad(const Step& s) = 0;
  // grad_h = grad_h3 @ w2[e] (unfused).
  virtual void w2_dgrad(const Step& s) = 0;
  // grad_h13 = act'(h13) * grad_h; h = act(h13) for the W2 weight gradient (unfused). With row
  // scores grad_h is the unscaled dh: act'(h13) * (score * dh), h = bf16(score * act(h13)), and
  // score_parts_MC = <dh, bf16(act(h13))> per 64-column chunk (core/plan_terms.h).
  virtual void swiglu_backward(const Step& s) = 0;
  // Fused W2 DGRAD with SwiGLU backward in its epilogue (grad_h rounded to bf16 first, as unfused).
  virtual void w2_dgrad_swiglu(const Step& s) = 0;
  // grad_w2[e] (+)= grad_h3[e]^T @ h[e]; experts with no rows get zero (or keep, accumulating).
  virtual void w2_wgrad(const Step& s) = 0;
  // rows_MD = grad_h13 @ w13[e] (unfused; scatter_rows sends the rows home).
  virtual void w13_dgrad(const Step& s) = 0;
  // Fused W13 DGRAD whose epilogue stores each row into its owner's combine slot.
  virtual void w13_dgrad_scatter(const Step& s) = 0;
  // grad_w13[e] (+)= grad_h13[e]^T @ x_gathered[e].
  virtual void w13_wgrad(const Step& s) = 0;
  // After the combine barrier: grad_x[t] = sum over active k of combine[t,k] (fp32, one rounding).
  // Per-rank combine: grad_x[t] = the sum of t's ranks' partials (ascending rank). With row
  // scores, or per-rank, grad_scores = the expert ranks' results (0 for inactive routes and
  // padding rows).
  virtual void reduce_backward(const Step& s) = 0;
};

// Factories; make_cuda_backend throws Error(backend) when epmoe was built without CUDA.
std::unique_ptr<Backend> make_cpu_backend();
std::unique_ptr<Backend> make_cuda_backend(int device_ordinal);

}  // namespace epmoe
