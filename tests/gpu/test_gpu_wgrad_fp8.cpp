// FP8 weight gradient (cuda/gemm/fp8_wgrad.h) against its CPU twin (cpu::fp8_wgrad_expert_reference
// on the codes before their transpose, cpu::fp8_transpose_cols): experts of 0, 1, 127, 128, 129
// and 300 rows (empty, partial and whole 128-row blocks), rows past the last expert, N and L
// multiples of 128 and not; f32 and bf16 outputs, overwritten and accumulated; the skip flag;
// CTA pairs multicasting B against single CTAs (bitwise).
//
// Two tolerances, as the FP8 grouped GEMM's test (test_gpu_gemm_fp8.cpp):
// - exact blocks: E4M3 codes of the integers -3..3, so every 128-row block sum is an integer of
//   magnitude <= 128 * 9 < 2^11, exact in the tensor core's reduced-precision fp8 accumulation in
//   any order; the promotion is one fma(block, sa * sb, total) per block on both sides, ascending
//   blocks, so the outputs agree bitwise (f32 and bf16, overwritten or accumulated).
// - column-quantized random data (the quantizer of the backward): per element
//   |gpu - cpu| <= 2^-8 * sum_b |sa sb| sum_m |a b| (the magnitude any accumulation error is
//   relative to; the tensor core keeps ~14 significant bits in a block). The ratio is printed.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/formats/e4m3.h"
#include "core/fp8_terms.h"
#include "core/numeric.h"
#include "cpu/fp8_steps.h"
#include "cpu/gemm_reference.h"
#include "cuda/formats/formats.h"
#include "cuda/gemm/fp8_wgrad.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "grouped_shape.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

struct Shape {
  std::vector<int32_t> rows_E;  // rows per expert
  int64_t spare_rows;           // capacity past the last expert
  int64_t N, L;
};

std::string describe(const Shape& s) {
  return describe_rows(s.rows_E) + "N " + std::to_string(s.N) + " L " + std::to_string(s.L);
}

std::vector<Shape> shapes() {
  const std::vector<int32_t> awkward = {0, 1, 127, 128, 129, 300};
  return {
      {awkward, 5, 128, 128},
      {awkward, 0, 256, 384},
      {awkward, 3, 144, 208},                // N, L not multiples of 128 (partial tiles)
      {{300, 0, 129}, 0, 48, 16},            // one partial tile each way
      {{0, 0, 0}, 7, 128, 256},              // every expert empty
  };
}

// One problem: the column-quantized operands in the CPU layout (codes [M, N] and [M, L], scales
// [blocks, N] and [blocks, L]) and the transposed codes the kernel reads.
struct Problem {
  Shape shape;
  int E = 0;
  int64_t M = 0, N = 0, L = 0, K = 0, max_blocks = 0;
  std::vector<int32_t> offsets;
  std::vector<uint8_t> a_MN, b_ML;
  std::vector<float> sa_BN, sb_BL;

  explicit Problem(const Shape& s) : shape(s) {
    E = static_cast<int>(s.rows_E.size());
    N = s.N;
    L = s.L;
    offsets = group_offsets(s.rows_E);
    M = offsets.back() + s.spare_rows;
    max_blocks = fp8_col_blocks(M, E);
    K = fp8_col_k(M, E);
  }

  // CPU: per expert, the fp32 sum stored as the dtype says into out (the initial contents).
  template <class T>
  std::vector<T> run_cpu(std::vector<T> out, DType dtype, bool accumulate) const {
    std::vector<float> acc(static_cast<size_t>(N * L));
    for (int e = 0; e < E; ++e) {
      cpu::fp8_wgrad_expert_reference(a_MN.data(), sa_BN.data(), N, b_ML.data(), sb_BL.data(), L,
                                      offsets.data(), e, acc.data());
      cpu::store_wgrad(acc.data(), N * L, out.data() + static_cast<size_t>(e) * N * L, dtype,
                       accumulate);
    }
    return out;
  }

