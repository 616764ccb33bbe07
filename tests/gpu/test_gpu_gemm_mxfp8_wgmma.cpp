// MXFP8 wgmma grouped GEMM (cuda/gemm/mxfp8_wgmma_gemm.h) against the CPU formula
// (cpu::row_times_nt's: each 32-element block's exact code-product sum rounded once to fp32,
// times 2^(sa + sw), summed into an fp32 total in block order) and against the decode kernel, on
// awkward shapes: K a multiple of 32 but not of 128 (1, 3, 21, 35 slices: the last stage partial;
// S not a multiple of 4: byte scale loads), K a multiple of 128 (word scale loads), N tails
// (48, 64, 136, 200: partial tiles), empty experts, 1 row, several 128-row tiles per expert
// (300, 520 rows), rows past the last group; the skip flag; the combine-slot scatter; the SwiGLU
// epilogue (F = 24 .. 100: partial 64-column tiles); repeat runs and a graph replay bitwise.
//
// Checks:
// - narrow exact block sums: activation values -3..3 (times 2^p) and weight codes in [1, 2), so
//   a block's products are multiples of 16 below 720 and its sum has at most 11 significant bits
//   above that unit: exact however the fp8 tensor-core path aligns and sums 32 products. The
//   promotion is the CPU's fp32 operation (an fma whose product is exact, or mx_block_scaled for
//   stages outside the fma band), so the output is bitwise the CPU's: with scales near 127 (fast
//   promotion), with E8M0 products from 2^-254 to 2^254 (denormal, zero and infinite results:
//   the exact path), and with a NaN scale.
// - codec-prepared random data: a block sum needs up to 41 bits and the tensor cores round it
//   their own way, so per element and over all outputs within kGemmTolerances (mxfp8, wgmma):
//   |gpu - cpu| <= 2^-7 |cpu| (a flipped bf16 rounding) + 2^-8 * sum_b 2^(sa+sw) sum_k |qa qw|
//   (an accumulation that kept 14 bits of every block's largest product would stay inside it),
//   rel-L2 <= 4e-3. With EPMOE_REPORT_ERRORS=1 it prints the outputs bitwise equal to the CPU
//   formula, the max relative error and the rel-L2 (and the same against the decode kernel).
// - the kernel choice (mxfp8_kernel_for, EPMOE_MXFP8_KERNEL) and the argument checks run without
//   a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "captured_step.h"
#include "core/activation.h"
#include "core/formats/codecs.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cuda/gemm/mxfp8_gemm.h"
#include "cuda/gemm/mxfp8_wgmma_gemm.h"
#include "cuda/mxfp8_forward.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "grouped_shape.h"
#include "mxfp8_gemm_problem.h"
#include "require_gpu.h"
#include "scoped_env.h"
#include "tolerances.h"

