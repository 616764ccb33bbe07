// FP8 block-scaled grouped GEMM (cuda/gemm/fp8_gemm.h) against its CPU twin
// (cpu/gemm_fp8_reference.h) on several expert counts and row distributions: empty experts, groups
// that are not a multiple of the 128-row tile, rows past the last group, N and K that are not
// multiples of 128 (partial weight-scale and k-blocks), the skip flag.
//
// Two tolerances:
// - exact blocks: E4M3 codes of the integers -3..3, so every 128-deep block sum is an integer of
//   magnitude <= 128 * 9 < 2^11, exact in fp32 and in the tensor core's reduced-precision fp8
//   accumulation, in any order. The promotion is one fma(block, sa * sb, total) per block on both
//   sides, so the outputs agree bitwise.
// - codec-quantized random data: the tensor core's fp8 accumulation keeps ~14 significant bits
//   (why the kernel promotes per 128-K block), so per element
//   |gpu - cpu| <= 2^-7 |cpu| (one bf16 rounding step apart) + 2^-8 * sum_kb |sa sb| sum_k |a b|
//   (abs_MN of the twin: the magnitude any accumulation error is relative to). A wrong scale, row
//   or block gives errors of the order of the output itself; the measured ratio is printed.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/formats/codecs.h"
#include "core/numeric.h"
#include "cpu/gemm_fp8_reference.h"
#include "cuda/formats/formats.h"
#include "cuda/gemm/fp8_gemm.h"
#include "device_buffer.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "fp8_gemm_problem.h"
#include "grouped_shape.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

std::vector<GroupedShape> shapes() {
  return {
      {{300}, 0, 128, 128},                       // one expert, 3 tiles (last partial)
      {{0, 200, 1, 130}, 5, 256, 512},            // empty expert, 1-row expert, spare rows
      {{17, 0, 0, 256, 129, 3, 0, 64}, 60, 384, 384},
      {{40, 90, 0}, 3, 200, 320},                 // N % 128 != 0, K % 128 != 0 (2.5 k-blocks)
      {{0, 0, 0}, 7, 128, 256},                   // every expert empty
  };
}

// Runs the kernel on device copies of p: the [M, N] output (rows outside the groups keep 0xA5A5).
std::vector<bf16_t> run_gpu(const Fp8GemmProblem& p, const int32_t* skip = nullptr) {
  const Fp8GemmDevice d(p);
  cuda::Fp8GroupedGemmArgs x = d.args(p);
  x.skip = skip;
  return run_rows(p, x);
}

TEST(GpuGemmFp8, ExactBlocksBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> pick(0, 6);
  for (const GroupedShape& s : shapes()) {
    Fp8GemmProblem p(s);
    p.fill([&] { return kE4m3Ints[pick(rng)]; }, rng);
    expect_bitwise(p.reference(), run_gpu(p), p.N, describe(s));
  }
}

