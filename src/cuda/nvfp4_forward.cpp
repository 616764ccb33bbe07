#include "cuda/nvfp4_forward.h"

#include "cuda/gemm/nvfp4_gemm.h"
#include "cuda/w2_rows_output.h"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

// Groups, skip flag and split-K scratch of the step; A, B and the output are the caller's.
// Inference contexts have no layer plan: x_gathered, h13, h3 are the Step's buffers.
Nvfp4GroupedGemmArgs step_gemm(const Step& s, int64_t N, int64_t K, const StreamForkView& fork) {
  EPMOE_CHECK_ARG(s.layer_plan == nullptr && !s.replay, "Step.layer_plan",
                  "none with nvfp4 (weight-only inference saves nothing)", "a layer plan");
  Nvfp4GroupedGemmArgs a;
  a.offsets_E1 = s.layout.expert_offsets_E1;
  a.skip = s.layout.header + kLayoutSkip;
  a.E = s.dims.E;
  a.M = s.capacity_rows;
  a.rows_per_group = balanced_rows_per_expert(s.dims);
  a.N = N;
  a.K = K;
  a.splitk_scratch_SMN = s.nvfp4_splitk_SMN;
  a.splitk_scratch_bytes = s.nvfp4_splitk_bytes;
  if (nvfp4_wide_fork()) a.fork = fork;  // off by default (nvfp4_gemm.h)
  return a;
}

}  // namespace

void nvfp4_w13_fprop(const Step& s, const StreamForkView& fork) {
  const int64_t D = s.dims.D, F = s.dims.F;
  Nvfp4GroupedGemmArgs a = step_gemm(s, 2 * F, D, fork);
  a.a_MK = s.x_gathered_MD;
  a.b_codes_ENP = s.w13_nvfp4_EFP;
  a.b_scales = s.w13_nvfp4_scales;
  a.b_global_E = s.w13_nvfp4_global_E;
  a.out_MN = s.h13_M2F;
  a.ld_out = 2 * F;
  nvfp4_grouped_gemm(a, s.stream);
}

void nvfp4_w13_swiglu(const Step& s, const StreamForkView& fork) {
  const int64_t D = s.dims.D, F = s.dims.F;
  Nvfp4GroupedGemmArgs a = step_gemm(s, 2 * F, D, fork);
  a.a_MK = s.x_gathered_MD;
  a.b_codes_ENP = s.w13_nvfp4_EFP;
  a.b_scales = s.w13_nvfp4_scales;
  a.b_global_E = s.w13_nvfp4_global_E;
  a.swiglu = true;
  a.act = s.act;
  a.out_MN = s.h_MF;
  a.ld_out = F;
  nvfp4_grouped_gemm(a, s.stream);
}

void nvfp4_w2_fprop(const Step& s, bool scatter, const StreamForkView& fork) {
  const int64_t D = s.dims.D, F = s.dims.F;
  Nvfp4GroupedGemmArgs a = step_gemm(s, D, F, fork);
  a.a_MK = s.h_MF;
  a.b_codes_ENP = s.w2_nvfp4_EDP;
  a.b_scales = s.w2_nvfp4_scales;
  a.b_global_E = s.w2_nvfp4_global_E;
  w2_rows_output(s, scatter, a);
  nvfp4_grouped_gemm(a, s.stream);
}

}  // namespace epmoe::cuda