namespace epmoe::test {
namespace {

using mxfp8_gemm::expect_bitwise;
using mxfp8_gemm::expect_scatter_equals_plain;
using mxfp8_gemm::kUntouched;
using mxfp8_gemm::Problem;
using mxfp8_gemm::same;
using mxfp8_gemm::Shape;
using Kernel = cuda::Mxfp8Kernel;

std::vector<Shape> shapes() {
  return {
      {{4}, 0, 64, 128},                        // one stage; N below one tile
      {{0, 1, 8, 33, 70}, 5, 200, 96},          // 3 slices: one partial stage; N tail
      {{3, 0, 0, 40, 9, 1, 0, 2}, 3, 128, 32},  // one slice
      {{17, 5}, 0, 96, 672},                    // 21 slices: S % 4 == 1, byte scale loads
      {{2, 31, 32}, 1, 48, 1120},               // 35 slices; N = 48
      {{1}, 0, 136, 256},                       // 1 row; N = 136: a tile of 8 columns
      {{300, 0, 129, 1, 520}, 9, 256, 512},     // 3 and 5 row tiles per expert, 2 n-tiles
      {{0, 0, 0}, 7, 64, 256},                  // every expert empty
  };
}

// Narrow exact-sum inputs: activations -3..3 times 2^p (p from powers, one per block: the
// codec's scale follows it; codes 0, +-128, +-256, +-384), weight codes in [1, 2) of either sign
// with E8M0 scales from w_scale_codes. Products are multiples of 16 below 720.
void fill_narrow_exact(Problem& p, std::mt19937& rng, const std::vector<int>& powers,
                       const std::vector<uint8_t>& w_scale_codes) {
  std::uniform_int_distribution<int> ints(-3, 3), man(0, 7), sign(0, 1);
  std::uniform_int_distribution<size_t> pick_p(0, powers.size() - 1),
      pick_s(0, w_scale_codes.size() - 1);
  p.a.resize(static_cast<size_t>(p.M * p.K));
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t b = 0; b < p.S; ++b) {
      const int pw = powers[pick_p(rng)];
      for (int64_t k = b * kMxBlock; k < (b + 1) * kMxBlock; ++k) {
        p.a[static_cast<size_t>(m * p.K + k)] =
            float_to_bf16(std::ldexp(static_cast<float>(ints(rng)), pw));
      }
    }
  }
  p.quantize_a();
  p.w_codes.resize(static_cast<size_t>(p.E * p.N * p.K));
  for (uint8_t& v : p.w_codes) v = static_cast<uint8_t>((sign(rng) << 7) | (7 << 3) | man(rng));
  p.w_scales.resize(static_cast<size_t>(p.E * p.N * p.S));
  for (uint8_t& v : p.w_scales) v = w_scale_codes[pick_s(rng)];
}

TEST(GpuGemmMxfp8Wgmma, NarrowExactSumsBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(61);
  for (const Shape& s : shapes()) {
    Problem p(s);
    fill_narrow_exact(p, rng, {-2, 0, 3}, {120, 125, 126, 127, 128, 129, 140});
    const std::vector<bf16_t> cpu = p.run_cpu();
    expect_bitwise(cpu, p.run_gpu(Kernel::wgmma), p.N, describe(s));
    expect_bitwise(cpu, p.run_gpu(Kernel::decode), p.N, describe(s) + " (decode kernel)");
  }
}

// Scale products outside the fma band: 2^(sa + sw) from 2^-254 to 2^254 (activation blocks of
// 2^-120 .. 2^120, weight scale codes 0 .. 254): the exact path gives the CPU's denormals, zeros
// and infinities (NaN where +inf and -inf meet). Some stages stay inside the band (fast path).
TEST(GpuGemmMxfp8Wgmma, ExtremeScalesBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(62);
  for (const Shape& s : shapes()) {
    Problem p(s);
    fill_narrow_exact(p, rng, {-120, -60, 0, 60, 120}, {0, 1, 7, 20, 127, 200, 240, 250, 254});
    expect_bitwise(p.run_cpu(), p.run_gpu(Kernel::wgmma), p.N, describe(s) + " extreme scales");
  }
}

// A NaN scale (0xFF) of a weight row or of an activation block makes its outputs NaN.
TEST(GpuGemmMxfp8Wgmma, NanScaleGivesNan) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(63);
  Problem p(shapes()[3]);
  fill_narrow_exact(p, rng, {0}, {127});
  p.w_scales[static_cast<size_t>(5 * p.S + 2)] = kE8m0NaN;   // expert 0, weight row 5, block 2
  p.a_scales[static_cast<size_t>(3 * p.S + 20)] = kE8m0NaN;  // row 3, last block
  const std::vector<bf16_t> cpu = p.run_cpu(), gpu = p.run_gpu(Kernel::wgmma);
  expect_bitwise(cpu, gpu, p.N, "NaN scales");
  for (int64_t m = 0; m < p.offsets[1]; ++m) {
    EXPECT_TRUE(std::isnan(bf16_to_float(gpu[static_cast<size_t>(m * p.N + 5)]))) << "row " << m;
  }
  for (int64_t n = 0; n < p.N; ++n) {
    EXPECT_TRUE(std::isnan(bf16_to_float(gpu[static_cast<size_t>(3 * p.N + n)]))) << "col " << n;
  }
}

