// GPU test support: inputs on which the FP8 block-scaled forward is the same function on the CPU
// and CUDA backends, so that they agree bitwise (test_gpu_fp8_forward, test_gpu_ep2).
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>

#include "core/numeric.h"
#include "moe_case.h"

namespace epmoe::test {

// x: per 128-block along D, element 0 is the block amax and element 1 is zero. Block 0 is
// [448, 0, 3, 3, ...] (scale 1, codes 3); later blocks [112, 0, j/4 ...] (scale 1/4, codes j in
// [-3, 3]). w13 and w2: every 128x128 block has amax 28 (scale 1/16) at its first row, column 1
// (w13; x's column 1 is zero) and codes |j| <= 3 elsewhere; w13's column 0 of every block is zero
// (x's amax column). So every W13 block sum is sum over 126 k of (code x)(code w), |sum| <= 1134.
// The gate rows of block 0 are all 3/16: each gate gets 126 * 9 / 16 = 70.875 from block 0 and at
// most 1134 / 64 = 17.7 from each later block, so with D <= 384 every gate is >= 35 and
// sigmoid(gate) == 1 exactly. w2 has one non-zero per (row, 128-column block): each W2 block sum
// is a single product, exact.
inline void make_exact(const Problem& p, RankInputs& in, uint64_t seed) {
  const int64_t D = p.hidden, F = p.intermediate, E = p.local_experts();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> j3(-3, 3);
  auto small = [&](float step) { return float_to_bf16(static_cast<float>(j3(rng)) * step); };
  auto nonzero = [&](float step) {
    int j = 0;
    while (j == 0) j = j3(rng);
    return float_to_bf16(static_cast<float>(j) * step);
  };
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int64_t d = 0; d < D; ++d) {
      const int64_t b = d / 128, i = d % 128;
      bf16_t v;
      if (i == 0) {
        v = float_to_bf16(b == 0 ? 448.0f : 112.0f);
      } else if (i == 1) {
        v = float_to_bf16(0.0f);
      } else {
        v = b == 0 ? float_to_bf16(3.0f) : small(0.25f);
      }
      in.x_TD[static_cast<size_t>(t * D + d)] = v;
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t n = 0; n < 2 * F; ++n) {
      for (int64_t d = 0; d < D; ++d) {
        const int64_t b = d / 128, i = d % 128;
        bf16_t v;
        if (i == 0) {
          v = float_to_bf16(0.0f);
        } else if (i == 1) {
          v = float_to_bf16(n % 128 == 0 ? 28.0f : 0.0f);
        } else if (b == 0 && n < F) {
          v = float_to_bf16(3.0f / 16.0f);
        } else {
          v = small(1.0f / 16.0f);
        }
        in.w13_EFD[static_cast<size_t>((e * 2 * F + n) * D + d)] = v;
      }
    }
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t f = 0; f < F; ++f) in.w2_EDF[static_cast<size_t>((e * D + d) * F + f)] = 0;
      for (int64_t c = 0; c * 128 < F; ++c) {
        const int64_t len = std::min<int64_t>(128, F - c * 128);
        const int64_t f = c * 128 + (d * 7 + c * 13 + e * 5) % len;
        in.w2_EDF[static_cast<size_t>((e * D + d) * F + f)] =
            d % 128 == 0 ? float_to_bf16(28.0f) : nonzero(1.0f / 16.0f);
      }
    }
  }
}

}  // namespace epmoe::test
