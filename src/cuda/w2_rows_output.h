// Where a weight-decoding W2 FPROP (NVFP4, MXFP8) stores its rows: the owners' combine slots
// (fused scatter), else the unfused rows buffer, or h3 for the per-rank combine's send stage.
// Args: any grouped-GEMM argument struct with combine_R / recv_src_M / T / top_k / out_MN / ld_out.
#pragma once

#include "core/step.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

template <class Args>
void w2_rows_output(const Step& s, bool scatter, Args& a) {
  if (scatter) {
    a.combine_R = s.combine_R;
    a.recv_src_M = s.layout.recv_src_M;
    a.T = s.dims.T;
    a.top_k = s.dims.K;
    return;
  }
  // Per-rank combine: the rows are h3, kept for the send stage (no plan: the Step's buffer).
  bf16_t* out = s.combine_per_rank ? s.h3_MD : s.rows_MD;
  EPMOE_CHECK_ARG(out != nullptr, s.combine_per_rank ? "Step.h3_MD" : "Step.rows_MD",
                  "the unfused rows buffer", "nullptr");
  a.out_MN = out;
  a.ld_out = s.dims.D;
}

}  // namespace epmoe::cuda