struct Agreement {
  size_t bitwise = 0, total = 0;
  double max_rel = 0.0, num = 0.0, den = 0.0;
  void add(bf16_t want, bf16_t got) {
    ++total;
    bitwise += want == got ? 1 : 0;
    const double w = bf16_to_float(want), g = bf16_to_float(got);
    if (w != 0.0) max_rel = std::max(max_rel, std::fabs(g - w) / std::fabs(w));
    num += (g - w) * (g - w);
    den += w * w;
  }
  double rel_l2() const { return std::sqrt(num / std::max(den, 1e-300)); }
  void print(const char* what) const {
    std::printf(
        "mxfp8 wgmma GEMM vs %s: %zu of %zu outputs bitwise, max rel error %.3g, "
        "rel-L2 %.3g\n",
        what, bitwise, total, max_rel, rel_l2());
  }
};

TEST(GpuGemmMxfp8Wgmma, CodecPreparedRandomDataWithinBound) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(65);
  const GemmTolerance* tol = gemm_tolerance(Precision::mxfp8, "wgmma");
  ASSERT_NE(tol, nullptr) << "no kGemmTolerances entry for (mxfp8, wgmma)";
  double worst = 0.0;
  Agreement vs_cpu, vs_decode;
  for (const Shape& s : shapes()) {
    Problem p(s);
    p.fill_through_codec(rng, 4.0f, true);  // scaled per expert: the scales differ
    std::vector<double> mag;
    const std::vector<bf16_t> cpu = p.run_cpu(&mag), gpu = p.run_gpu(Kernel::wgmma);
    const std::vector<bf16_t> decode = p.run_gpu(Kernel::decode);
    int shown = 0;
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (cpu[i] == kUntouched) {
        EXPECT_EQ(gpu[i], cpu[i]) << describe(s) << ": element " << i << " outside the groups";
        continue;
      }
      vs_cpu.add(cpu[i], gpu[i]);
      vs_decode.add(decode[i], gpu[i]);
      const double c = bf16_to_float(cpu[i]), g = bf16_to_float(gpu[i]);
      const double bound = tol->rel_bf16 * std::fabs(c) + tol->block_fraction * mag[i] + 1e-30;
      worst = std::max(worst, std::fabs(g - c) / bound);
      if (!(std::fabs(g - c) <= bound) && shown++ < 8) {
        ADD_FAILURE() << describe(s) << ": row " << i / static_cast<size_t>(p.N) << " col "
                      << i % static_cast<size_t>(p.N) << ": cpu " << c << ", gpu " << g
                      << ", bound " << bound;
      }
    }
  }
  EXPECT_LE(vs_cpu.rel_l2(), tol->rel_l2) << "rel-L2 of the wgmma kernel vs the CPU formula";
  if (std::getenv("EPMOE_REPORT_ERRORS") != nullptr) {
    std::printf("mxfp8 wgmma GEMM: worst |gpu - cpu| / bound %.3g\n", worst);
    vs_cpu.print("the CPU formula");
    vs_decode.print("the decode kernel");
  }
}