  // GPU: the kernel on the transposed codes (0xA5 past the used blocks: never read).
  template <class T>
  std::vector<T> run_gpu(const std::vector<T>& initial, DType dtype, bool accumulate,
                         const int32_t* skip = nullptr, int overlap = -1, int multicast = -1,
                         int stage_scales = -1, int tile = -1) const {
    std::vector<uint8_t> at(static_cast<size_t>(N * K), 0xA5), bt(static_cast<size_t>(L * K), 0xA5);
    cpu::fp8_transpose_cols(a_MN.data(), N, offsets.data(), E, K, at.data());
    cpu::fp8_transpose_cols(b_ML.data(), L, offsets.data(), E, K, bt.data());
    Dev<uint8_t> da(at), db(bt);
    Dev<float> dsa(sa_BN), dsb(sb_BL);
    Dev<int32_t> doff(offsets);
    Dev<T> dout(initial);
    cuda::Fp8WgradArgs args;
    args.a_NK = da.ptr;
    args.a_scales_BN = dsa.ptr;
    args.b_LK = db.ptr;
    args.b_scales_BL = dsb.ptr;
    args.offsets_E1 = doff.ptr;
    args.skip = skip;
    args.E = E;
    args.N = N;
    args.L = L;
    args.K = K;
    args.out_ENL = dout.ptr;
    args.out_dtype = dtype;
    args.accumulate = accumulate;
    args.overlap = overlap;
    args.multicast = multicast;
    args.stage_scales = stage_scales;
    args.tile = tile;
    cuda::fp8_grouped_wgrad(args, nullptr);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    return dout.get();
  }
};

template <class T>
uint32_t bits(T v) {
  uint32_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

template <class T>
void expect_bitwise(const std::vector<T>& cpu, const std::vector<T>& gpu, int64_t N, int64_t L,
                    const std::string& what) {
  ASSERT_EQ(cpu.size(), gpu.size()) << what;
  int shown = 0;
  size_t differ = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (bits(cpu[i]) == bits(gpu[i])) continue;
    ++differ;
    if (shown++ < 8) {
      const int64_t e = static_cast<int64_t>(i) / (N * L), r = static_cast<int64_t>(i) % (N * L);
      ADD_FAILURE() << what << ": expert " << e << " n " << r / L << " l " << r % L << ": cpu 0x"
                    << std::hex << bits(cpu[i]) << ", gpu 0x" << bits(gpu[i]) << std::dec;
    }
  }
  EXPECT_EQ(differ, 0u) << what;
}

// code() at the expert rows (0 elsewhere), scales in [0.01, 3].
template <class Code>
void fill_codes(Problem& p, std::mt19937& rng, Code&& code) {
  std::uniform_real_distribution<float> scale(0.01f, 3.0f);
  p.a_MN.assign(static_cast<size_t>(p.M * p.N), 0);
  p.b_ML.assign(static_cast<size_t>(p.M * p.L), 0);
  for (int64_t i = 0; i < p.offsets.back() * p.N; ++i) p.a_MN[static_cast<size_t>(i)] = code();
  for (int64_t i = 0; i < p.offsets.back() * p.L; ++i) p.b_ML[static_cast<size_t>(i)] = code();
  p.sa_BN.resize(static_cast<size_t>(p.max_blocks * p.N));
  p.sb_BL.resize(static_cast<size_t>(p.max_blocks * p.L));
  for (float& v : p.sa_BN) v = scale(rng);
  for (float& v : p.sb_BL) v = scale(rng);
}

// Integer codes -3..3 at the expert rows (0 elsewhere), scales in [0.01, 3].
void fill_exact(Problem& p, std::mt19937& rng) {
  const uint8_t kInts[7] = {0xC8, 0xC0, 0xB8, 0x00, 0x38, 0x40, 0x48};  // e4m3 -3 -2 -1 0 1 2 3
  std::uniform_int_distribution<int> pick(0, 6);
  fill_codes(p, rng, [&] { return kInts[pick(rng)]; });
}

// Random finite E4M3 codes at the expert rows, scales in [0.01, 3].
void fill_random(Problem& p, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  fill_codes(p, rng, [&]() -> uint8_t {
    for (;;) {
      const uint8_t v = static_cast<uint8_t>(byte(rng));
      if ((v & 0x7F) != 0x7F) return v;  // 0x7F / 0xFF: NaN
    }
  });
}

// The previous contents of the gradient for accumulation: random values in [-1, 1] as f32 and
// their bf16 roundings.
struct PriorGradients {
  std::vector<float> f32;
  std::vector<bf16_t> bf16;
};
PriorGradients prior_gradients(const Problem& p, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  const size_t n = static_cast<size_t>(p.E * p.N * p.L);
  PriorGradients g{std::vector<float>(n), std::vector<bf16_t>(n)};
  for (size_t i = 0; i < n; ++i) {
    g.f32[i] = value(rng);
    g.bf16[i] = float_to_bf16(g.f32[i]);
  }
  return g;
}

