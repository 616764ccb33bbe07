// NVFP4 weight-only grouped GEMM (cuda/gemm/nvfp4_gemm.h) against the CPU computation of its
// formula, out[m, n] = bf16(global_e * sum_k a[m, k] * e2m1(q) * e4m3(scale)), on several expert
// counts and row distributions: empty experts, 1 .. 70 rows (several passes of each row-group
// count), rows past the last group, N not a multiple of 16 or 128, K with and without a tail past
// the 128-element chunks; the skip flag; rows stored into combine slots; the SwiGLU epilogue
// against the host SwiGLU of the plain output. The problems hold the codec's codes (what the
// formula reads); the GPU gets them in the prepared order (core/formats/nvfp4_gemm_order.h).
//
// Two checks:
// - exact sums: activations are the integers -3..3, block scales powers of two in [1/4, 4] and the
//   global a power of two, so every product is a multiple of 2^-3 below 73 and every partial sum
//   (K <= 1120) is exact in fp32 in any order: bitwise equal.
// - random data (codec-prepared weights, random activations and globals): the tensor cores sum in
//   another order, so per element |gpu - cpu| <= 2^-7 |cpu| (one bf16 step: a flipped rounding) +
//   2^-13 * global * sum_k |a w| (fp32 sums in another order, ~K ulps of the largest partial sum
//   at worst; the magnitude their error scales with).
//   A wrong scale, row, nibble or block gives errors of the output's own size; the worst measured
//   ratio to the bound is printed with EPMOE_REPORT_ERRORS=1.
// Split-K (2 and 3 splits, the latter uneven over 5 and 8 chunks; shapes of fewer chunks run as
// many splits as chunks): the exact sums stay bitwise, random data within the same bound, and
// against one split |splits - one| <= 2^-7 |one| + 2^-15 * global * sum_k |a w| (the same products
// summed in another fp32 order: ~K / 16 tensor-core steps, each within ~2^-23 of the running
// magnitude, on both sides; 4x tighter than the CPU bound). The host rules choosing the splits
// (heuristic, EPMOE_NVFP4_SPLITK, the scratch) run without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/activation.h"
#include "core/formats/codecs.h"
#include "core/formats/nvfp4_gemm_order.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cuda/gemm/nvfp4_gemm.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "grouped_shape.h"
#include "require_gpu.h"
#include "scoped_env.h"

namespace epmoe::test {
namespace {

using Shape = GroupedShape;

// Split counts every numeric test runs: one (the single-kernel path), 2, 3 (uneven over 5 and 8
// chunks).
constexpr int kSplits[] = {1, 2, 3};

std::vector<Shape> shapes() {
  return {
      {{4}, 0, 64, 128},                         // one chunk, one group
      {{0, 1, 8, 33, 70}, 5, 200, 320},          // N % 16 != 0; 2 chunks + 4 tail blocks
      {{3, 0, 0, 40, 9, 1, 0, 2}, 3, 128, 64},   // K < 128: a partial chunk only
      {{17, 5}, 0, 96, 896},                     // 7 chunks (past the 6 stages)
      {{2, 31, 32}, 1, 48, 1088},                // 8 chunks + 4 tail blocks
      {{0, 0, 0}, 7, 64, 256},                   // every expert empty
  };
}

struct Problem {
  Shape shape;
  int E = 0;
  int64_t M = 0, N = 0, K = 0, P = 0, S = 0;
  std::vector<int32_t> offsets;
  std::vector<bf16_t> a;
  std::vector<uint8_t> codes, scales;
  std::vector<float> global;

  explicit Problem(const Shape& s) : shape(s) {
    E = static_cast<int>(s.rows_E.size());
    N = s.N;
    K = s.K;
    P = K / 2;
    S = K / 16;
    offsets = group_offsets(s.rows_E);
    M = offsets.back() + s.spare_rows;
  }

  // The codes and scales in the prepared order, as the GEMM reads them.
  std::vector<uint8_t> gemm_codes() const {
    std::vector<uint8_t> q = codes;
    nvfp4_codes_to_gemm_order(q.data(), E * N, P);
    return q;
  }
  std::vector<uint8_t> gemm_scales() const {
    std::vector<uint8_t> s(static_cast<size_t>(E * nvfp4_scale_chunks(K) * N * kNvfp4ChunkBlocks));
    nvfp4_scales_to_gemm_order(scales.data(), E, N, K, s.data());
    return s;
  }