TEST(GpuGemmFp8, CodecQuantizedRandomWithinBound) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const GroupedShape& s : shapes()) {
    Fp8GemmProblem p(s);
    // bf16 inputs quantized on the GPU by the codecs: activations with S-major scales.
    std::vector<bf16_t> x(static_cast<size_t>(p.M * p.K)), w(static_cast<size_t>(p.E * p.N * p.K));
    for (bf16_t& v : x) v = float_to_bf16(normal(rng));
    for (bf16_t& v : w) v = float_to_bf16(0.02f * normal(rng));
    {
      Dev<bf16_t> dx(x), dw(w);
      Dev<uint8_t> qa(x.size()), qb(w.size());
      Dev<float> sa(static_cast<size_t>(p.S * p.ld_sa)), sb(static_cast<size_t>(p.E * p.B * p.S));
      EXPECT_EQ(cudaMemset(sa.ptr, 0, sa.size * sizeof(float)), cudaSuccess);
      cuda::fp8_quantize_rows_s_major(dx.ptr, p.M, p.K, qa.ptr, sa.ptr, p.ld_sa, nullptr);
      cuda::fp8_quantize_weights(dw.ptr, p.E, p.N, p.K, qb.ptr, sb.ptr, nullptr);
      p.a = qa.get();
      p.b = qb.get();
      p.sa_SM = sa.get();
      p.sb = sb.get();
    }
    std::vector<float> magnitude;
    const std::vector<bf16_t> cpu = p.reference(&magnitude);
    const std::vector<bf16_t> gpu = run_gpu(p);
    double worst_ratio = 0.0, err2 = 0.0, ref2 = 0.0;
    int shown = 0;
    for (int e = 0; e < p.E; ++e) {
      for (int64_t m = p.offsets[e]; m < p.offsets[e + 1]; ++m) {
        for (int64_t n = 0; n < p.N; ++n) {
          const size_t i = static_cast<size_t>(m * p.N + n);
          const double c = bf16_to_float(cpu[i]), g = bf16_to_float(gpu[i]);
          const double err = std::fabs(g - c), mag = magnitude[i];
          err2 += err * err;
          ref2 += c * c;
          if (mag > 0) worst_ratio = std::max(worst_ratio, std::max(0.0, err - std::fabs(c) * 0x1p-7) / mag);
          if (!(err <= std::fabs(c) * 0x1p-7 + mag * 0x1p-8) && shown++ < 8) {
            ADD_FAILURE() << describe(s) << ": row " << m << " col " << n << ": cpu " << c << ", gpu " << g
                          << ", magnitude " << mag;
          }
        }
      }
    }
    for (int64_t m = p.offsets[p.E]; m < p.M; ++m) {  // rows past the groups: untouched
      for (int64_t n = 0; n < p.N; ++n) ASSERT_EQ(gpu[static_cast<size_t>(m * p.N + n)], 0xA5A5) << m;
    }
    const double rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
    std::printf("%s: rel-L2 %.3g, worst (err - bf16 step) / magnitude %.3g\n", describe(s).c_str(), rel_l2,
                worst_ratio);
    EXPECT_LE(rel_l2, 1e-2) << describe(s);
  }
}

TEST(GpuGemmFp8, SkipFlagLeavesOutputUntouched) {
  EPMOE_REQUIRE_GPU();
  Fp8GemmProblem p(shapes()[1]);
  p.a.assign(static_cast<size_t>(p.M * p.K), 0x38);
  p.b.assign(static_cast<size_t>(p.E * p.N * p.K), 0x38);
  p.sa_SM.assign(static_cast<size_t>(p.S * p.ld_sa), 1.0f);
  p.sb.assign(static_cast<size_t>(p.E * p.B * p.S), 1.0f);
  Dev<int32_t> skip(std::vector<int32_t>{1});
  for (bf16_t v : run_gpu(p, skip.ptr)) ASSERT_EQ(v, 0xA5A5);
}

TEST(GpuGemmFp8, ScalesSMajorEqualRowMajor) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t N = 37, L = 300, S = 3, ld = 40;
  std::vector<bf16_t> x(static_cast<size_t>(N * L));
  for (bf16_t& v : x) v = float_to_bf16(normal(rng));
  Dev<bf16_t> dx(x);
  Dev<uint8_t> q1(x.size()), q2(x.size());
  Dev<float> s_NS(static_cast<size_t>(N * S)), s_SN(static_cast<size_t>(S * ld));
  cuda::fp8_quantize_rows(dx.ptr, N, L, q1.ptr, s_NS.ptr, nullptr);
  cuda::fp8_quantize_rows_s_major(dx.ptr, N, L, q2.ptr, s_SN.ptr, ld, nullptr);
  EXPECT_EQ(q1.get(), q2.get());
  const std::vector<float> a = s_NS.get(), b = s_SN.get();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t s = 0; s < S; ++s) ASSERT_EQ(a[n * S + s], b[s * ld + n]) << n << " " << s;
  }
}

// Host checks only: they run before any CUDA call, so without a GPU too.
TEST(GpuGemmFp8, ArgumentErrorsNameTheField) {
  cuda::Fp8GroupedGemmArgs args;
  args.E = 2;
  args.M = 0;
  args.N = 128;
  args.K = 100;  // not a multiple of 16
  args.ld_out = 128;
  auto field_of = [&]() -> std::string {
    try {
      cuda::fp8_grouped_gemm(args, nullptr);
    } catch (const Error& e) {
      return e.argument();
    }
    return "";
  };
  EXPECT_EQ(field_of(), "K");
  args.K = 128;
  args.N = 100;
  EXPECT_EQ(field_of(), "N");
  args.N = 128;
  args.E = 0;
  EXPECT_EQ(field_of(), "E");
  args.E = 2;
  args.ld_a_scales = 2;
  args.M = 3;
  EXPECT_EQ(field_of(), "ld_a_scales");
}

}  // namespace
}  // namespace epmoe::test
