// CPU twin of the FP8 block-scaled grouped GEMM (src/cuda/gemm/grouped_gemm_fp8_sm90.cuh): E4M3
// operands, 1x128 activation scales and 128x128 weight scales (fp32), two-level accumulation:
//
//   out[m, n] = bf16( sum_kb  block(m, n, kb) * (sa[m, kb] * sb[n / 128, kb]) )
//   block(m, n, kb) = sum over k of the kb-th 128-wide block of a[m, k] * b_e[n, k]      (fp32)
//
// Products of two E4M3 values are exact in fp32; each block sum is accumulated in ascending k
// (one add per step), then promoted into the running total with one fused multiply-add per block
// (std::fma, as the kernel's fmaf), from a total of +0. The result is rounded to bf16 once. A
// partial last block (K % 128 != 0) covers the elements that exist.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/formats/e4m3.h"
#include "core/formats/fp8_block.h"
#include "core/numeric.h"

namespace epmoe::cpu {

// Rows m of expert e are [offsets_E1[e], offsets_E1[e + 1]); rows outside every group are not
// written. Layouts (letters: M rows, K contraction, N output columns, S = ceil(K / 128) k-blocks,
// B = ceil(N / 128) weight row blocks):
//   a_MK          [M, K] E4M3 codes, row pitch K
//   a_scales_SM   activation scales, S-major: scale of (row m, k-block s) at s * ld_sa + m
//   b_ENK         [E, N, K] E4M3 codes
//   b_scales_EBS  [E, B, S] (the weight codec's layout)
//   out_MN        bf16, row pitch ld_out
//   abs_MN        optional (nullable), row pitch ld_out: sum_kb |sa * sb| * sum_k |a * b|, the
//                 magnitude that bounds the accumulation error of any summation order
inline void fp8_grouped_gemm_reference(const uint8_t* a_MK, const float* a_scales_SM, int64_t ld_sa,
                                       const uint8_t* b_ENK, const float* b_scales_EBS,
                                       const int32_t* offsets_E1, int E, int64_t N, int64_t K,
                                       bf16_t* out_MN, int64_t ld_out, float* abs_MN = nullptr) {
  const int64_t S = (K + kFp8RowBlock - 1) / kFp8RowBlock;
  const int64_t B = (N + kFp8WeightBlock - 1) / kFp8WeightBlock;
  std::vector<float> a(static_cast<size_t>(K));
  for (int e = 0; e < E; ++e) {
    const uint8_t* b_NK = b_ENK + static_cast<int64_t>(e) * N * K;
    const float* sb_BS = b_scales_EBS + static_cast<int64_t>(e) * B * S;
    for (int64_t m = offsets_E1[e]; m < offsets_E1[e + 1]; ++m) {
      for (int64_t k = 0; k < K; ++k) a[k] = e4m3_to_float(a_MK[m * K + k]);
      for (int64_t n = 0; n < N; ++n) {
        const uint8_t* b_K = b_NK + n * K;
        float total = 0.0f, magnitude = 0.0f;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t k1 = (s + 1) * kFp8RowBlock < K ? (s + 1) * kFp8RowBlock : K;
          float block = 0.0f, block_abs = 0.0f;
          for (int64_t k = s * kFp8RowBlock; k < k1; ++k) {
            const float p = a[k] * e4m3_to_float(b_K[k]);  // exact
            block += p;
            block_abs += std::fabs(p);
          }
          const float scale = a_scales_SM[s * ld_sa + m] * sb_BS[(n / kFp8WeightBlock) * S + s];
          total = std::fma(block, scale, total);
          magnitude += block_abs * std::fabs(scale);
        }
        out_MN[m * ld_out + n] = float_to_bf16(total);
        if (abs_MN != nullptr) abs_MN[m * ld_out + n] = magnitude;
      }
    }
  }
}

}  // namespace epmoe::cpu