  cuda::Nvfp4GroupedGemmArgs args(const Dev<bf16_t>& da, const Dev<uint8_t>& dq,
                                  const Dev<uint8_t>& ds, const Dev<float>& dg,
                                  const Dev<int32_t>& doff) const {
    cuda::Nvfp4GroupedGemmArgs x;
    x.a_MK = da.ptr;
    x.b_codes_ENP = dq.ptr;
    x.b_scales = ds.ptr;
    x.b_global_E = dg.ptr;
    x.offsets_E1 = doff.ptr;
    x.E = E;
    x.M = M;
    x.N = N;
    x.K = K;
    return x;
  }

  // [M, N] output, with swiglu [M, N / 2] (rows outside the groups keep 0xA5A5); splits: the
  // count asked for (the scratch holds it); rows_per_group: the host's hint choosing the row
  // groups (0: M / E).
  std::vector<bf16_t> run_gpu(const int32_t* skip = nullptr,
                              const ActivationParams* swiglu = nullptr, int splits = 1,
                              int64_t rows_per_group = 0, int64_t wide_above_rows = 0,
                              cuda::StreamForkView fork = {}) const {
    const int64_t cols = swiglu != nullptr ? N / 2 : N;
    Dev<bf16_t> da(a), dout(static_cast<size_t>(M * cols));
    Dev<float> scratch(static_cast<size_t>(
        std::max<int64_t>(1, cuda::nvfp4_splitk_scratch_bytes(splits, M, N) / 4)));
    Dev<uint8_t> dq(gemm_codes()), ds(gemm_scales());
    Dev<float> dg(global);
    Dev<int32_t> doff(offsets);
    cuda::Nvfp4GroupedGemmArgs x = args(da, dq, ds, dg, doff);
    x.rows_per_group = rows_per_group;
    x.wide_above_rows = wide_above_rows;
    x.fork = fork;
    x.skip = skip;
    x.out_MN = dout.ptr;
    x.ld_out = cols;
    x.splits = splits;
    x.splitk_scratch_SMN = scratch.ptr;
    x.splitk_scratch_bytes = static_cast<int64_t>(scratch.size * sizeof(float));
    if (swiglu != nullptr) {
      x.swiglu = true;
      x.act = *swiglu;
    }
    cuda::nvfp4_grouped_gemm(x, nullptr);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    return dout.get();
  }

  // The formula in fp32, k ascending; magnitude: global * sum_k |a w| per element.
  std::vector<bf16_t> run_cpu(std::vector<float>* magnitude = nullptr) const {
    std::vector<bf16_t> out(static_cast<size_t>(M * N), static_cast<bf16_t>(0xA5A5));
    if (magnitude != nullptr) magnitude->assign(out.size(), 0.0f);
    std::vector<float> w(static_cast<size_t>(K));
    for (int e = 0; e < E; ++e) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t row = e * N + n;
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t byte = codes[static_cast<size_t>(row * P + k / 2)];
          const uint8_t code = k % 2 == 0 ? e2m1_first(byte) : e2m1_second(byte);
          w[static_cast<size_t>(k)] =
              e2m1_to_float(code) * e4m3_to_float(scales[static_cast<size_t>(row * S + k / 16)]);
        }
        for (int64_t m = offsets[static_cast<size_t>(e)]; m < offsets[static_cast<size_t>(e) + 1];
             ++m) {
          float acc = 0.0f, mag = 0.0f;
          for (int64_t k = 0; k < K; ++k) {
            const float p = bf16_to_float(a[static_cast<size_t>(m * K + k)]) * w[static_cast<size_t>(k)];
            acc += p;
            mag += std::fabs(p);
          }
          const size_t i = static_cast<size_t>(m * N + n);
          out[i] = float_to_bf16(global[static_cast<size_t>(e)] * acc);
          if (magnitude != nullptr) (*magnitude)[i] = global[static_cast<size_t>(e)] * mag;
        }
      }
    }
    return out;
  }
};

void expect_bitwise(const std::vector<bf16_t>& cpu, const std::vector<bf16_t>& gpu, int64_t N,
                    const std::string& what) {
  ASSERT_EQ(cpu.size(), gpu.size()) << what;
  int shown = 0;
  size_t differ = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (cpu[i] == gpu[i]) continue;
    ++differ;
    if (shown++ < 8) {
      ADD_FAILURE() << what << ": row " << i / static_cast<size_t>(N) << " col "
                    << i % static_cast<size_t>(N) << ": cpu " << bf16_to_float(cpu[i]) << ", gpu "
                    << bf16_to_float(gpu[i]);
    }
  }
  EXPECT_EQ(differ, 0u) << what;
}