// The argument named by the error run() throws with the variable `name` set to `value` (empty
// when it throws none); the variable is unset afterwards.
template <class Run>
std::string error_field_with_env(const char* name, const char* value, Run run) {
  setenv(name, value, 1);
  std::string field;
  try {
    run();
  } catch (const Error& e) {
    field = e.argument();
  }
  unsetenv(name);
  return field;
}

// bf16 overwritten: run(p, stale, skip, choice) with choice 0 (the reference) and 1 (the variant)
// gives the same bits on random finite codes of each case; the variant writes zeros under the skip
// flag; at choice -1 the variable `name` = `value` is read (the same bits) and `bad` is refused,
// the error naming the variable.
template <class Run>
void expect_variant_bitwise(std::mt19937& rng, const std::vector<Shape>& cases, const std::string& what,
                            Run run, const char* name, const char* value, const char* bad) {
  for (const Shape& c : cases) {
    Problem p(c);
    fill_random(p, rng);
    const std::vector<bf16_t> stale(static_cast<size_t>(p.E * p.N * p.L), static_cast<bf16_t>(0xA5A5));
    const std::vector<bf16_t> reference = run(p, stale, nullptr, 0);
    EXPECT_FALSE(reference == stale) << describe(c);  // the kernel wrote
    expect_bitwise(reference, run(p, stale, nullptr, 1), p.N, p.L, what + " " + describe(c));
    std::printf("%s: %s, the same bits\n", describe(c).c_str(), what.c_str());
  }
  Problem p(cases[1]);
  fill_random(p, rng);
  const std::vector<bf16_t> stale(static_cast<size_t>(p.E * p.N * p.L), static_cast<bf16_t>(0x4040));
  Dev<int32_t> skip(std::vector<int32_t>{1});
  for (bf16_t v : run(p, stale, skip.ptr, 1)) ASSERT_EQ(v, 0);
  const std::vector<bf16_t> reference = run(p, stale, nullptr, 0);
  setenv(name, value, 1);
  const std::vector<bf16_t> from_env = run(p, stale, nullptr, -1);
  unsetenv(name);
  expect_bitwise(reference, from_env, p.N, p.L, std::string(name) + "=" + value);
  EXPECT_EQ(error_field_with_env(name, bad, [&] { run(p, stale, nullptr, -1); }), name);
}

TEST(GpuWgradFp8, ExactBlocksBitwiseF32) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(21);
  std::normal_distribution<float> prior(0.0f, 100.0f);
  for (const Shape& s : shapes()) {
    Problem p(s);
    fill_exact(p, rng);
    const size_t n = static_cast<size_t>(p.E * p.N * p.L);
    std::vector<float> stale(n);
    std::memset(stale.data(), 0xA5, n * sizeof(float));  // overwrite: every element written
    expect_bitwise(p.run_cpu(stale, DType::f32, false), p.run_gpu(stale, DType::f32, false),
                   p.N, p.L, describe(s) + " f32 overwrite");
    std::vector<float> grad(n);
    for (float& v : grad) v = prior(rng);
    expect_bitwise(p.run_cpu(grad, DType::f32, true), p.run_gpu(grad, DType::f32, true), p.N, p.L,
                   describe(s) + " f32 accumulate");
  }
}

TEST(GpuWgradFp8, ExactBlocksBitwiseBf16) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(22);
  std::normal_distribution<float> prior(0.0f, 100.0f);
  for (const Shape& s : shapes()) {
    Problem p(s);
    fill_exact(p, rng);
    const size_t n = static_cast<size_t>(p.E * p.N * p.L);
    const std::vector<bf16_t> stale(n, static_cast<bf16_t>(0xA5A5));
    // Overwritten bf16 goes through the TMA-store epilogue, accumulated through the stage.
    expect_bitwise(p.run_cpu(stale, DType::bf16, false), p.run_gpu(stale, DType::bf16, false),
                   p.N, p.L, describe(s) + " bf16 overwrite");
    std::vector<bf16_t> grad(n);
    for (bf16_t& v : grad) v = float_to_bf16(prior(rng));
    expect_bitwise(p.run_cpu(grad, DType::bf16, true), p.run_gpu(grad, DType::bf16, true), p.N,
                   p.L, describe(s) + " bf16 accumulate");
  }
}

