// The FP8 W2 DGRAD with the SwiGLU backward in its epilogue (cuda/gemm/fp8_gemm.h
// Fp8SwigluBackwardOut, gemm/fp8_swiglu_epilogue.cuh) against the unfused chain it replaces (the
// FP8 grouped GEMM storing bf16 grad_h, then swiglu_backward_fp8_rows reading it back), bitwise on
// everything either writes: grad_h13 and h (bf16), grad_h13's E4M3 codes and scales, the
// grad_scores partials; every buffer starts as 0xA5 bytes, so rows past the groups must stay
// untouched by both. Shapes: F = 128, 256, 768; empty experts, single rows, row tails of a
// 64-row half and of a 32-row round, a zero row (a zero block amax); with and without row scores,
// SwiGLU and clamped SwiGLU, h13 at a device-held offset (a layer plan's placement), both main
// loops (one and two block accumulators), tiles trimmed to their rows or not, and the skip flag.
// Also: plain rows stored at a device-held offset (Fp8GroupedGemmArgs::out_offset, the W13 FPROP's
// h13) equal the plain store on every tile; argument checks (run without a GPU).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/activation.h"
#include "core/fp8_terms.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "core/plan_terms.h"
#include "core/step.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/swiglu.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "fp8_gemm_problem.h"
#include "grouped_shape.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

using cuda::Fp8Tile;

struct Case {
  GroupedShape shape;  // N = F, K = D
  bool scored;         // row scores (the Context's backward)
  bool clamped;        // clamped SwiGLU (gpt-oss)
  bool placed;         // h13 at a device-held offset
};

std::vector<Case> cases() {
  return {
      {{{300}, 5, 128, 256}, false, false, false},
      {{{300}, 5, 128, 256}, true, false, true},
      // Empty experts, a single row, tails of 1 and 2 rows past a 128-row unit.
      {{{0, 200, 1, 130, 0}, 9, 256, 384}, false, true, true},
      {{{0, 200, 1, 130, 0}, 9, 256, 384}, true, true, false},
      // F of qwen3-30b-a3b; tails inside the second 32-row round (rows 40, 97) and the first (17).
      {{{40, 0, 97, 17}, 3, 768, 128}, true, false, false},
      {{{40, 0, 97, 17}, 3, 768, 128}, false, false, true},
  };
}

ActivationParams activation(bool clamped) {
  ActivationParams a;
  if (clamped) {
    a.clamped = 1;
    a.alpha = 1.702f;
    a.limit = 7.0f;
  }
  return a;
}

// A's codes the integers -3..3 (a third of them zero) and row 5 all zero: a zero grad_h row,
// whose blocks have a zero amax.
Fp8GemmProblem problem(const GroupedShape& s, std::mt19937& rng) {
  Fp8GemmProblem p(s);
  std::uniform_int_distribution<int> pick(0, 8);
  p.fill([&] { const int i = pick(rng); return i >= 7 ? uint8_t{0} : kE4m3Ints[i]; }, rng);
  if (p.M > 5) std::fill(p.a.begin() + 5 * p.K, p.a.begin() + 6 * p.K, uint8_t{0});
  return p;
}

std::vector<bf16_t> random_bf16(size_t n, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<bf16_t> v(n);
  for (bf16_t& x : v) x = float_to_bf16(dist(rng));
  return v;
}

// What the SwiGLU backward writes, read back.
struct Outputs {
  std::vector<bf16_t> grad_h13, h;
  std::vector<uint8_t> codes;
  std::vector<float> scales, parts;
};

// The inputs and the outputs' device buffers of one run (outputs 0xA5 bytes).
struct Buffers {
  const Fp8GemmProblem& p;
  int64_t F, ld;
  Dev<bf16_t> h13, h13_placed;  // h13_placed: kPlacedBytes of padding, then h13
  Dev<int64_t> placed_offset;
  Dev<float> scores;
  Dev<int32_t> header;
  Dev<int32_t> skip;
  Dev<bf16_t> grad_h13, h, grad_h;
  Dev<uint8_t> codes;
  Dev<float> scales, parts;
  static constexpr int64_t kPlacedBytes = 4096;