// Exact-sum inputs: codes of every value, power-of-two block scales and global.
void fill_exact(Problem& p, std::mt19937& rng) {
  const uint8_t kPow2Scales[5] = {0x28, 0x30, 0x38, 0x40, 0x48};  // e4m3 1/4 1/2 1 2 4
  std::uniform_int_distribution<int> ints(-3, 3), byte(0, 255), pick(0, 4);
  p.a.resize(static_cast<size_t>(p.M * p.K));
  for (bf16_t& v : p.a) v = float_to_bf16(static_cast<float>(ints(rng)));
  p.codes.resize(static_cast<size_t>(p.E * p.N * p.P));
  for (uint8_t& v : p.codes) v = static_cast<uint8_t>(byte(rng));
  p.scales.resize(static_cast<size_t>(p.E * p.N * p.S));
  for (uint8_t& v : p.scales) v = kPow2Scales[pick(rng)];
  p.global.resize(static_cast<size_t>(p.E));
  for (int e = 0; e < p.E; ++e) p.global[static_cast<size_t>(e)] = std::ldexp(1.0f, e % 5 - 3);
}

TEST(GpuGemmNvfp4, ExactSumsBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(21);
  for (const Shape& s : shapes()) {
    Problem p(s);
    fill_exact(p, rng);
    const std::vector<bf16_t> cpu = p.run_cpu();
    for (int splits : kSplits) {
      expect_bitwise(cpu, p.run_gpu(nullptr, nullptr, splits), p.N,
                     describe(s) + " splits " + std::to_string(splits));
    }
  }
}

TEST(GpuGemmNvfp4, CodecPreparedRandomDataWithinBound) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(22);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double worst = 0.0, worst_split = 0.0;
  for (const Shape& s : shapes()) {
    Problem p(s);
    p.a.resize(static_cast<size_t>(p.M * p.K));
    for (bf16_t& v : p.a) v = float_to_bf16(normal(rng));
    // Weights through the codec (one global per expert), scaled per expert so the globals differ.
    std::vector<float> w(static_cast<size_t>(p.E * p.N * p.K));
    for (size_t i = 0; i < w.size(); ++i) {
      w[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>(i / static_cast<size_t>(p.N * p.K)) % 7 - 3);
    }
    p.codes.assign(static_cast<size_t>(p.E * p.N * p.P), 0);
    p.scales.assign(static_cast<size_t>(p.E * p.N * p.S), 0);
    p.global.assign(static_cast<size_t>(p.E), 0.0f);
    nvfp4_global_scales(w.data(), p.E, p.E * p.N, p.K, p.global.data());
    nvfp4_quantize_rows(w.data(), p.E, p.E * p.N, p.K, p.global.data(), p.codes.data(),
                        p.scales.data());
    std::vector<float> mag;
    const std::vector<bf16_t> cpu = p.run_cpu(&mag);
    // The rows-per-expert hint: M / E, and 40 (8 groups a pass), on wgmma and on mma.sync.
    for (const auto& [hint, wgmma] : {std::pair<int64_t, const char*>{0, "1"}, {40, "1"}, {40, "0"}}) {
      const ScopedEnv mma("EPMOE_NVFP4_WGMMA", wgmma);
      const std::vector<bf16_t> one = p.run_gpu(nullptr, nullptr, 1, hint);
      for (int splits : kSplits) {
        const std::vector<bf16_t> gpu = splits == 1 ? one : p.run_gpu(nullptr, nullptr, splits, hint);
        const std::string what = describe(s) + " splits " + std::to_string(splits) + " hint " +
                                 std::to_string(hint) + " wgmma " + wgmma;
        int shown = 0;
        for (size_t i = 0; i < cpu.size(); ++i) {
          if (cpu[i] == static_cast<bf16_t>(0xA5A5)) {
            EXPECT_EQ(gpu[i], cpu[i]) << what << ": element " << i << " outside the groups";
            continue;
          }
          const double c = bf16_to_float(cpu[i]), g = bf16_to_float(gpu[i]);
          const double o = bf16_to_float(one[i]);
          const double bound = std::ldexp(std::fabs(c), -7) + std::ldexp(mag[i], -13) + 1e-30;
          const double split_bound = std::ldexp(std::fabs(o), -7) + std::ldexp(mag[i], -15) + 1e-30;
          worst = std::max(worst, std::fabs(g - c) / bound);
          if (splits > 1) worst_split = std::max(worst_split, std::fabs(g - o) / split_bound);
          if (!(std::fabs(g - c) <= bound) && shown++ < 8) {
            ADD_FAILURE() << what << ": row " << i / static_cast<size_t>(p.N) << " col "
                          << i % static_cast<size_t>(p.N) << ": cpu " << c << ", gpu " << g
                          << ", bound " << bound;
          }
          if (!(std::fabs(g - o) <= split_bound) && shown++ < 8) {
            ADD_FAILURE() << what << ": row " << i / static_cast<size_t>(p.N) << " col "
                          << i % static_cast<size_t>(p.N) << ": one split " << o << ", gpu " << g
                          << ", bound " << split_bound;
          }
        }
      }
    }
  }
  if (std::getenv("EPMOE_REPORT_ERRORS") != nullptr) {
    std::printf("nvfp4 GEMM: worst |gpu - cpu| / bound %.3g, |splits - one| / bound %.3g\n", worst,
                worst_split);
  }
}