// bf16 operands quantized by the backward's quantizer on the device (transposed codes), the
// CPU twin on the CPU quantizer's codes (bitwise the same: test_gpu_fp8_steps).
TEST(GpuWgradFp8, ColumnQuantizedRandomWithinBound) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Shape& s : shapes()) {
    Problem p(s);
    std::vector<bf16_t> a(static_cast<size_t>(p.M * p.N)), b(static_cast<size_t>(p.M * p.L));
    for (bf16_t& v : a) v = float_to_bf16(normal(rng));
    for (bf16_t& v : b) v = float_to_bf16(0.1f * normal(rng));
    std::vector<float> af(a.size()), bf(b.size());
    for (size_t i = 0; i < a.size(); ++i) af[i] = bf16_to_float(a[i]);
    for (size_t i = 0; i < b.size(); ++i) bf[i] = bf16_to_float(b[i]);
    p.a_MN.assign(a.size(), 0);
    p.b_ML.assign(b.size(), 0);
    p.sa_BN.assign(static_cast<size_t>(p.max_blocks * p.N), 0.0f);
    p.sb_BL.assign(static_cast<size_t>(p.max_blocks * p.L), 0.0f);
    cpu::fp8_quantize_cols(af.data(), p.N, p.offsets.data(), p.E, p.a_MN.data(), p.sa_BN.data());
    cpu::fp8_quantize_cols(bf.data(), p.L, p.offsets.data(), p.E, p.b_ML.data(), p.sb_BL.data());
    const size_t n = static_cast<size_t>(p.E * p.N * p.L);
    const std::vector<float> cpu = p.run_cpu(std::vector<float>(n, 0.0f), DType::f32, false);
    // The device path: quantizer (transposed) then the kernel, as the backward runs them.
    std::vector<float> gpu;
    {
      Dev<bf16_t> da(a), db(b);
      Dev<int32_t> doff(p.offsets);
      Dev<uint8_t> qa(static_cast<size_t>(p.N * p.K)), qb(static_cast<size_t>(p.L * p.K));
      Dev<float> sa(p.sa_BN.size()), sb(p.sb_BL.size());
      Dev<float> out(n);
      cuda::fp8_quantize_cols_transposed(da.ptr, p.M, p.N, doff.ptr, p.E, nullptr, qa.ptr, sa.ptr,
                                         p.max_blocks, nullptr);
      cuda::fp8_quantize_cols_transposed(db.ptr, p.M, p.L, doff.ptr, p.E, nullptr, qb.ptr, sb.ptr,
                                         p.max_blocks, nullptr);
      cuda::Fp8WgradArgs args;
      args.a_NK = qa.ptr;
      args.a_scales_BN = sa.ptr;
      args.b_LK = qb.ptr;
      args.b_scales_BL = sb.ptr;
      args.offsets_E1 = doff.ptr;
      args.E = p.E;
      args.N = p.N;
      args.L = p.L;
      args.K = p.K;
      args.out_ENL = out.ptr;
      args.out_dtype = DType::f32;
      cuda::fp8_grouped_wgrad(args, nullptr);
      EXPECT_EQ(cudaGetLastError(), cudaSuccess);
      gpu = out.get();
    }
    double worst_ratio = 0.0, err2 = 0.0, ref2 = 0.0;
    int shown = 0;
    for (int e = 0; e < p.E; ++e) {
      const int64_t b0 = cpu::fp8_col_block_base(p.offsets.data(), e);
      for (int64_t i = 0; i < p.N; ++i) {
        for (int64_t j = 0; j < p.L; ++j) {
          double magnitude = 0.0;
          int64_t blk = b0;
          for (int64_t m0 = p.offsets[e]; m0 < p.offsets[e + 1]; m0 += 128, ++blk) {
            const int64_t m1 = std::min<int64_t>(m0 + 128, p.offsets[e + 1]);
            double block_abs = 0.0;
            for (int64_t m = m0; m < m1; ++m) {
              block_abs += std::fabs(static_cast<double>(e4m3_to_float(p.a_MN[m * p.N + i])) *
                                     e4m3_to_float(p.b_ML[m * p.L + j]));
            }
            magnitude += block_abs * std::fabs(static_cast<double>(p.sa_BN[blk * p.N + i]) *
                                               p.sb_BL[blk * p.L + j]);
          }
          const size_t k = static_cast<size_t>((e * p.N + i) * p.L + j);
          const double c = cpu[k], g = gpu[k], err = std::fabs(g - c);
          err2 += err * err;
          ref2 += c * c;
          if (magnitude > 0) worst_ratio = std::max(worst_ratio, err / magnitude);
          if (!(err <= magnitude * 0x1p-8) && shown++ < 8) {
            ADD_FAILURE() << describe(s) << ": expert " << e << " n " << i << " l " << j << ": cpu "
                          << c << ", gpu " << g << ", magnitude " << magnitude;
          }
        }
      }
    }
    const double rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
    std::printf("%s: rel-L2 %.3g, worst err / magnitude %.3g\n", describe(s).c_str(), rel_l2,
                worst_ratio);
    EXPECT_LE(rel_l2, 1e-2) << describe(s);
  }
}

