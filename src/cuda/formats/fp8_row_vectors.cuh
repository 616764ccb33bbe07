// FP8 1x128 row quantization inside a kernel that writes the bf16 rows as 16-byte vectors (the
// gather_grad pull, the SwiGLU backward): a block is 16 aligned lanes of a warp, lane j of the
// group holding elements 8j .. 8j + 7 of the block (fp8_quantize_rows gives a lane 16 of them).
// The same integer amax (order-free), scale rule and element encoder on the same bf16 values give
// its codes and scales bitwise, so the rows need not be read back by a second kernel.
#pragma once

#include <cstdint>

#include "core/formats/fp8_block.h"
#include "cuda/formats/e4m3_bounded.cuh"
#include "cuda/formats/row_blocks.cuh"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {

static_assert(kFp8RowBlock == 16 * kVec, "a 1x128 block is 16 lanes of 8 bf16");

struct Fp8Run8 {
  uint2 codes;  // 8 E4M3 codes, element 0 in the low byte (as stored)
  float scale;  // the block's fp32 scale
};

// x_8: the lane's 8 bf16 as stored; in: the lane's run lies in the row (a lane past the row's end,
// in a partial last block, adds nothing to the amax, as fp8_quantize_rows reads it). Every lane of
// `mask` must call it; the mask holds whole 16-lane groups.
__device__ __forceinline__ Fp8Run8 fp8_quantize_run8(uint4 x_8, bool in, unsigned mask) {
  const Bf16x8 x = unpack8(x_8);
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kVec; ++i) amax = amax_bits_add(amax, in ? x.v[i] : 0.0f);
  amax = group_max<16>(amax, mask);
  Fp8Run8 r;
  r.scale = Fp8Fp32Scale::from_amax(amax);
  r.codes = fp8_encode8_fp32(x.v, r.scale, fp8_fp32_bounds(r.scale));
  return r;
}

// The E4M3 rows a kernel writes beside its bf16 rows: fp8_rows_bytes(capacity, L) at `codes`
// (core/fp8_terms.h), codes [capacity, L] then scales S-major, (row m, block b) at scales_SM[b * ld + m].
struct Fp8RowsOut {
  uint8_t* codes = nullptr;
  float* scales_SM = nullptr;
  int64_t ld = 0;
};

// Stores lane run r of row m at element l0 (a multiple of 8; the group's first lane, l0 % 128 == 0,
// stores the block's scale).
__device__ __forceinline__ void store_fp8_run8(const Fp8RowsOut& out, int64_t m, int64_t L,
                                               int64_t l0, const Fp8Run8& r) {
  *reinterpret_cast<uint2*>(out.codes + m * L + l0) = r.codes;
  if (l0 % kFp8RowBlock == 0) out.scales_SM[(l0 / kFp8RowBlock) * out.ld + m] = r.scale;
}

}  // namespace epmoe::cuda