// The SwiGLU epilogue (gate rows [0, N/2), up rows [N/2, N)) against the host SwiGLU of the plain
// output's rounded values: equal up to the device / host expf difference (one bf16 rounding
// step), rows outside the groups untouched; plain and clamped.
TEST(GpuGemmNvfp4, SwigluEpilogueMatchesThePlainOutputsSwiglu) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(25);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  ActivationParams clamped;
  clamped.clamped = 1;
  clamped.alpha = 1.702f;
  clamped.limit = 7.0f;
  for (const ActivationParams& act : {ActivationParams{}, clamped}) {
    for (const Shape& s : shapes()) {
      for (int splits : kSplits) {
        Problem p(s);
        fill_exact(p, rng);
        for (bf16_t& v : p.a) v = float_to_bf16(0.05f * normal(rng));  // gates around the knee
        const std::vector<bf16_t> plain = p.run_gpu(nullptr, nullptr, splits),
                                  fused = p.run_gpu(nullptr, &act, splits);
        const int64_t F = p.N / 2;
        for (int64_t m = 0; m < p.M; ++m) {
          const bool in_group = m < p.offsets.back();
          for (int64_t f = 0; f < F; ++f) {
            const bf16_t got = fused[static_cast<size_t>(m * F + f)];
            if (!in_group) {
              ASSERT_EQ(got, static_cast<bf16_t>(0xA5A5)) << describe(s) << " row " << m;
              continue;
            }
            const float gate = bf16_to_float(plain[static_cast<size_t>(m * p.N + f)]);
            const float up = bf16_to_float(plain[static_cast<size_t>(m * p.N + F + f)]);
            const double want = bf16_to_float(float_to_bf16(swiglu_forward(gate, up, act)));
            const double g = bf16_to_float(got);
            ASSERT_LE(std::fabs(g - want), std::ldexp(std::fabs(want), -7) + 1e-30)
                << describe(s) << (act.clamped ? " clamped" : " plain") << " splits " << splits
                << " row " << m << " col " << f << ": gate " << gate << " up " << up;
          }
        }
      }
    }
  }
}

// Every row-group count (1, 2, 4, 8 groups a pass, chosen by the rows-per-expert hint) gives the
// bits of one group: the same MMAs in the same order for every row, only the passes over the
// weights differ. Plain, SwiGLU and clamped SwiGLU, one split and three (exact codes, random
// activations). Beyond shapes(): 70 and 33 rows (several passes of every count, the last one
// partial), N = 200 (warps past the end in the last slab), 12 chunks (past the stages).
TEST(GpuGemmNvfp4, RowGroupsBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  std::vector<Shape> cases = shapes();
  cases.push_back({{70, 0, 33}, 2, 200, 512});
  cases.push_back({{5, 64, 1}, 0, 128, 1536});
  std::mt19937 rng(27);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const ActivationParams clamped = activation_params(Activation::swiglu_clamped());
  const ActivationParams plain_swiglu{};
  // Hints giving 1, 2, 4 and 8 groups (nvfp4_row_groups).
  const int64_t hints[] = {1, 8, 16, 40};
  for (int i = 0; i < 4; ++i) ASSERT_EQ(cuda::nvfp4_row_groups(hints[i]).groups, 1 << i);
  for (const ActivationParams* act : {static_cast<const ActivationParams*>(nullptr), &plain_swiglu,
                                      &clamped}) {
    const char* what = act == nullptr ? " plain" : (act->clamped ? " clamped" : " swiglu");
    for (const Shape& s : cases) {
      Problem p(s);
      fill_exact(p, rng);
      for (bf16_t& v : p.a) v = float_to_bf16(normal(rng));
      const int64_t cols = act == nullptr ? p.N : p.N / 2;
      for (int splits : {1, 3}) {
        const std::vector<bf16_t> one_group = p.run_gpu(nullptr, act, splits, hints[0]);
        for (int i = 1; i < 4; ++i) {
          expect_bitwise(one_group, p.run_gpu(nullptr, act, splits, hints[i]), cols,
                         describe(s) + what + " splits " + std::to_string(splits) + " groups " +
                             std::to_string(1 << i));
        }
        // Every group count with one activation box a group, and with boxes of up to four: the
        // same bytes in shared memory.
        for (const char* boxes : {"0", "1"}) {
          const ScopedEnv env("EPMOE_NVFP4_ACT_BOXES", boxes);
          for (int i = 1; i < 4; ++i) {
            expect_bitwise(one_group, p.run_gpu(nullptr, act, splits, hints[i]), cols,
                           describe(s) + what + " splits " + std::to_string(splits) + " groups " +
                               std::to_string(1 << i) + " EPMOE_NVFP4_ACT_BOXES=" + boxes);
          }
        }
        // 8 groups on wgmma: the same bits (the tensor cores' k16 steps sum as mma.sync's do).
        const ScopedEnv wgmma("EPMOE_NVFP4_WGMMA", "1");
        expect_bitwise(one_group, p.run_gpu(nullptr, act, splits, hints[3]), cols,
                       describe(s) + what + " splits " + std::to_string(splits) + " groups 8 wgmma");
      }
    }
  }
}