// The two main loops (Fp8WgradArgs::overlap 0 / 1) are bitwise equal on random finite E4M3 codes
// (the fp8 accumulation rounds): experts of 0 to 16 column blocks (odd, even, one), more tiles than
// SMs (the scales' prefetch across tiles), f32 and bf16 outputs through the stage, overwritten and
// accumulated. (bf16 overwritten, the TMA-store epilogue, runs with one accumulator either way.)
TEST(GpuWgradFp8, OverlapLoopBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(25);
  const std::vector<Shape> cases = {
      {{129, 0, 300, 1, 128, 127, 700}, 5, 384, 1024},  // 2, 0, 3, 1, 1, 1, 6 blocks; 168 tiles
      {{2048, 3}, 0, 256, 2880},                          // 16 blocks and 1
  };
  for (const Shape& c : cases) {
    Problem p(c);
    fill_random(p, rng);
    const PriorGradients prior = prior_gradients(p, rng);
    for (const bool accumulate : {false, true}) {
      const std::string what = describe(c) + (accumulate ? " accumulate" : " overwrite");
      const std::vector<float> f0 = p.run_gpu(prior.f32, DType::f32, accumulate, nullptr, 0);
      const std::vector<float> f1 = p.run_gpu(prior.f32, DType::f32, accumulate, nullptr, 1);
      EXPECT_FALSE(f0 == prior.f32) << what;  // the kernel wrote
      expect_bitwise(f0, f1, p.N, p.L, "f32 " + what);
      expect_bitwise(p.run_gpu(prior.bf16, DType::bf16, accumulate, nullptr, 0),
                     p.run_gpu(prior.bf16, DType::bf16, accumulate, nullptr, 1), p.N, p.L,
                     "bf16 " + what);
      std::printf("%s: f32 and bf16 compared\n", what.c_str());
    }
  }
}

// The scales copied into the stages by the producer (Fp8WgradArgs::stage_scales = 1, bf16
// overwritten) give the bits of the consumers' own scale loads on random finite E4M3 codes: experts
// of 0 to 16 column blocks, more tiles than SMs, partial last tiles both ways (the copies shortened
// to the rows and columns that exist), N % 4 != 0 (the consumers' loads instead), the skip flag,
// and EPMOE_FP8_WGRAD_SCALES read at -1.
TEST(GpuWgradFp8, StageScalesBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(28);
  const std::vector<Shape> cases = {
      {{129, 0, 300, 1, 128, 127, 700}, 5, 384, 1024},  // 2, 0, 3, 1, 1, 1, 6 blocks; 168 tiles
      {{2048, 3}, 0, 260, 2888},                          // 16 blocks and 1; partial last tiles
      {{300, 0, 129}, 0, 48, 16},                         // one partial tile each way
      {{256, 40}, 0, 130, 64},                            // N % 4 == 2: the consumers' loads
  };
  auto run = [](const Problem& p, const std::vector<bf16_t>& stale, const int32_t* skip, int stage_scales) {
    return p.run_gpu(stale, DType::bf16, false, skip, -1, 0, stage_scales);
  };
  expect_variant_bitwise(rng, cases, "scales in the stage", run, "EPMOE_FP8_WGRAD_SCALES", "threads", "warps");
}

