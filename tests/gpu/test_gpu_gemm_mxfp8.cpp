// MXFP8 grouped GEMM (cuda/gemm/mxfp8_gemm.h) against the CPU formula (cpu::row_times_nt's:
// each 32-element block's exact code-product sum rounded once to fp32, times 2^(sa + sw), summed
// into an fp32 total in block order), on awkward shapes: K a multiple of 32 but not of 128 (one
// block, 3 blocks, 21 and 35 blocks past the kernel's 4-block steps), empty experts, rows not a
// multiple of 8 (1 .. 70 rows, several 32-row passes), rows past the last group, N not a multiple
// of 16 or 64; the skip flag; rows stored into combine slots; the SwiGLU epilogue.
//
// Activations are quantized by the host codec here (the forward quantizes on the device with the
// CUDA codec, bitwise the host's: test_gpu_formats), weights are codes and scales as given.
// Checks:
// - exact block sums: activation values -3..3 (times 2^p), weight codes of magnitude >= 1/8, so
//   every product is a multiple of 2 and a block's sum of magnitudes is below 2^23: exact in fp32
//   in any order. The scaling and the block-order total are the CPU's fp32 operations, so the
//   output is bitwise the CPU's, also with extreme E8M0 scales whose product leaves fp32's normal
//   range (denormal, zero, infinity: ldexp's one rounding on both sides).
// - the test's formula equals cpu::row_times_nt (fp32 bits), tying the GPU to the CPU backend.
// - random data (codec-prepared weights and activations): a block's exact sum may need more than
//   24 bits, then the tensor cores round it their own way: per element |gpu - cpu| <= 2^-7 |cpu|
//   (a flipped bf16 rounding) + 2^-16 * sum_b 2^(sa+sw) sum_k |qa qw| (a few fp32 ulps of each
//   block's magnitude; generous). The worst ratio to the bound is printed with
//   EPMOE_REPORT_ERRORS=1.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/activation.h"
#include "core/formats/codecs.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cpu/cpu_backend.h"
#include "cuda/gemm/mxfp8_gemm.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "grouped_shape.h"
#include "mxfp8_gemm_problem.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

using mxfp8_gemm::expect_bitwise;
using mxfp8_gemm::expect_scatter_equals_plain;
using mxfp8_gemm::kUntouched;
using mxfp8_gemm::Problem;
using mxfp8_gemm::same;
using mxfp8_gemm::Shape;
constexpr cuda::Mxfp8Kernel kDecode = cuda::Mxfp8Kernel::decode;

std::vector<Shape> shapes() {
  return {
      {{4}, 0, 64, 128},                         // one 4-block step, one group
      {{0, 1, 8, 33, 70}, 5, 200, 96},           // N % 16 != 0; 3 blocks: single steps only
      {{3, 0, 0, 40, 9, 1, 0, 2}, 3, 128, 32},   // one block
      {{17, 5}, 0, 96, 672},                     // 21 blocks: 5 steps of 4 + 1
      {{2, 31, 32}, 1, 48, 1120},                // 35 blocks: 8 steps of 4 + 3
      {{0, 0, 0}, 7, 64, 256},                   // every expert empty
  };
}

// An E4M3 code of magnitude >= 1/8 (exponent field 4 .. 15, not NaN), either sign.
uint8_t coarse_code(std::mt19937& rng) {
  std::uniform_int_distribution<int> exp(4, 15), man(0, 7), sign(0, 1);
  int e = exp(rng), m = man(rng);
  if (e == 15 && m == 7) m = 6;
  return static_cast<uint8_t>((sign(rng) << 7) | (e << 3) | m);
}

// Exact-sum inputs: activations -3..3 times 2^p (p from powers), weight codes of magnitude
// >= 1/8 with E8M0 scales from w_scale_codes.
void fill_exact(Problem& p, std::mt19937& rng, const std::vector<int>& powers,
                const std::vector<uint8_t>& w_scale_codes) {
  std::uniform_int_distribution<int> ints(-3, 3);
  std::uniform_int_distribution<size_t> pick_p(0, powers.size() - 1),
      pick_s(0, w_scale_codes.size() - 1);
  p.a.resize(static_cast<size_t>(p.M * p.K));
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t b = 0; b < p.S; ++b) {  // one power per block: the codec's scale follows it
      const int pw = powers[pick_p(rng)];
      for (int64_t k = b * kMxBlock; k < (b + 1) * kMxBlock; ++k) {
        p.a[static_cast<size_t>(m * p.K + k)] =
            float_to_bf16(std::ldexp(static_cast<float>(ints(rng)), pw));
      }
    }
  }
  p.quantize_a();
  p.w_codes.resize(static_cast<size_t>(p.E * p.N * p.K));
  for (uint8_t& v : p.w_codes) v = coarse_code(rng);
  p.w_scales.resize(static_cast<size_t>(p.E * p.N * p.S));
  for (uint8_t& v : p.w_scales) v = w_scale_codes[pick_s(rng)];
}