// Experts with many rows (skewed routing) take the second, 8-group launch: the same bits as
// narrow passes only, and as every expert in the wide launch.
TEST(GpuGemmNvfp4, WidePassBitwiseEqualNarrowPasses) {
  EPMOE_REQUIRE_GPU();
  std::vector<Shape> cases = shapes();
  cases.push_back({{150, 3, 0, 70, 17, 64, 65}, 2, 200, 512});
  cases.push_back({{1, 200}, 0, 128, 384});
  std::mt19937 rng(28);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const ActivationParams plain_swiglu{};
  const cuda::StreamFork fork;  // the wide launch on a side stream, joined back
  for (const ActivationParams* act : {static_cast<const ActivationParams*>(nullptr), &plain_swiglu}) {
    const char* what = act == nullptr ? " plain" : " swiglu";
    for (const Shape& s : cases) {
      Problem p(s);
      fill_exact(p, rng);
      for (bf16_t& v : p.a) v = float_to_bf16(normal(rng));
      const int64_t cols = act == nullptr ? p.N : p.N / 2;
      for (int splits : {1, 3}) {
        for (int64_t hint : {1, 8, 16}) {  // 1, 2, 4 groups: wide above 16, 32, 64 rows
          const std::string where = describe(s) + what + " splits " + std::to_string(splits) +
                                    " hint " + std::to_string(hint);
          const std::vector<bf16_t> narrow =
              p.run_gpu(nullptr, act, splits, hint, cuda::kNvfp4NoWidePass);
          expect_bitwise(narrow, p.run_gpu(nullptr, act, splits, hint), cols, where + " rule");
          expect_bitwise(narrow, p.run_gpu(nullptr, act, splits, hint, 1), cols,
                         where + " wide above 1 row");
          expect_bitwise(narrow, p.run_gpu(nullptr, act, splits, hint, 1, fork.view()), cols,
                         where + " wide above 1 row, forked");
          // The wide launch as an ordinary one after the narrow one (the default above: a
          // programmatic dependent launch).
          {
            const ScopedEnv plain("EPMOE_NVFP4_WIDE_PDL", "0");
            expect_bitwise(narrow, p.run_gpu(nullptr, act, splits, hint, 1), cols,
                           where + " wide above 1 row, ordinary launches");
          }
          // Both launches with activation boxes of up to four groups (the wide one has one a
          // group by default).
          {
            const ScopedEnv boxes("EPMOE_NVFP4_ACT_BOXES", "1");
            expect_bitwise(narrow, p.run_gpu(nullptr, act, splits, hint, 1), cols,
                           where + " wide above 1 row, EPMOE_NVFP4_ACT_BOXES=1");
          }
          const ScopedEnv wgmma("EPMOE_NVFP4_WGMMA", "1");
          expect_bitwise(narrow, p.run_gpu(nullptr, act, splits, hint, 1), cols,
                         where + " wide above 1 row on wgmma");
        }
      }
    }
  }
}