  Buffers(const Fp8GemmProblem& problem, const std::vector<bf16_t>& h13_M2F, const std::vector<float>& scores_M,
      bool skipped)
      : p(problem), F(problem.N), ld((problem.M + 3) / 4 * 4), h13(h13_M2F),
        h13_placed(static_cast<size_t>(kPlacedBytes / 2) + h13_M2F.size()),
        placed_offset(std::vector<int64_t>{kPlacedBytes}), scores(scores_M),
        header(header_ints(problem, skipped)), skip(std::vector<int32_t>{skipped ? 1 : 0}),
        grad_h13(static_cast<size_t>(p.M * 2 * F)), h(static_cast<size_t>(p.M * F)),
        grad_h(static_cast<size_t>(p.M * F)), codes(static_cast<size_t>(p.M * 2 * F)),
        scales(static_cast<size_t>(fp8_blocks(2 * F) * ld)),
        parts(static_cast<size_t>(p.M * score_chunks(F))) {
    EXPECT_EQ(cudaMemcpy(h13_placed.ptr + kPlacedBytes / 2, h13_M2F.data(), h13_M2F.size() * 2,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }

  // The layout header the unfused kernel reads: rows = the groups' end, the skip flag.
  static std::vector<int32_t> header_ints(const Fp8GemmProblem& p, bool skipped) {
    std::vector<int32_t> h(kLayoutHeaderInts, 0);
    h[kLayoutRows] = p.offsets.back();
    h[kLayoutSkip] = skipped ? 1 : 0;
    return h;
  }

  Outputs read() const {
    return {grad_h13.get(), h.get(), codes.get(), scales.get(), parts.get()};
  }
};

cuda::Fp8GroupedGemmArgs dgrad_args(const Fp8GemmDevice& d, const Buffers& r, int overlap, int trim_rows = 1) {
  cuda::Fp8GroupedGemmArgs a = d.args(r.p);
  a.skip = r.skip.ptr;
  a.tile = Fp8Tile::m128_n128;
  a.overlap = overlap;
  a.trim_rows = trim_rows;
  return a;
}

// The chain: the GEMM stores grad_h, then swiglu_backward_fp8_rows (plain h13).
Outputs run_chain(const Fp8GemmDevice& d, Buffers& r, bool scored, const ActivationParams& act) {
  cuda::Fp8GroupedGemmArgs a = dgrad_args(d, r, -1);
  a.out_MN = r.grad_h.ptr;
  a.ld_out = r.F;
  cuda::fp8_grouped_gemm(a, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  Step s;
  s.layout.header = r.header.ptr;
  s.h13_M2F = r.h13.ptr;
  s.grad_h_MF = r.grad_h.ptr;
  s.h_MF = r.h.ptr;
  s.grad_h13_M2F = r.grad_h13.ptr;
  s.row_scores_M = scored ? r.scores.ptr : nullptr;
  s.score_parts_MC = r.parts.ptr;
  s.dims.F = r.F;
  s.capacity_rows = r.p.M;
  s.act = act;
  cuda::swiglu_backward_fp8_rows(s, r.codes.ptr, r.scales.ptr, r.ld);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  return r.read();
}

// The GEMM with the SwiGLU backward in its epilogue.
Outputs run_fused(const Fp8GemmDevice& d, Buffers& r, bool scored, bool placed, const ActivationParams& act,
                  int overlap, int trim_rows = 1) {
  cuda::Fp8GroupedGemmArgs a = dgrad_args(d, r, overlap, trim_rows);
  cuda::Fp8SwigluBackwardOut& o = a.swiglu_backward;
  o.h13 = placed ? cuda::Placed{reinterpret_cast<char*>(r.h13_placed.ptr), r.placed_offset.ptr}
                 : cuda::plain(r.h13.ptr);
  o.grad_h13_M2F = r.grad_h13.ptr;
  o.h_MF = r.h.ptr;
  o.q_M2F = r.codes.ptr;
  o.q_scales_SM = r.scales.ptr;
  o.q_ld = r.ld;
  o.row_scores_M = scored ? r.scores.ptr : nullptr;
  o.score_parts_MC = r.parts.ptr;
  o.act = act;
  cuda::fp8_grouped_gemm(a, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  return r.read();
}

// Elements of want and got whose bytes differ: names the first 4, returns the count.
template <class T>
size_t differing(const std::vector<T>& want, const std::vector<T>& got, int64_t row_len, const std::string& what) {
  EXPECT_EQ(want.size(), got.size()) << what;
  size_t n = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(T)) == 0) continue;
    if (n++ < 4) {
      ADD_FAILURE() << what << ": element " << i << " (row " << i / static_cast<size_t>(row_len)
                    << ", column " << i % static_cast<size_t>(row_len) << ") differs";
    }
  }
  return n;
}

void expect_same(const Outputs& want, const Outputs& got, const Buffers& r, const std::string& what) {
  const size_t n = differing(want.grad_h13, got.grad_h13, 2 * r.F, what + ": grad_h13") +
                   differing(want.h, got.h, r.F, what + ": h") +
                   differing(want.codes, got.codes, 2 * r.F, what + ": codes") +
                   differing(want.scales, got.scales, r.ld, what + ": scales (S-major, row = block)") +
                   differing(want.parts, got.parts, score_chunks(r.F), what + ": score parts");
  std::printf("%s: %zu elements differ\n", what.c_str(), n);
  EXPECT_EQ(n, 0u) << what;
}

TEST(GpuFp8DgradSwiglu, EpilogueEqualsGemmThenSwigluKernelBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(31);
  for (const Case& c : cases()) {
    const Fp8GemmProblem p = problem(c.shape, rng);
    const Fp8GemmDevice d(p);
    const std::vector<bf16_t> h13 = random_bf16(static_cast<size_t>(p.M * 2 * p.N), rng, 2.0f);
    std::uniform_real_distribution<float> score(0.05f, 1.0f);
    std::vector<float> scores(static_cast<size_t>(p.M));
    for (float& s : scores) s = score(rng);
    const ActivationParams act = activation(c.clamped);
    const std::string what = p.name() + (c.scored ? " scored" : "") + (c.clamped ? " clamped" : "") +
                             (c.placed ? " placed" : "");
    Buffers chain(p, h13, scores, false);
    const Outputs want = run_chain(d, chain, c.scored, act);
    // The chain wrote the group rows: row 0's first scale is set (0xA5A5A5A5 is a negative float).
    uint32_t scale_bits = 0;
    std::memcpy(&scale_bits, &want.scales[0], 4);
    ASSERT_NE(scale_bits, 0xA5A5A5A5u) << what;
    // Tiles trimmed to their rows (the default) and whole (the chain's GEMM trims: both agree).
    for (int overlap : {0, 1}) {
      for (int trim : {1, 0}) {
        Buffers fused(p, h13, scores, false);
        expect_same(want, run_fused(d, fused, c.scored, c.placed, act, overlap, trim), fused,
                    what + " overlap " + std::to_string(overlap) + " trim_rows " + std::to_string(trim));
      }
    }
  }
}

TEST(GpuFp8DgradSwiglu, SkippedStepWritesNothing) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(32);
  const Fp8GemmProblem p = problem({{70, 0, 130}, 4, 256, 256}, rng);
  const Fp8GemmDevice d(p);
  const std::vector<bf16_t> h13 = random_bf16(static_cast<size_t>(p.M * 2 * p.N), rng, 2.0f);
  const std::vector<float> scores(static_cast<size_t>(p.M), 0.5f);
  Buffers untouched(p, h13, scores, true);
  const Outputs poison = untouched.read();
  Buffers chain(p, h13, scores, true);
  expect_same(poison, run_chain(d, chain, true, activation(false)), chain, "chain, skipped");
  Buffers fused(p, h13, scores, true);
  expect_same(poison, run_fused(d, fused, true, false, activation(false), -1), fused, "epilogue, skipped");
}

