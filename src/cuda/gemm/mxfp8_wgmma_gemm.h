// MXFP8 grouped GEMM on wgmma (prefill), plain C++ launcher: the arguments and the formula of
// mxfp8_grouped_gemm (gemm/mxfp8_gemm.h), computed by gemm/grouped_gemm_mxfp8_wgmma_sm90.cuh:
// 128 x 128 tiles, a weight tile read once per 128 rows of its expert, each 32-K slice one wgmma
// promoted with its scales. The decode kernel (mma.sync, 32 rows per weight pass) is bitwise the
// CPU formula; this one sums a block's 32 products on the tensor cores' fp8 path, which may round
// a block sum that needs more than 24 bits differently (tests/gpu/test_gpu_gemm_mxfp8_wgmma.cpp
// measures it), and is otherwise the CPU's operations in the CPU's order. Deterministic: one
// thread owns each output and promotes its slices in ascending order.
#pragma once

#include "cuda/gemm/mxfp8_gemm.h"

namespace epmoe::cuda {

// Requirements (checked; Error(invalid_argument) naming the field): 1 <= E <= 512, K > 0 and
// K % 32 == 0, N > 0 and N % 8 == 0 (swiglu: N % 16 == 0), ld_out a multiple of 8 and >= N
// (swiglu: >= N / 2), 16-byte aligned codes and output (or the combine fields as
// mxfp8_grouped_gemm). Persistent (one CTA per SM), graph-capturable.
void mxfp8_grouped_gemm_wgmma(const Mxfp8GroupedGemmArgs& args, void* stream);

}  // namespace epmoe::cuda
