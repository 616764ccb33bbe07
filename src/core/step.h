// Step: everything one stage of one call needs, as raw pointers and sizes. The same struct feeds
// the CPU reference stages and the CUDA launchers; pointers are host memory for the CPU backend
// and device memory for the CUDA backend (peer tables included).
#pragma once

#include <cstdint>

#include "core/activation.h"
#include "core/fp8_terms.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "core/plan_terms.h"
#include "core/slot_plan.h"
#include "epmoe/config.h"
#include "epmoe/status.h"
#include "epmoe/tensor.h"

namespace epmoe {

struct Step {
  Dims dims;                  // T here is Config T (physical stride of all [T, *] buffers)
  int64_t tokens = 0;         // T' of this call (<= dims.T)
  int rank = 0;
  int64_t capacity_rows = 0;  // recv_capacity_rows
  ActivationParams act;
  int64_t sequence = 0;       // call number (same on every rank)
  bool check_inputs = true;
  bool trap_on_overflow = false;
  bool arrival_gated_w13 = false;  // CUDA: W13 starts on rows as dispatch stores them (PDL)
  // Config.combine = per_rank: W2 / W13 DGRAD store rows_MD, a send stage sums each pull's routes
  // into one row of the owner's combine buffer [T, R, D]; otherwise combine is [T, K, D].
  bool combine_per_rank = false;
  int barrier_timeout_ms = 30000;  // budget of in-step waits (W13 on dispatch arrivals)
  void* stream = nullptr;     // cudaStream_t (CUDA)

  // ---- inputs of this rank ----
  const bf16_t* x_TD = nullptr;
  const int32_t* num_tokens_1 = nullptr;  // nullable: all tokens live
  const void* ids_TK = nullptr;
  DType ids_dtype = DType::i32;           // i32 or i64
  const void* scores_TK = nullptr;
  DType scores_dtype = DType::f32;        // f32 or bf16
  const bf16_t* w13_EFD = nullptr;        // [E, 2F, D]
  const bf16_t* w2_EDF = nullptr;         // [E, D, F]
  const bf16_t* grad_y_TD = nullptr;      // backward

  // ---- outputs ----
  bf16_t* y_TD = nullptr;
  bf16_t* grad_x_TD = nullptr;
  float* grad_scores_TK = nullptr;
  void* grad_w13_EFD = nullptr;  // wgrad_dtype
  void* grad_w2_EDF = nullptr;
  DType wgrad_dtype = DType::bf16;
  bool accumulate_wgrad = false;

  // ---- symmetric buffers: tables of R pointers, [r] = rank r's copy ----
  char* const* routing_R = nullptr;     // RoutingHeader + ids + scores
  bf16_t* const* dispatch_R = nullptr;  // [T, D]
  bf16_t* const* combine_R = nullptr;   // [T, K, D]; per-rank combine: [T, R, D]
  char* dispatch_local = nullptr;       // this rank's dispatch buffer (dispatch_R[rank], host-known)

  // ---- this layer's state (saved slot or scratch) ----
  LayoutView layout;
  bf16_t* x_gathered_MD = nullptr;  // [capacity, D]
  bf16_t* h13_M2F = nullptr;        // [capacity, 2F]
  bf16_t* h3_TKD = nullptr;         // saved copy of this rank's combine slots (nullable)
  bf16_t* h3_MD = nullptr;          // per-rank combine: W2 rows [capacity, D] (rows_MD unplaced)

  // ---- activation slot (save_for_backward; all null otherwise) ----
  // With a layer plan, stages take x_gathered, h13, h3 and the saved x from arena + the plan's
  // offsets at run time (device memory on CUDA), never from the pointers above.
  char* arena = nullptr;
  int64_t arena_bytes = 0;           // CUDA: the arena is one TMA operand of rows of 2D bytes
  LayerPlan* layer_plan = nullptr;   // this layer's record in its slot's metadata
  SlotState* slot_state = nullptr;   // the slot's planner state
  int64_t* slot_saved_R = nullptr;   // [R]: the slot's bytes saved as if on each rank
  SlotGeometry slot_geometry;
  int slot = -1;
  bool replay = false;  // backward's replay of the forward: stages skip unless layer_plan->replay_skip == 0

  // ---- scratch ----
  char* route_scratch = nullptr;    // route_scratch_layout()
  bf16_t* h_MF = nullptr;           // [capacity, F]
  bf16_t* grad_h3_MD = nullptr;     // [capacity, D]
  bf16_t* grad_h13_M2F = nullptr;   // [capacity, 2F]
  bf16_t* rows_MD = nullptr;        // unfused or per-rank combine
  bf16_t* grad_h_MF = nullptr;      // unfused only
  // The score enters after the W2 DGRAD (Context backward; null: the layered API, whose
  // gather_grad scales grad_h3 and whose grad_scores stage dots grad_y with h3). gather_grad then
  // copies grad_y rows unscaled and stores each row's score here; the SwiGLU backward of the W2
  // DGRAD takes grad_h = score * dh, writes h scaled by the score for the W2 WGRAD, and the
  // partials of grad_scores = <dh, h> per 64-column chunk, which the grad_scores stage sums.
  float* row_scores_M = nullptr;    // [capacity] f32
  float* score_parts_MC = nullptr;  // [capacity, score_chunks(F)] f32

