// MXFP8 grouped GEMM (rows grouping; both operands MXFP8: E4M3 codes, one E8M0 scale per 32
// elements of K), plain C++ launcher: device pointers, sizes and a cudaStream_t passed as void*.
// Kernel: gemm/grouped_gemm_mxfp8.cu; CPU twin: cpu::row_times_nt on an Mxfp8Expert
// (src/cpu/stages_mxfp8.cpp), compared in tests/gpu/test_gpu_gemm_mxfp8.cpp.
//
//   out[m, n] = bf16( sum over blocks b, ascending, of
//                fp32(sum_{k in b} e4m3(a[m, k]) * e4m3(w_e[n, k])) * 2^(sa[m, b] + sw[n, b]) )
//   for the rows m of expert e, [offsets_E1[e], offsets_E1[e + 1]); sa, sw the unbiased E8M0
//   exponents; a NaN scale (0xFF) makes its block NaN.
//
// The CPU rounds each block's exact code-product sum once to fp32; here the tensor cores sum the
// block's 32 products (each exact: 8 significant bits) in fp32 in their own order, so a block
// differs from the CPU's only when its exact sum needs more than fp32's 24 bits. The scaling by
// 2^(sa + sw) and the block-order fp32 total are the CPU's operations (one rounding each).
#pragma once

#include <cstdint>

#include "core/activation.h"
#include "core/numeric.h"

namespace epmoe::cuda {

// Letters: M rows (capacity), K contraction, N output columns, E experts, S = K / 32 scale blocks.
struct Mxfp8GroupedGemmArgs {
  const uint8_t* a_codes_MK = nullptr;    // [M, K] E4M3 (the codec's rows, formats.h)
  const uint8_t* a_scales_MS = nullptr;   // [M, S] E8M0
  const uint8_t* b_codes_ENK = nullptr;   // [E, N, K] E4M3 (prepared weights)
  const uint8_t* b_scales_ENS = nullptr;  // [E, N, S] E8M0
  const int32_t* offsets_E1 = nullptr;    // device [E + 1], non-decreasing, offsets_E1[E] <= M
  const int32_t* skip = nullptr;          // nullable device flag: non-zero = every group is empty
  int E = 0;
  int64_t M = 0, N = 0, K = 0;
  bf16_t* out_MN = nullptr;               // row pitch ld_out; rows outside the groups untouched
  int64_t ld_out = 0;
  // Set instead of out_MN: row m goes to its owner's combine slot, combine_R[rank of src] at slot
  // (t, k) of src = recv_src_M[m] (core/layout.h encode_src; [T, K, N] bf16 buffers, peer
  // pointers).
  bf16_t* const* combine_R = nullptr;     // device [R] table
  const int32_t* recv_src_M = nullptr;    // device [M]
  int64_t T = 0;
  int top_k = 0;
  // W13 with the SwiGLU epilogue: B holds the gate rows [0, N/2) then the up rows [N/2, N); out
  // gets h[m, f] = bf16(act(bf16(gate), bf16(up))) for f < N/2 (core/activation.h, the unfused
  // kernel's math), [M, N/2] with row pitch ld_out; no h13.
  bool swiglu = false;
  ActivationParams act;
};

// Requirements (checked; Error(invalid_argument) naming the field): E >= 1, K > 0 and
// K % 32 == 0 (whole MX blocks), N > 0, ld_out >= N (or the combine fields), a_codes_MK and
// b_codes_ENK 16-byte aligned; swiglu: N even, ld_out >= N / 2, no combine_R. Grid
// (ceil(N / 64), E) (swiglu: (ceil(N / 2 / 32), E)); graph-capturable; deterministic (one lane
// owns each output and sums its blocks in ascending order).
void mxfp8_grouped_gemm(const Mxfp8GroupedGemmArgs& args, void* stream);

}  // namespace epmoe::cuda
