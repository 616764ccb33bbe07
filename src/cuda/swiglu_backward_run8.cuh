// The SwiGLU backward of one run of 8 consecutive columns of a row, shared by the unfused kernel
// (swiglu.cu) and the FP8 W2 DGRAD epilogue (gemm/fp8_swiglu_epilogue.cuh) so that both give the
// same bits: bf16 inputs widened to fp32, core/activation.h's math, one rounding per stored element.
#pragma once

#include <cstdint>

#include "core/activation.h"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {

struct SwigluBackwardRun8 {
  uint4 h, d_gate, d_up;  // 8 bf16 each, as stored
  float dot;              // scored: <dh, bf16(act)> over the 8 columns in order; else 0
};

// gate_8, up_8: the saved h13's 8 bf16 of each half; dh_8: grad_h's. scored (a row score): dh is
// grad_h unscaled, the backward takes score * dh and h is bf16(score * act).
__device__ __forceinline__ SwigluBackwardRun8 swiglu_backward_run8(uint4 gate_8, uint4 up_8, uint4 dh_8,
                                                                   bool scored, float score,
                                                                   const ActivationParams& act) {
  const Bf16x8 gate = unpack8(gate_8), up = unpack8(up_8), dh = unpack8(dh_8);
  Bf16x8 h, d_gate, d_up;
  float dot = 0.0f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float a = ::epmoe::swiglu_backward_and_forward(
        gate.v[e], up.v[e], scored ? __fmul_rn(score, dh.v[e]) : dh.v[e], act, d_gate.v[e], d_up.v[e]);
    dot = __fadd_rn(dot, __fmul_rn(dh.v[e], bf16_to_float(float_to_bf16(a))));
    h.v[e] = scored ? __fmul_rn(score, a) : a;
  }
  return SwigluBackwardRun8{pack8(h), pack8(d_gate), pack8(d_up), scored ? dot : 0.0f};
}

// A 64-column chunk's grad_scores partial: the 8 lanes of `chunk_lanes` (8 aligned lanes, one run
// of 8 columns each) summed as an xor tree (4, 2, 1). Every kernel and epilogue that writes
// score_parts_MC sums in this order, so that their partials agree bit for bit.
__device__ __forceinline__ float chunk_dot_sum(float dot, unsigned chunk_lanes) {
  dot = __fadd_rn(dot, __shfl_xor_sync(chunk_lanes, dot, 4));
  dot = __fadd_rn(dot, __shfl_xor_sync(chunk_lanes, dot, 2));
  return __fadd_rn(dot, __shfl_xor_sync(chunk_lanes, dot, 1));
}

}  // namespace epmoe::cuda