  // ---- FP8 block-scaled path (Config.precision = fp8_block; docs/formats.md "FP8 training") ----
  // The dispatch buffers then hold x as E4M3 rows + scales (fp8_dispatch_layout) and x_gathered
  // the received E4M3 rows + S-major scales (fp8_rows_bytes at the received rows).
  bool fp8 = false;
  const uint8_t* w13_q_EFD = nullptr;     // [E, 2F, D] E4M3
  const float* w13_scales_EBS = nullptr;  // [E, S_2F, S_D] fp32, one per 128x128 block
  const uint8_t* w2_q_EDF = nullptr;      // [E, D, F] E4M3
  const float* w2_scales_EBS = nullptr;   // [E, S_D, S_F]
  char* fp8_scratch = nullptr;  // fp8_scratch_layout(dims, capacity_rows, fp8_wgrad); inference: h rows only
  // MemoryPlan::fp8_wgrad (Config.fp8_wgrad resolved, never by_shape): fp8, the FP8 WGRADs on
  // column-quantized operands; bf16, the bf16 WGRADs (x decoded from its E4M3 rows into
  // fp8_scratch's x_bf16 first).
  Fp8Wgrad fp8_wgrad = Fp8Wgrad::fp8;
  // The DGRAD operands: w13^T [E, D, 2F] + scales [E, S_D, S_2F], w2^T [E, F, D] + scales
  // [E, S_F, S_D]. Prepared weights: the caller's transposed copies (read as they are). Per-call
  // weights: null, and the CUDA DGRADs transpose into fp8_transposed, the training scratch
  // fp8_transposed_layout(dims) (null otherwise).
  const uint8_t* w13_qt_EDF = nullptr;
  const float* w13_scales_t_EBS = nullptr;
  const uint8_t* w2_qt_EFD = nullptr;
  const float* w2_scales_t_EBS = nullptr;
  char* fp8_transposed = nullptr;

  // ---- NVFP4 weight-only inference (Config.precision = nvfp4; docs/formats.md) ----
  // The GEMMs read these instead of w13_EFD / w2_EDF; activations stay bf16.
  bool nvfp4 = false;
  const uint8_t* w13_nvfp4_EFP = nullptr;         // [E, 2F, ceil(D/2)] E2M1, GEMM order
  const uint8_t* w13_nvfp4_scales = nullptr;      // E4M3 [E, ceil(D/128), 2F, 8], GEMM order
  const float* w13_nvfp4_global_E = nullptr;      // [E] fp32
  const uint8_t* w2_nvfp4_EDP = nullptr;          // [E, D, ceil(F/2)] E2M1, GEMM order
  const uint8_t* w2_nvfp4_scales = nullptr;       // E4M3 [E, ceil(F/128), D, 8], GEMM order
  const float* w2_nvfp4_global_E = nullptr;       // [E] fp32
  // Split-K partials of both GEMMs (gemm/nvfp4_gemm.h; fp32 [splits, capacity, N]); the call
  // scratch's grad_h3 and grad_h13 rows, which an inference context never touches otherwise.
  float* nvfp4_splitk_SMN = nullptr;
  int64_t nvfp4_splitk_bytes = 0;

  // ---- MXFP8 inference (Config.precision = mxfp8; docs/formats.md "MXFP8 inference") ----
  // The GEMMs read these instead of w13_EFD / w2_EDF and quantize their activation rows 1x32.
  bool mxfp8 = false;
  const uint8_t* w13_mx_EFD = nullptr;         // [E, 2F, D] E4M3
  const uint8_t* w13_mx_scales_EFS = nullptr;  // [E, 2F, ceil(D/32)] E8M0
  const uint8_t* w2_mx_EDF = nullptr;          // [E, D, F] E4M3
  const uint8_t* w2_mx_scales_EDS = nullptr;   // [E, D, ceil(F/32)] E8M0
  // CUDA: the quantized activation rows, mxfp8_scratch_layout(dims, capacity_rows) (plan_terms.h).
  char* mxfp8_scratch = nullptr;

  Status* status = nullptr;
};

// Dispatch arrival counters [arrival_blocks(capacity)] in the route scratch: route zeroes them,
// dispatch counts the rows it stored per 128-row block (only with arrival_gated_w13), an
// arrival-gated W13 waits on them.
inline uint32_t* arrivals_B(const Step& s) {
  return reinterpret_cast<uint32_t*>(s.route_scratch +
                                     route_scratch_layout(s.dims, s.capacity_rows).arrivals);
}

// The step's FP8 operand scratch carve (fp8_scratch; Config.fp8_wgrad moves only the WGRAD
// regions), as both backends read it.
inline Fp8ScratchLayout fp8_scratch_layout(const Step& s) {
  return fp8_scratch_layout(s.dims, s.capacity_rows, s.fp8_wgrad);
}

}  // namespace epmoe
