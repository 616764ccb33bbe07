// Shared by the FP8 grouped-GEMM launchers (grouped_gemm_fp8.cu, grouped_gemm_fp8_pingpong.cu):
// the kernel arguments every tile derives from Fp8GroupedGemmArgs.
#pragma once

#include <cstdint>

#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/grouped_gemm_fp8_sm90.cuh"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

inline GroupArgs fp8_group_args(const Fp8GroupedGemmArgs& args) {
  GroupArgs groups;
  groups.offsets = args.offsets_E1;
  groups.skip = args.skip;
  groups.replay_skip = args.replay_skip;
  groups.groups = args.E;
  groups.band_rows = args.band_rows;
  groups.n = args.N;
  groups.k = args.K;
  return groups;
}

inline Fp8ActScales fp8_act_scales(const Fp8GroupedGemmArgs& args) {
  Fp8ActScales sa{args.a_scales_SM, args.ld_a_scales, args.M};
  if (args.a_rows_1 != nullptr) {
    sa.scales_SM = reinterpret_cast<const float*>(args.a_MK);  // resolved on the device
    sa.ld = 0;
    sa.rows_1 = args.a_rows_1;
    sa.k = args.K;
  }
  return sa;
}

inline Fp8WeightScales fp8_weight_scales(const Fp8GroupedGemmArgs& args) {
  return Fp8WeightScales{args.b_scales_EBS, (args.N + 127) / 128, (args.K + 127) / 128};
}

// Where plain rows go: out_MN, or past it by the device-held out_offset.
inline Placed fp8_rows_out(const Fp8GroupedGemmArgs& args) {
  return Placed{reinterpret_cast<char*>(args.out_MN), args.out_offset};
}

// The 64 x 256 ping-pong tile (grouped_gemm_fp8_pingpong_sm90.cuh) on checked args with M > 0;
// pairs: a CTA runs both 64-row halves of a 128-row block (else they go to neighbouring CTAs).
void fp8_grouped_gemm_pingpong(const Fp8GroupedGemmArgs& args, bool pairs, void* stream);

}  // namespace epmoe::cuda::gemm