// The SwiGLU epilogue (gate rows [0, N/2), up rows [N/2, N); a tile holds 64 gate and their 64
// up rows): bitwise the decode kernel's fused output on exact sums (same gate and up values, the
// same device SwiGLU), and within one bf16 step of the host SwiGLU of the plain output's rounded
// values (device vs host expf); rows outside the groups untouched; plain and clamped.
TEST(GpuGemmMxfp8Wgmma, SwigluEpilogueMatchesDecodeAndPlain) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(66);
  ActivationParams clamped;
  clamped.clamped = 1;
  clamped.alpha = 1.702f;
  clamped.limit = 7.0f;
  // N = 2F with F = 24, 64, 104, 160: below a tile, one tile, a partial second tile.
  const std::vector<Shape> swiglu_shapes = {
      {{0, 1, 8, 33, 70}, 5, 48, 96},
      {{17, 5, 0}, 2, 128, 672},
      {{300, 2}, 3, 208, 256},
      {{1, 129}, 0, 320, 128},
  };
  for (const ActivationParams& act : {ActivationParams{}, clamped}) {
    for (const Shape& s : swiglu_shapes) {
      Problem p(s);
      fill_narrow_exact(p, rng, {-3, -2}, {123, 124, 125});  // gates around the knee
      const std::string what = describe(s) + (act.clamped ? " clamped" : " plain");
      const std::vector<bf16_t> plain = p.run_gpu(Kernel::wgmma),
                                fused = p.run_gpu(Kernel::wgmma, nullptr, &act);
      const std::vector<bf16_t> fused_decode = p.run_gpu(Kernel::decode, nullptr, &act);
      const int64_t F = p.N / 2;
      expect_bitwise(fused_decode, fused, F, what + ": vs the decode kernel");
      for (int64_t m = 0; m < p.M; ++m) {
        const bool in_group = m < p.offsets.back();
        for (int64_t f = 0; f < F; ++f) {
          const bf16_t got = fused[static_cast<size_t>(m * F + f)];
          if (!in_group) {
            ASSERT_EQ(got, kUntouched) << what << " row " << m;
            continue;
          }
          const float gate = bf16_to_float(plain[static_cast<size_t>(m * p.N + f)]);
          const float up = bf16_to_float(plain[static_cast<size_t>(m * p.N + F + f)]);
          const double want = bf16_to_float(float_to_bf16(swiglu_forward(gate, up, act)));
          const double g = bf16_to_float(got);
          ASSERT_LE(std::fabs(g - want), std::ldexp(std::fabs(want), -7) + 1e-30)
              << what << " row " << m << " col " << f << ": gate " << gate << " up " << up;
        }
      }
    }
  }
}

TEST(GpuGemmMxfp8Wgmma, SkipFlagLeavesTheOutputUntouched) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(67);
  Problem p(shapes()[6]);
  fill_narrow_exact(p, rng, {0}, {127});
  Dev<int32_t> skip(std::vector<int32_t>{1});
  for (bf16_t v : p.run_gpu(Kernel::wgmma, skip.ptr)) ASSERT_EQ(v, kUntouched);
}

// Rows stored into combine slots (R = 1): row m of the groups goes to slot recv_src[m] of a
// [T, K, N] buffer; the rows equal the plain output's.
TEST(GpuGemmMxfp8Wgmma, ScatterStoresEachRowInItsSlot) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(68);
  for (const Shape& s : {shapes()[4], shapes()[6]}) {
    Problem p(s);
    fill_narrow_exact(p, rng, {0, 2}, {126, 127, 128});
    expect_scatter_equals_plain(p, Kernel::wgmma, rng, describe(s));
  }
}

// Codec-prepared random data (block sums rounded by the tensor cores): the same bits on every
// run, eagerly and replayed from a CUDA graph.
TEST(GpuGemmMxfp8Wgmma, RepeatRunsAndGraphReplayBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(69);
  Problem p(shapes()[6]);
  p.fill_through_codec(rng, 1.0f, false);
  const std::vector<bf16_t> first = p.run_gpu(Kernel::wgmma);
  for (int r = 0; r < 3; ++r) {
    expect_bitwise(first, p.run_gpu(Kernel::wgmma), p.N, "run " + std::to_string(r));
  }
  Dev<uint8_t> daq(p.a_codes), das(p.a_scales), dwq(p.w_codes), dws(p.w_scales);
  Dev<int32_t> doff(p.offsets);
  Dev<bf16_t> dout(static_cast<size_t>(p.M * p.N));
  cuda::Mxfp8GroupedGemmArgs x = p.args(daq, das, dwq, dws, doff);
  x.out_MN = dout.ptr;
  x.ld_out = p.N;
  StreamGraph graph([&](cudaStream_t stream) { Problem::run(x, Kernel::wgmma, stream); },
                    [&](cudaStream_t stream) { Problem::run(x, Kernel::wgmma, stream); });
  ASSERT_EQ(cudaMemset(dout.ptr, 0xA5, dout.size * sizeof(bf16_t)), cudaSuccess);
  graph.launch();
  expect_bitwise(first, dout.get(), p.N, "graph replay");
}