// 192 x 128 tiles on three consumer warpgroups (Fp8WgradArgs::tile = 1, bf16 overwritten, scales in
// the stage) give the bits of 128 x 128 on random finite E4M3 codes: N not a multiple of 192 (a
// partial last m-tile, one of 64 rows), experts of 0 to 16 column blocks, more tiles than SMs, the
// skip flag, and EPMOE_FP8_WGRAD_TILE read at -1.
TEST(GpuWgradFp8, Tile192BitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(29);
  const std::vector<Shape> cases = {
      {{129, 0, 300, 1, 128, 127, 700}, 5, 384, 1024},  // 2 m-tiles of 192 (128 x 128: 3)
      {{2048, 3}, 0, 260, 2888},                          // 16 blocks and 1; 68 rows in the last m-tile
      {{300, 0, 129}, 0, 64, 16},                         // one m-tile of 64 rows
      {{256, 256, 256}, 0, 1344, 512},                    // 7 m-tiles; 84 tiles over 3 experts
  };
  auto run = [](const Problem& p, const std::vector<bf16_t>& stale, const int32_t* skip, int tile) {
    return p.run_gpu(stale, DType::bf16, false, skip, -1, 0, 1, tile);
  };
  expect_variant_bitwise(rng, cases, "192 x 128 tiles", run, "EPMOE_FP8_WGRAD_TILE", "192x128", "256x128");
}

// CTA pairs multicasting B (Fp8WgradArgs::multicast = 1; bf16 overwritten with the scales in the
// stage and without) give the bits of single CTAs on random finite E4M3 codes: odd n-tile counts
// (the last pair's second tile past N), a single partial n-tile (its pair's second tile wholly past
// N), experts of 0 to 16 column blocks, more pairs of tiles than resident pairs of CTAs (the
// scales' prefetch across tiles), every epilogue (f32 and bf16 through the stage, overwritten and
// accumulated; bf16 overwritten through TMA stores) against single CTAs with one and two block
// accumulators (pairs run one), the skip flag, and EPMOE_FP8_WGRAD_MULTICAST=1 read at
// multicast = -1. A build with EPMOE_GEMM_CONFIGS=CI has no pairs: skipped.
TEST(GpuWgradFp8, CtaPairsMulticastBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(26);
  const std::vector<Shape> cases = {
      {{129, 0, 300, 1, 128, 127, 700}, 5, 384, 1024},  // 3 n-tiles; 7 x 2 x 8 = 112 pair tiles
      {{2048, 3}, 0, 2880, 256},                          // 23 n-tiles, the last partial; 16 blocks
      {{300, 0, 129}, 0, 48, 16},                         // one partial tile each way
      {{0, 0, 0}, 7, 256, 128},                           // every expert empty
  };
  for (const Shape& c : cases) {
    Problem p(c);
    fill_random(p, rng);
    const PriorGradients prior = prior_gradients(p, rng);
    try {
      p.run_gpu(prior.f32, DType::f32, false, nullptr, 0, 1);
    } catch (const Error& e) {
      if (e.argument() != "multicast") throw;  // any other error fails the test
      GTEST_SKIP() << "CTA pairs not in this build (EPMOE_GEMM_CONFIGS=CI): " << e.what();
    }
    for (const bool accumulate : {false, true}) {
      for (const int overlap : {0, 1}) {
        const std::string what = describe(c) + (accumulate ? " accumulate" : " overwrite") +
                                  " overlap " + std::to_string(overlap);
        const std::vector<float> f1 =
            p.run_gpu(prior.f32, DType::f32, accumulate, nullptr, overlap, 0);
        const std::vector<float> f2 =
            p.run_gpu(prior.f32, DType::f32, accumulate, nullptr, overlap, 1);
        if (p.offsets.back() > 0) {
          EXPECT_FALSE(f2 == prior.f32) << what;  // the pairs wrote
        }
        expect_bitwise(f1, f2, p.N, p.L, "f32 " + what);
        const std::vector<bf16_t> single =
            p.run_gpu(prior.bf16, DType::bf16, accumulate, nullptr, overlap, 0);
        expect_bitwise(single, p.run_gpu(prior.bf16, DType::bf16, accumulate, nullptr, overlap, 1), p.N,
                       p.L, "bf16 " + what);
        if (!accumulate) {  // bf16 overwritten: the pairs with the scales in the stage and without
          expect_bitwise(single, p.run_gpu(prior.bf16, DType::bf16, false, nullptr, overlap, 1, 0), p.N,
                         p.L, "bf16, the consumers' scale loads, " + what);
        }
      }
    }
    std::printf("%s: pairs == single CTAs, f32 and bf16, overwritten and accumulated, overlap 0 / 1, "
                "scales in the stage or not\n",
                describe(c).c_str());
  }
  // The skip flag: zeros overwritten, accumulated outputs untouched.
  Problem p(cases[1]);
  fill_random(p, rng);
  Dev<int32_t> skip(std::vector<int32_t>{1});
  const size_t n = static_cast<size_t>(p.E * p.N * p.L);
  const std::vector<float> stale(n, 5.0f);
  for (float v : p.run_gpu(stale, DType::f32, false, skip.ptr, -1, 1)) ASSERT_EQ(v, 0.0f);
  EXPECT_TRUE(p.run_gpu(stale, DType::f32, true, skip.ptr, -1, 1) == stale);
  const std::vector<bf16_t> stale_bf16(n, static_cast<bf16_t>(0x4040));
  for (bf16_t v : p.run_gpu(stale_bf16, DType::bf16, false, skip.ptr, -1, 1)) ASSERT_EQ(v, 0);
  // The variable, read per launch at multicast = -1.
  const std::vector<float> zeros(n, 0.0f);
  const std::vector<float> single = p.run_gpu(zeros, DType::f32, false, nullptr, -1, 0);
  setenv("EPMOE_FP8_WGRAD_MULTICAST", "1", 1);
  const std::vector<float> from_env = p.run_gpu(zeros, DType::f32, false, nullptr, -1, -1);
  setenv("EPMOE_FP8_WGRAD_MULTICAST", "2", 1);
  std::string field;
  try {
    p.run_gpu(zeros, DType::f32, false, nullptr, -1, -1);
  } catch (const Error& e) {
    field = e.argument();
  }
  unsetenv("EPMOE_FP8_WGRAD_MULTICAST");
  expect_bitwise(single, from_env, p.N, p.L, "EPMOE_FP8_WGRAD_MULTICAST=1");
  EXPECT_EQ(field, "EPMOE_FP8_WGRAD_MULTICAST");
}