// The row-group rule (host only): the expected rows plus two standard deviations fit a pass.
TEST(GpuGemmNvfp4, RowGroupsHoldTheExpectedRowsAndTwoSigma) {
  EXPECT_EQ(cuda::nvfp4_row_groups(0).groups, 1);
  EXPECT_EQ(cuda::nvfp4_row_groups(4).groups, 1);   // deepseek-v3, gpt-oss decode: 4 + 4 = 8
  EXPECT_EQ(cuda::nvfp4_row_groups(5).groups, 2);   // 5 + 4.5 > 8
  EXPECT_EQ(cuda::nvfp4_row_groups(8).groups, 2);   // qwen3 decode: 8 + 5.7 <= 16
  EXPECT_EQ(cuda::nvfp4_row_groups(32).groups, 8);  // mixtral decode: 32 + 11.3 > 32
  EXPECT_EQ(cuda::nvfp4_row_groups(1000).groups, cuda::kNvfp4MaxRowGroups);
  // More than two passes' rows: the 8-group launch; none beside 8 groups.
  EXPECT_EQ(cuda::nvfp4_row_groups(4).wide_above, 16);
  EXPECT_EQ(cuda::nvfp4_row_groups(8).wide_above, 32);
  EXPECT_EQ(cuda::nvfp4_row_groups(16).wide_above, 64);
  EXPECT_EQ(cuda::nvfp4_row_groups(32).wide_above, cuda::kNvfp4NoWidePass);
  EXPECT_NE(cuda::nvfp4_row_groups(4).reason.find("more than 16 rows"), std::string::npos)
      << cuda::nvfp4_row_groups(4).reason;
  EXPECT_NE(cuda::nvfp4_row_groups(8).reason.find("2 x 8 rows"), std::string::npos)
      << cuda::nvfp4_row_groups(8).reason;
}

TEST(GpuGemmNvfp4, SkipFlagLeavesTheOutputUntouched) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(23);
  Problem p(shapes()[1]);
  fill_exact(p, rng);
  Dev<int32_t> skip(std::vector<int32_t>{1});
  for (bf16_t v : p.run_gpu(skip.ptr)) ASSERT_EQ(v, static_cast<bf16_t>(0xA5A5));
}

// Rows stored into combine slots (R = 1): row m of the groups goes to slot recv_src[m] of a
// [T, K, N] buffer; the rows equal the plain output's.
TEST(GpuGemmNvfp4, ScatterStoresEachRowInItsSlot) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(24);
  Problem p(shapes()[4]);  // 8 chunks + a tail: 1 and 3 splits
  fill_exact(p, rng);
  const int top_k = 2;
  const int64_t T = (p.M + top_k - 1) / top_k + 3;
  std::vector<int32_t> slots(static_cast<size_t>(T * top_k));
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int32_t> recv_src(slots.begin(), slots.begin() + p.M);
  for (int32_t& v : recv_src) v = encode_src(0, v / top_k, v % top_k, T, top_k);
  for (int splits : {1, 3}) {
    Dev<bf16_t> da(p.a), combine(static_cast<size_t>(T * top_k * p.N));
    Dev<uint8_t> dq(p.gemm_codes()), ds(p.gemm_scales());
    Dev<float> dg(p.global);
    Dev<float> scratch(static_cast<size_t>(cuda::nvfp4_splitk_scratch_bytes(3, p.M, p.N) / 4));
    Dev<int32_t> doff(p.offsets), dsrc(recv_src);
    Dev<bf16_t*> table(std::vector<bf16_t*>{combine.ptr});
    cuda::Nvfp4GroupedGemmArgs x = p.args(da, dq, ds, dg, doff);
    x.combine_R = table.ptr;
    x.recv_src_M = dsrc.ptr;
    x.T = T;
    x.top_k = top_k;
    x.splits = splits;
    x.splitk_scratch_SMN = scratch.ptr;
    x.splitk_scratch_bytes = static_cast<int64_t>(scratch.size * sizeof(float));
    cuda::nvfp4_grouped_gemm(x, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    // Exact sums: every split count gives the plain output's bits.
    const std::vector<bf16_t> got = combine.get(), plain = p.run_gpu();
    for (int64_t m = 0; m < p.offsets.back(); ++m) {
      const int64_t slot = src_slot(recv_src[static_cast<size_t>(m)], T, top_k);
      for (int64_t n = 0; n < p.N; ++n) {
        ASSERT_EQ(got[static_cast<size_t>(slot * p.N + n)], plain[static_cast<size_t>(m * p.N + n)])
            << "splits " << splits << " row " << m << " col " << n;
      }
    }
  }
}