TEST(GpuGemmMxfp8Wgmma, ArgumentsAreChecked) {
  cuda::Mxfp8GroupedGemmArgs x;
  x.E = 1;
  x.M = 0;
  x.N = 64;
  x.K = 48;  // not a multiple of 32
  auto expect_refused = [&](const std::string& argument, const std::string& what) {
    try {
      cuda::mxfp8_grouped_gemm_wgmma(x, nullptr);
      ADD_FAILURE() << what << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  expect_refused("K", "K = 48");
  x.K = 96;
  x.ld_out = 64;
  expect_refused("b_codes_ENK", "null weights");
  x.N = 60;
  expect_refused("N", "N = 60 (not a multiple of 8)");
  x.N = 72;
  x.swiglu = true;
  x.ld_out = 40;
  expect_refused("N", "N = 72 with swiglu (F = 36)");
  x.swiglu = false;
  x.N = 64;
  x.E = 513;
  expect_refused("E", "E = 513");
}

// The choice: wgmma from 16 rows per expert on (E <= 512), the override in both directions,
// anything else refused naming the variable. Runs without a GPU.
TEST(GpuGemmMxfp8Wgmma, KernelChoiceRuleAndOverride) {
  using cuda::Mxfp8Kernel;
  {
    ScopedEnv unset("EPMOE_MXFP8_KERNEL", nullptr);
    EXPECT_EQ(cuda::mxfp8_kernel_for(8 * 16, 8), Mxfp8Kernel::wgmma);
    EXPECT_EQ(cuda::mxfp8_kernel_for(8 * 16 - 1, 8), Mxfp8Kernel::decode);
    EXPECT_EQ(cuda::mxfp8_kernel_for(128 * 8, 128), Mxfp8Kernel::decode);   // decode T = 128, K = 8
    EXPECT_EQ(cuda::mxfp8_kernel_for(128 * 2, 8), Mxfp8Kernel::wgmma);      // mixtral decode
    EXPECT_EQ(cuda::mxfp8_kernel_for(8192 * 8, 128), Mxfp8Kernel::wgmma);   // prefill
    EXPECT_EQ(cuda::mxfp8_kernel_for(1 << 20, 1024), Mxfp8Kernel::decode);  // E past the scheduler
    EXPECT_NE(cuda::mxfp8_kernel_rule().find("16 * E"), std::string::npos)
        << cuda::mxfp8_kernel_rule();
  }
  {
    ScopedEnv automatic("EPMOE_MXFP8_KERNEL", "auto");
    EXPECT_EQ(cuda::mxfp8_kernel_for(8 * 16, 8), Mxfp8Kernel::wgmma);
  }
  {
    ScopedEnv decode("EPMOE_MXFP8_KERNEL", "decode");
    EXPECT_EQ(cuda::mxfp8_kernel_for(8192 * 8, 128), Mxfp8Kernel::decode);
    EXPECT_STREQ(cuda::to_string(cuda::mxfp8_kernel_for(8192 * 8, 128)), "decode");
  }
  {
    ScopedEnv wgmma("EPMOE_MXFP8_KERNEL", "wgmma");
    EXPECT_EQ(cuda::mxfp8_kernel_for(1, 8), Mxfp8Kernel::wgmma);
    EXPECT_STREQ(cuda::to_string(cuda::mxfp8_kernel_for(1, 8)), "wgmma");
  }
  {
    ScopedEnv bad("EPMOE_MXFP8_KERNEL", "fast");
    try {
      cuda::mxfp8_kernel_for(1, 8);
      ADD_FAILURE() << "EPMOE_MXFP8_KERNEL=fast accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "EPMOE_MXFP8_KERNEL") << e.what();
    }
  }
}

}  // namespace
}  // namespace epmoe::test