// The skip flag empties every expert, as in the bf16 WGRAD: overwritten outputs become zeros,
// accumulated ones are left as they were.
TEST(GpuWgradFp8, SkipFlagEmptiesEveryExpert) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(24);
  Problem p(shapes()[2]);
  fill_exact(p, rng);
  Dev<int32_t> skip(std::vector<int32_t>{1});
  const size_t n = static_cast<size_t>(p.E * p.N * p.L);
  const std::vector<float> stale(n, 5.0f);
  for (float v : p.run_gpu(stale, DType::f32, false, skip.ptr)) ASSERT_EQ(v, 0.0f);
  EXPECT_TRUE(p.run_gpu(stale, DType::f32, true, skip.ptr) == stale);
  const std::vector<bf16_t> stale_bf16(n, static_cast<bf16_t>(0x4040));
  for (bf16_t v : p.run_gpu(stale_bf16, DType::bf16, false, skip.ptr)) ASSERT_EQ(v, 0);
  EXPECT_TRUE(p.run_gpu(stale_bf16, DType::bf16, true, skip.ptr) == stale_bf16);
}

// Host checks only: they run before any CUDA call, so without a GPU too.
TEST(GpuWgradFp8, ArgumentErrorsNameTheField) {
  cuda::Fp8WgradArgs args;
  args.E = 2;
  args.N = 128;
  args.L = 100;  // not a multiple of 8
  args.K = 256;
  auto field_of = [&]() -> std::string {
    try {
      cuda::fp8_grouped_wgrad(args, nullptr);
    } catch (const Error& e) {
      return e.argument();
    }
    return "";
  };
  EXPECT_EQ(field_of(), "L");
  args.L = 128;
  args.K = 200;
  EXPECT_EQ(field_of(), "K");
  args.K = 256;
  args.E = 0;
  EXPECT_EQ(field_of(), "E");
  args.E = 2;
  args.multicast = 2;
  EXPECT_EQ(field_of(), "multicast");
  args.multicast = -1;
  args.stage_scales = 2;
  EXPECT_EQ(field_of(), "stage_scales");
  args.stage_scales = -1;
  args.tile = 2;
  EXPECT_EQ(field_of(), "tile");
  args.tile = -1;
  args.out_dtype = DType::f16;
  EXPECT_EQ(field_of(), "out_dtype");
  args.out_dtype = DType::f32;
  EXPECT_EQ(field_of(), "a_NK");  // null operand
}

}  // namespace
}  // namespace epmoe::test