// The host rules choosing the splits; no GPU needed (the heuristic is given the SM count, the
// environment override skips the device query).
TEST(GpuGemmNvfp4, SplitChoiceHeuristic) {
  struct Want {
    const char* name;
    int64_t N, K;
    int E;
    bool swiglu;
    int splits;
  };
  // H200: 132 SMs; target 3 x 132 = 396 CTAs. The bench shapes' GEMMs (fused W13, W2), then
  // the bounds.
  const Want wants[] = {
      {"mixtral-8x7b W2 (32 slabs x 8 experts, 112 chunks)", 4096, 14336, 8, false, 2},
      {"mixtral-8x7b W13 (224 slabs x 8)", 28672, 4096, 8, true, 1},
      {"qwen3-30b-a3b W13 (12 slabs x 128)", 1536, 2048, 128, true, 1},
      {"qwen3-30b-a3b W2 (16 slabs x 128)", 2048, 768, 128, false, 1},
      {"deepseek-v3 W13 (32 slabs x 256)", 4096, 7168, 256, true, 1},
      {"deepseek-v3 W2 (56 slabs x 256)", 7168, 2048, 256, false, 1},
      {"gpt-oss-120b W13 (45 slabs x 128)", 5760, 2880, 128, true, 1},
      {"gpt-oss-120b W2 (23 slabs x 128)", 2880, 2880, 128, false, 1},
      {"one expert, 1 slab, K = 4096 (32 chunks: 4 splits of >= 8)", 128, 4096, 1, false, 4},
      {"one expert, 1 slab, K = 1 << 20 (capped at 16)", 64, 1 << 20, 1, false, 16},
      {"K < 128: one partial chunk", 64, 64, 1, false, 1},
  };
  for (const Want& w : wants) {
    const cuda::Nvfp4Splits c = cuda::nvfp4_choose_splits(w.N, w.K, w.E, w.swiglu, 132);
    EXPECT_EQ(c.splits, w.splits) << w.name << ": " << c.reason;
    if (std::getenv("EPMOE_REPORT_ERRORS") != nullptr) {
      std::printf("%s: %s\n", w.name, c.reason.c_str());
    }
  }
}

TEST(GpuGemmNvfp4, SplitCountFollowsTheArgumentsTheEnvironmentAndTheScratch) {
  cuda::Nvfp4GroupedGemmArgs x;
  x.E = 2;
  x.M = 10;
  x.N = 64;
  x.K = 640;  // 5 chunks
  EXPECT_EQ(cuda::nvfp4_splitk_scratch_bytes(2, x.M, x.N), 2 * 10 * 64 * 4);
  EXPECT_EQ(cuda::nvfp4_splitk_scratch_bytes(1, x.M, x.N), 0);
  std::vector<float> scratch(
      static_cast<size_t>(cuda::nvfp4_splitk_scratch_bytes(5, x.M, x.N) / 4));
  x.splitk_scratch_SMN = scratch.data();  // host only: nothing launches
  const auto holds = [&](int splits) {
    x.splitk_scratch_bytes = cuda::nvfp4_splitk_scratch_bytes(splits, x.M, x.N);
  };
  // The caller's count: at most one split per chunk, and the scratch must hold it.
  holds(2);
  x.splits = 2;
  EXPECT_EQ(cuda::nvfp4_launch_splits(x), 2);
  x.splits = 9;  // 5 chunks: 5 splits, more than the scratch holds
  try {
    cuda::nvfp4_launch_splits(x);
    ADD_FAILURE() << "5 splits accepted with scratch for 2";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "splitk_scratch_bytes") << e.what();
  }
  holds(5);
  EXPECT_EQ(cuda::nvfp4_launch_splits(x), 5);
  x.splits = 1;
  EXPECT_EQ(cuda::nvfp4_launch_splits(x), 1);
  // splits = 0: the environment, lowered to the chunks and to what the scratch holds.
  x.splits = 0;
  {
    const ScopedEnv env("EPMOE_NVFP4_SPLITK", "3");
    EXPECT_EQ(cuda::nvfp4_launch_splits(x), 3);
    holds(2);
    EXPECT_EQ(cuda::nvfp4_launch_splits(x), 2);
    x.splitk_scratch_SMN = nullptr;
    EXPECT_EQ(cuda::nvfp4_launch_splits(x), 1);
    x.splitk_scratch_SMN = scratch.data();
    x.splitk_scratch_bytes = 4;  // less than one split's partials
    EXPECT_EQ(cuda::nvfp4_launch_splits(x), 1);
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_SPLITK", "7");
    holds(5);
    EXPECT_EQ(cuda::nvfp4_launch_splits(x), 5);
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_SPLITK", "1");
    EXPECT_EQ(cuda::nvfp4_launch_splits(x), 1);
  }
  // Unset: one split; anything but a count or auto (the heuristic: it reads the SM count, so on
  // a GPU only) names the variable.
  if (cuda_device_count() > 0) {
    const ScopedEnv env("EPMOE_NVFP4_SPLITK", "auto");
    const int splits = cuda::nvfp4_launch_splits(x);
    EXPECT_GE(splits, 1);
    EXPECT_LE(splits, 5);
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_SPLITK", nullptr);
    EXPECT_EQ(cuda::nvfp4_launch_splits(x), 1);
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_SPLITK", "many");
    try {
      cuda::nvfp4_launch_splits(x);
      ADD_FAILURE() << "EPMOE_NVFP4_SPLITK=many accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "EPMOE_NVFP4_SPLITK") << e.what();
    }
  }
}

