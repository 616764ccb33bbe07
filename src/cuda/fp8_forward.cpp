#include "cuda/fp8_forward.h"

#include <cstdlib>
#include <cstring>

#include "core/formats/fp8_block.h"
#include "core/fp8_terms.h"
#include "core/plan_terms.h"
#include "cuda/formats/formats.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/gemm_config.h"
#include "cuda/placed_copy.h"
#include "cuda/swiglu.h"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

// Groups, skip flags of the step (the layout's, and the replay's in backward); A, B and the
// output are the caller's.
Fp8GroupedGemmArgs step_gemm(const Step& s, int64_t N, int64_t K) {
  Fp8GroupedGemmArgs a;
  a.offsets_E1 = s.layout.expert_offsets_E1;
  a.skip = s.layout.header + kLayoutSkip;
  a.replay_skip = replay_skip_flag(s);
  a.E = s.dims.E;
  a.M = s.capacity_rows;
  a.N = N;
  a.K = K;
  a.trim_rows = fp8_trim_rows_rule(balanced_rows_per_expert(s.dims), fp8_tile_from_env());
  a.band_rows = gemm::select_fp8_band_rows(s);
  return a;
}

}  // namespace

void fp8_w13_fprop(const Step& s) {
  const int64_t D = s.dims.D, F = s.dims.F, M = s.capacity_rows;
  const int32_t* header = s.layout.header;
  // With a layer plan, x_gathered and h13 sit in the layer's slot at device-known offsets. A is
  // read by TMA through a descriptor built on the host, which needs the address: the GEMM reads the
  // call scratch's copy of x_gathered (no copy when the plan placed it there: recompute). h13 is
  // stored by the epilogue's plain stores, which resolve the placement on the device: no copy.
  if (s.layer_plan != nullptr) {
    copy_placed_rows(placed_x_gathered(s), plain(s.x_gathered_MD), header, M, 0, D,
                     replay_skip_flag(s), s.stream);
  }
  Fp8GroupedGemmArgs a = step_gemm(s, 2 * F, D);
  // codes [rows, D] | S-major scales at the received rows (fp8_rows_bytes), both placed by the
  // device count: dispatch wrote them there.
  a.a_MK = reinterpret_cast<const uint8_t*>(s.x_gathered_MD);
  a.a_rows_1 = header + kLayoutRows;
  a.b_ENK = s.w13_q_EFD;
  a.b_scales_EBS = s.w13_scales_EBS;
  const Placed h13 = placed_h13(s);
  a.out_MN = reinterpret_cast<bf16_t*>(h13.base);
  a.out_offset = h13.offset;
  a.ld_out = 2 * F;
  fp8_grouped_gemm(a, s.stream);
}

void fp8_quantize_h(const Step& s) {
  const int64_t F = s.dims.F, M = s.capacity_rows;
  char* h = s.fp8_scratch + fp8_scratch_layout(s).h_q;
  fp8_quantize_rows_counted(s.h_MF, M, F, s.layout.header + kLayoutRows,
                            s.layout.header + kLayoutSkip, reinterpret_cast<uint8_t*>(h),
                            reinterpret_cast<float*>(h + fp8_rows_scales_offset(M, F)),
                            fp8_rows_ld(M), s.stream);
}

bool fp8_rows_quantized_by_producer() {
  const char* env = std::getenv("EPMOE_FP8_ROW_QUANT");
  if (env == nullptr || std::strcmp(env, "producer") == 0) return true;
  EPMOE_CHECK_ARG(std::strcmp(env, "separate") == 0, "EPMOE_FP8_ROW_QUANT",
                  "producer or separate", env);
  return false;
}

void fp8_swiglu_forward(const Step& s) {
  if (s.dims.F % kFp8RowBlock != 0 || !fp8_rows_quantized_by_producer()) {
    swiglu_forward(s);
    fp8_quantize_h(s);
    return;
  }
  const int64_t F = s.dims.F, M = s.capacity_rows;
  char* h = s.fp8_scratch + fp8_scratch_layout(s).h_q;
  swiglu_forward_fp8_rows(s, reinterpret_cast<uint8_t*>(h),
                          reinterpret_cast<float*>(h + fp8_rows_scales_offset(M, F)),
                          fp8_rows_ld(M));
}

void fp8_w13_swiglu(const Step& s) {
  fp8_w13_fprop(s);
  fp8_swiglu_forward(s);
}

void fp8_rows_output(const Step& s, bool scatter, Fp8GroupedGemmArgs& a) {
  if (scatter) {
    a.combine_R = s.combine_R;
    a.recv_src_M = s.layout.recv_src_M;
    a.T = s.dims.T;
    a.top_k = s.dims.K;
    return;
  }
  EPMOE_CHECK_ARG(s.rows_MD != nullptr, "Step.rows_MD", "the unfused rows buffer", "nullptr");
  a.out_MN = s.rows_MD;
  a.ld_out = s.dims.D;
}

void fp8_w2_fprop(const Step& s, bool scatter) {
  const int64_t D = s.dims.D, F = s.dims.F, M = s.capacity_rows;
  Fp8GroupedGemmArgs a = step_gemm(s, D, F);
  const char* h = s.fp8_scratch + fp8_scratch_layout(s).h_q;
  a.a_MK = reinterpret_cast<const uint8_t*>(h);
  a.a_scales_SM = reinterpret_cast<const float*>(h + fp8_rows_scales_offset(M, F));
  a.ld_a_scales = fp8_rows_ld(M);
  a.b_ENK = s.w2_q_EDF;
  a.b_scales_EBS = s.w2_scales_EBS;
  fp8_rows_output(s, scatter, a);
  a.tile = fp8_tile_for_d_rows(a.N, a.K, balanced_rows_per_expert(s.dims));
  a.trim_rows = fp8_trim_rows_rule(balanced_rows_per_expert(s.dims), a.tile);
  // Per-rank combine: the rows are h3, which the send reads at placed_h3_rows: the call scratch's
  // rows_MD, where the GEMM stores them (the planner's h3 offset is the geometry's scratch_rows;
  // without a plan Step::h3_MD is rows_MD), so no copy follows.
  if (!scatter && s.combine_per_rank) {
    EPMOE_ASSERT(s.layer_plan == nullptr
                     ? s.h3_MD == s.rows_MD
                     : s.slot_geometry.h3_rows != 0 &&
                           s.arena + s.slot_geometry.scratch_rows ==
                               reinterpret_cast<const char*>(s.rows_MD));
  }
  fp8_grouped_gemm(a, s.stream);
}

}  // namespace epmoe::cuda