TEST(GpuGemmMxfp8, ExactSumsBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(31);
  for (const Shape& s : shapes()) {
    Problem p(s);
    fill_exact(p, rng, {-2, 0, 3}, {125, 126, 127, 128, 129});
    expect_bitwise(p.run_cpu(), p.run_gpu(kDecode), p.N, describe(s));
  }
}

// Scale products outside fp32's normal range: 2^(sa + sw) from 2^-254 to 2^254 (activation
// blocks of 2^-120 .. 2^120, weight scale codes 0 .. 254): the results underflow to denormals or
// zero and overflow to infinity (NaN where +inf and -inf meet) exactly as the CPU's ldexp does.
TEST(GpuGemmMxfp8, ExtremeScalesBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(32);
  for (const Shape& s : shapes()) {
    Problem p(s);
    fill_exact(p, rng, {-120, -60, 0, 60, 120}, {0, 1, 7, 20, 127, 200, 240, 250, 254});
    expect_bitwise(p.run_cpu(), p.run_gpu(kDecode), p.N, describe(s) + " extreme scales");
  }
}

// A NaN scale (0xFF) makes its block, and so its outputs, NaN on both sides.
TEST(GpuGemmMxfp8, NanScaleGivesNan) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(33);
  Problem p(shapes()[3]);
  fill_exact(p, rng, {0}, {127});
  p.w_scales[static_cast<size_t>(5 * p.S + 2)] = kE8m0NaN;  // expert 0, weight row 5, block 2
  const std::vector<bf16_t> cpu = p.run_cpu(), gpu = p.run_gpu(kDecode);
  expect_bitwise(cpu, gpu, p.N, "NaN weight scale");
  for (int64_t m = 0; m < p.offsets[1]; ++m) {
    EXPECT_TRUE(std::isnan(bf16_to_float(gpu[static_cast<size_t>(m * p.N + 5)]))) << "row " << m;
  }
}

// The test's formula is cpu::row_times_nt's (the CPU backend's MXFP8 GEMM), to the fp32 bit.
TEST(GpuGemmMxfp8, FormulaIsTheCpuBackends) {
  std::mt19937 rng(34);
  Problem p(shapes()[4]);
  p.fill_through_codec(rng, 1.0f, false);
  const std::vector<float> f = p.formula();
  std::vector<float> row(static_cast<size_t>(p.N));
  for (int e = 0; e < p.E; ++e) {
    cpu::Mxfp8Expert x;
    x.N = p.N;
    x.L = p.K;
    x.v_NL.resize(static_cast<size_t>(p.N * p.K));
    for (int64_t i = 0; i < p.N * p.K; ++i) {
      const size_t code = static_cast<size_t>(e * p.N * p.K + i);
      x.v_NL[static_cast<size_t>(i)] = e4m3_to_float(p.w_codes[code]);
    }
    x.scales_NS = p.w_scales.data() + e * p.N * p.S;
    for (int64_t m = p.offsets[static_cast<size_t>(e)]; m < p.offsets[static_cast<size_t>(e) + 1];
         ++m) {
      cpu::row_times_nt(p.a.data() + m * p.K, &x, p.N, p.K, row.data());
      for (int64_t n = 0; n < p.N; ++n) {
        ASSERT_EQ(f32_bits(row[static_cast<size_t>(n)]),
                  f32_bits(f[static_cast<size_t>(m * p.N + n)]))
            << "expert " << e << " row " << m << " col " << n;
      }
    }
  }
}