// The measurement switches (host only): unset gives the rule, bad values name the variable.
TEST(GpuGemmNvfp4, RowGroupAndForkSwitchesAreChecked) {
  {
    const ScopedEnv env("EPMOE_NVFP4_ROW_GROUPS", nullptr);
    EXPECT_EQ(cuda::nvfp4_requested_row_groups(), 0);
  }
  for (const char* v : {"1", "2", "4", "8"}) {
    const ScopedEnv env("EPMOE_NVFP4_ROW_GROUPS", v);
    EXPECT_EQ(cuda::nvfp4_requested_row_groups(), std::atoi(v));
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_WIDE_FORK", nullptr);
    EXPECT_FALSE(cuda::nvfp4_wide_fork());  // off by default (measured slower on balanced)
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_WIDE_FORK", "1");
    EXPECT_TRUE(cuda::nvfp4_wide_fork());
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_WIDE_PDL", nullptr);
    EXPECT_TRUE(cuda::nvfp4_wide_pdl());  // on by default (measured faster on skew, even balanced)
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_WIDE_PDL", "0");
    EXPECT_FALSE(cuda::nvfp4_wide_pdl());
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_WGMMA", nullptr);
    EXPECT_FALSE(cuda::nvfp4_wgmma());  // off by default (measured slower)
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_WGMMA", "1");
    EXPECT_TRUE(cuda::nvfp4_wgmma());
  }
  {
    const ScopedEnv env("EPMOE_NVFP4_ACT_BOXES", nullptr);
    EXPECT_TRUE(cuda::nvfp4_act_boxes(false));  // boxes of up to 32 rows in the narrow launch
    EXPECT_FALSE(cuda::nvfp4_act_boxes(true));  // and one a group in the wide one
  }
  for (const char* v : {"0", "1"}) {
    const ScopedEnv env("EPMOE_NVFP4_ACT_BOXES", v);
    EXPECT_EQ(cuda::nvfp4_act_boxes(false), v[0] == '1');
    EXPECT_EQ(cuda::nvfp4_act_boxes(true), v[0] == '1');
  }
  const std::pair<const char*, const char*> bad[] = {{"EPMOE_NVFP4_ROW_GROUPS", "3"},
                                                      {"EPMOE_NVFP4_ROW_GROUPS", "16"},
                                                      {"EPMOE_NVFP4_WIDE_FORK", "yes"},
                                                      {"EPMOE_NVFP4_WIDE_PDL", "on"},
                                                      {"EPMOE_NVFP4_WGMMA", "2"},
                                                      {"EPMOE_NVFP4_ACT_BOXES", "4"}};
  for (const auto& [name, value] : bad) {
    const ScopedEnv env(name, value);
    try {
      const std::string n = name;
      if (n == "EPMOE_NVFP4_WIDE_FORK") {
        cuda::nvfp4_wide_fork();
      } else if (n == "EPMOE_NVFP4_WIDE_PDL") {
        cuda::nvfp4_wide_pdl();
      } else if (n == "EPMOE_NVFP4_WGMMA") {
        cuda::nvfp4_wgmma();
      } else if (n == "EPMOE_NVFP4_ACT_BOXES") {
        cuda::nvfp4_act_boxes(false);
      } else {
        cuda::nvfp4_requested_row_groups();
      }
      ADD_FAILURE() << name << "=" << value << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), name) << e.what();
    }
  }
}

TEST(GpuGemmNvfp4, ArgumentsAreChecked) {
  cuda::Nvfp4GroupedGemmArgs x;
  x.E = 1;
  x.M = 0;
  x.N = 64;
  for (int64_t K : {120, 144}) {  // not a multiple of 16; of 16, not 32 (8-byte code rows)
    x.K = K;
    try {
      cuda::nvfp4_grouped_gemm(x, nullptr);
      ADD_FAILURE() << "K = " << K << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "K") << e.what();
    }
  }
  x.K = 128;
  x.ld_out = 64;
  try {
    cuda::nvfp4_grouped_gemm(x, nullptr);
    ADD_FAILURE() << "null weights accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "b_codes_ENP") << e.what();
  }
  // More experts than the kernel's shared-memory list; a negative wide threshold.
  x.E = cuda::kNvfp4MaxExperts + 1;
  try {
    cuda::nvfp4_grouped_gemm(x, nullptr);
    ADD_FAILURE() << "E = " << x.E << " accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "E") << e.what();
  }
  x.E = 1;
  x.wide_above_rows = -1;
  try {
    cuda::nvfp4_grouped_gemm(x, nullptr);
    ADD_FAILURE() << "wide_above_rows = -1 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "wide_above_rows") << e.what();
  }
}

}  // namespace
}  // namespace epmoe::test
