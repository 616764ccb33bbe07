// CPU twin of the FP8 block-scaled grouped GEMM (cpu/gemm_fp8_reference.h): hand-worked blocks
// (scale indexing per row, per k-block and per 128-row weight block; a partial last k-block; an
// empty expert; rows outside the groups untouched) and, on codec-quantized random data, agreement
// with a float64 product of the dequantized operands.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/formats/codecs.h"
#include "core/formats/e4m3.h"
#include "core/numeric.h"
#include "cpu/gemm_fp8_reference.h"

namespace epmoe {
namespace {

constexpr uint8_t kOne = 0x38;   // e4m3 1.0
constexpr uint8_t kTwo = 0x40;   // e4m3 2.0
constexpr uint8_t kHalf = 0x30;  // e4m3 0.5

TEST(Fp8GemmReference, HandWorkedBlocks) {
  // E = 3 experts, rows {0} | {} | {1, 2}; K = 160: k-block 0 = 128 elements, k-block 1 = 32.
  // N = 256: two weight row blocks. a = 1 in block 0, 2 in block 1; b = 0.5 everywhere.
  const int E = 3;
  const int64_t M = 4, N = 256, K = 160, S = 2, B = 2, ld_sa = 4;
  const std::vector<int32_t> offsets{0, 1, 1, 3};
  std::vector<uint8_t> a(M * K), b(E * N * K, kHalf);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) a[m * K + k] = k < 128 ? kOne : kTwo;
  }
  // sa[m, s] at s * ld_sa + m.
  std::vector<float> sa(S * ld_sa);
  for (int64_t m = 0; m < M; ++m) {
    sa[0 * ld_sa + m] = static_cast<float>(m + 1);
    sa[1 * ld_sa + m] = 0.25f;
  }
  // sb[e, blk, s]: 3 and 0.5 for expert 0, 1 and 4 for the rest, times (blk + 1).
  std::vector<float> sb(E * B * S);
  for (int e = 0; e < E; ++e) {
    for (int64_t blk = 0; blk < B; ++blk) {
      sb[(e * B + blk) * S + 0] = (e == 0 ? 3.0f : 1.0f) * static_cast<float>(blk + 1);
      sb[(e * B + blk) * S + 1] = (e == 0 ? 0.5f : 4.0f) * static_cast<float>(blk + 1);
    }
  }
  const bf16_t sentinel = float_to_bf16(-7.0f);
  std::vector<bf16_t> out(M * N, sentinel);
  std::vector<float> magnitude(M * N, 0.0f);
  cpu::fp8_grouped_gemm_reference(a.data(), sa.data(), ld_sa, b.data(), sb.data(), offsets.data(), E, N,
                                  K, out.data(), N, magnitude.data());
  // block 0: 128 * 1 * 0.5 = 64; block 1: 32 * 2 * 0.5 = 32.
  for (int64_t n = 0; n < N; ++n) {
    const float blk = static_cast<float>(n / 128 + 1);
    // row 0, expert 0: 64 * (1 * 3 blk) + 32 * (0.25 * 0.5 blk) = 196 blk
    EXPECT_EQ(bf16_to_float(out[0 * N + n]), 196.0f * blk) << n;
    // rows 1, 2, expert 2: 64 * ((m + 1) * blk) + 32 * (0.25 * 4 blk) = (64 (m + 1) + 32) blk
    EXPECT_EQ(bf16_to_float(out[1 * N + n]), 160.0f * blk) << n;
    EXPECT_EQ(bf16_to_float(out[2 * N + n]), 224.0f * blk) << n;
    EXPECT_EQ(magnitude[1 * N + n], 160.0f * blk) << n;  // all terms positive
    EXPECT_EQ(out[3 * N + n], sentinel) << "row 3 belongs to no expert";
  }
}

// Random data quantized by the host codecs: the twin equals the float64 product of the
// dequantized operands up to its fp32 block sums and the bf16 rounding.
TEST(Fp8GemmReference, MatchesDequantizedProduct) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int E = 3;
  const int64_t N = 256, K = 384, S = 3, M = 70, ld_sa = 72;
  const std::vector<int32_t> offsets{0, 30, 30, 70};
  std::vector<float> x(M * K), w(E * N * K);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = normal(rng) * 0.05f;
  std::vector<uint8_t> qa(M * K), qb(E * N * K);
  std::vector<float> sa_MS(M * S), sa_SM(S * ld_sa, 0.0f), sb(E * (N / 128) * S);
  fp8_quantize_rows(x.data(), M, K, qa.data(), sa_MS.data());
  fp8_quantize_weights(w.data(), E, N, K, qb.data(), sb.data());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t s = 0; s < S; ++s) sa_SM[s * ld_sa + m] = sa_MS[m * S + s];
  }
  std::vector<float> xd(M * K), wd(E * N * K);
  fp8_dequantize_rows(qa.data(), sa_MS.data(), M, K, xd.data());
  fp8_dequantize_weights(qb.data(), sb.data(), E, N, K, wd.data());
  std::vector<bf16_t> out(M * N);
  std::vector<float> magnitude(M * N);
  cpu::fp8_grouped_gemm_reference(qa.data(), sa_SM.data(), ld_sa, qb.data(), sb.data(), offsets.data(), E,
                                  N, K, out.data(), N, magnitude.data());
  for (int e = 0; e < E; ++e) {
    for (int64_t m = offsets[e]; m < offsets[e + 1]; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double exact = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          exact += static_cast<double>(xd[m * K + k]) * wd[(e * N + n) * K + k];
        }
        // bf16 rounding (half an ulp: 2^-9 relative) plus fp32 sums of S blocks of <= 128 terms.
        const double bound = std::fabs(exact) * 0x1p-8 + magnitude[m * N + n] * 0x1p-16;
        ASSERT_LE(std::fabs(bf16_to_float(out[m * N + n]) - exact), bound) << "m " << m << " n " << n;
      }
    }
  }
}

}  // namespace
}  // namespace epmoe