// The W13 FPROP's h13 stored where a layer plan placed it (out_MN + *out_offset) equals the plain
// store, on every tile; the bytes before the offset stay untouched.
TEST(GpuFp8DgradSwiglu, RowsAtDeviceOffsetEqualPlainRowsBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(33);
  const Fp8GemmProblem p = problem({{0, 65, 1, 300}, 6, 384, 256}, rng);
  const Fp8GemmDevice d(p);
  constexpr int64_t kOffsetBytes = 8192;
  const Dev<int64_t> offset(std::vector<int64_t>{kOffsetBytes});
  for (Fp8Tile tile :
       {Fp8Tile::m128_n128, Fp8Tile::m64_n256, Fp8Tile::m64_n256_spread, Fp8Tile::m192_n128}) {
    cuda::Fp8GroupedGemmArgs a = d.args(p);
    a.tile = tile;
    const std::vector<bf16_t> want = run_rows(p, a);
    Dev<bf16_t> placed(static_cast<size_t>(kOffsetBytes / 2 + p.M * p.N));
    a.out_MN = placed.ptr;
    a.out_offset = offset.ptr;
    a.ld_out = p.N;
    cuda::fp8_grouped_gemm(a, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<bf16_t> all = placed.get();
    const std::string what = "tile " + std::to_string(static_cast<int>(tile));
    for (int64_t i = 0; i < kOffsetBytes / 2; ++i) {
      ASSERT_EQ(all[static_cast<size_t>(i)], 0xA5A5) << what << ": element " << i << " before the offset";
    }
    expect_bitwise(want, std::vector<bf16_t>(all.begin() + kOffsetBytes / 2, all.end()), p.N, what);
  }
}

// Argument checks (before any launch: no GPU needed).
TEST(GpuFp8DgradSwiglu, ArgumentErrorsNameTheArgument) {
  auto* fake = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);  // aligned, never dereferenced
  cuda::Fp8GroupedGemmArgs a;
  a.a_MK = fake;
  a.a_scales_SM = reinterpret_cast<const float*>(fake);
  a.ld_a_scales = 256;
  a.b_ENK = fake;
  a.b_scales_EBS = reinterpret_cast<const float*>(fake);
  a.offsets_E1 = reinterpret_cast<const int32_t*>(fake);
  a.E = 2;
  a.M = 256;
  a.N = 256;
  a.K = 128;
  a.tile = Fp8Tile::m128_n128;
  cuda::Fp8SwigluBackwardOut& o = a.swiglu_backward;
  o.h13 = cuda::plain(fake);
  o.grad_h13_M2F = reinterpret_cast<bf16_t*>(fake);
  o.h_MF = reinterpret_cast<bf16_t*>(fake);
  o.q_M2F = fake;
  o.q_scales_SM = reinterpret_cast<float*>(fake);
  o.q_ld = 256;
  auto expect_named = [&](const cuda::Fp8GroupedGemmArgs& args, const std::string& name) {
    try {
      cuda::fp8_grouped_gemm(args, nullptr);
      ADD_FAILURE() << name << ": accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  cuda::Fp8GroupedGemmArgs x = a;
  x.N = 200;  // F % 128 != 0
  expect_named(x, "a multiple of 128 with swiglu_backward");
  x = a;
  x.swiglu_backward.q_ld = 100;
  expect_named(x, "swiglu_backward.q_ld");
  x = a;
  x.out_MN = reinterpret_cast<bf16_t*>(fake);
  expect_named(x, "out_MN, combine_R");
  x = a;
  x.swiglu_backward.row_scores_M = reinterpret_cast<float*>(fake);
  expect_named(x, "swiglu_backward.score_parts_MC");
  x = a;
  x.swiglu_backward.h_MF = reinterpret_cast<bf16_t*>(fake + 8);
  expect_named(x, "swiglu_backward.h_MF");
  x = a;
  x.tile = Fp8Tile::m64_n256;
  expect_named(x, "m128_n128 with swiglu_backward");
}

}  // namespace
}  // namespace epmoe::test