TEST(GpuGemmMxfp8, CodecPreparedRandomDataWithinBound) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(35);
  double worst = 0.0;
  size_t bitwise = 0, total = 0;
  for (const Shape& s : shapes()) {
    Problem p(s);
    p.fill_through_codec(rng, 4.0f, true);  // scaled per expert: the scales differ
    std::vector<double> mag;
    const std::vector<bf16_t> cpu = p.run_cpu(&mag), gpu = p.run_gpu(kDecode);
    int shown = 0;
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (cpu[i] == kUntouched) {
        EXPECT_EQ(gpu[i], cpu[i]) << describe(s) << ": element " << i << " outside the groups";
        continue;
      }
      ++total;
      bitwise += cpu[i] == gpu[i] ? 1 : 0;
      const double c = bf16_to_float(cpu[i]), g = bf16_to_float(gpu[i]);
      const double bound = std::ldexp(std::fabs(c), -7) + std::ldexp(mag[i], -16) + 1e-30;
      worst = std::max(worst, std::fabs(g - c) / bound);
      if (!(std::fabs(g - c) <= bound) && shown++ < 8) {
        ADD_FAILURE() << describe(s) << ": row " << i / static_cast<size_t>(p.N) << " col "
                      << i % static_cast<size_t>(p.N) << ": cpu " << c << ", gpu " << g
                      << ", bound " << bound;
      }
    }
  }
  if (std::getenv("EPMOE_REPORT_ERRORS") != nullptr) {
    std::printf("mxfp8 GEMM: worst |gpu - cpu| / bound %.3g; %zu of %zu outputs bitwise\n", worst,
                bitwise, total);
  }
}

// The SwiGLU epilogue (gate rows [0, N/2), up rows [N/2, N)) against the host SwiGLU of the plain
// output's rounded values: equal up to the device / host expf difference (one bf16 rounding
// step), rows outside the groups untouched; plain and clamped.
TEST(GpuGemmMxfp8, SwigluEpilogueMatchesThePlainOutputsSwiglu) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(36);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  ActivationParams clamped;
  clamped.clamped = 1;
  clamped.alpha = 1.702f;
  clamped.limit = 7.0f;
  for (const ActivationParams& act : {ActivationParams{}, clamped}) {
    for (const Shape& s : shapes()) {
      Problem p(s);
      fill_exact(p, rng, {0}, {127});
      for (bf16_t& v : p.a) v = float_to_bf16(0.05f * normal(rng));  // gates around the knee
      p.quantize_a();
      const std::vector<bf16_t> plain = p.run_gpu(kDecode),
                                fused = p.run_gpu(kDecode, nullptr, &act);
      const int64_t F = p.N / 2;
      for (int64_t m = 0; m < p.M; ++m) {
        const bool in_group = m < p.offsets.back();
        for (int64_t f = 0; f < F; ++f) {
          const bf16_t got = fused[static_cast<size_t>(m * F + f)];
          if (!in_group) {
            ASSERT_EQ(got, kUntouched) << describe(s) << " row " << m;
            continue;
          }
          const float gate = bf16_to_float(plain[static_cast<size_t>(m * p.N + f)]);
          const float up = bf16_to_float(plain[static_cast<size_t>(m * p.N + F + f)]);
          const double want = bf16_to_float(float_to_bf16(swiglu_forward(gate, up, act)));
          const double g = bf16_to_float(got);
          ASSERT_LE(std::fabs(g - want), std::ldexp(std::fabs(want), -7) + 1e-30)
              << describe(s) << (act.clamped ? " clamped" : " plain") << " row " << m << " col "
              << f << ": gate " << gate << " up " << up;
        }
      }
    }
  }
}

TEST(GpuGemmMxfp8, SkipFlagLeavesTheOutputUntouched) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(37);
  Problem p(shapes()[1]);
  fill_exact(p, rng, {0}, {127});
  Dev<int32_t> skip(std::vector<int32_t>{1});
  for (bf16_t v : p.run_gpu(kDecode, skip.ptr)) ASSERT_EQ(v, kUntouched);
}

// Rows stored into combine slots (R = 1): row m of the groups goes to slot recv_src[m] of a
// [T, K, N] buffer; the rows equal the plain output's.
TEST(GpuGemmMxfp8, ScatterStoresEachRowInItsSlot) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(38);
  Problem p(shapes()[4]);
  fill_exact(p, rng, {0, 2}, {126, 127, 128});
  expect_scatter_equals_plain(p, kDecode, rng, describe(shapes()[4]));
}

TEST(GpuGemmMxfp8, ArgumentsAreChecked) {
  cuda::Mxfp8GroupedGemmArgs x;
  x.E = 1;
  x.M = 0;
  x.N = 64;
  x.K = 48;  // not a multiple of 32
  try {
    cuda::mxfp8_grouped_gemm(x, nullptr);
    ADD_FAILURE() << "K = 48 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "K") << e.what();
  }
  x.K = 96;
  x.ld_out = 64;
  try {
    cuda::mxfp8_grouped_gemm(x, nullptr);
    ADD_FAILURE() << "null weights accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "b_codes_ENK") << e.what();
  }
  x.swiglu = true;
  x.N = 63;
  try {
    cuda::mxfp8_grouped_gemm(x, nullptr);
    ADD_FAILURE() << "odd N accepted with swiglu";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "N") << e.what();
  }
}

}  // namespace
}  // namespace epmoe::test
