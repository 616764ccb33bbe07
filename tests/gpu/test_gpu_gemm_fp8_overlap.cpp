// The FP8 grouped GEMM's two main loops (cuda/gemm/fp8_gemm.h, Fp8GroupedGemmArgs::overlap: one
// block accumulator, or two with the next k-block's MMA in flight during the promotion) give
// bitwise equal outputs: both promote every k-block with the same fma, in k order, and the tensor
// core's block sums do not depend on which registers hold them. Random E4M3 codes (every finite
// pattern, so the reduced-precision fp8 accumulation rounds) and random scales; experts of 0, 1,
// 127, 128, 129 and 300 rows; K of 1 k-block, odd and even k-block counts, a partial last k-block
// and a long K; N up to 2880 with a partial last n-block; rows and scatter epilogues; the
// received-rows operand (a_rows_1). Exact-integer blocks check the two-accumulator loop against
// the CPU twin as well (so equal outputs are also right ones).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/numeric.h"
#include "cuda/gemm/fp8_gemm.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "fp8_gemm_problem.h"
#include "grouped_shape.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

const std::vector<int32_t> kRowsE = {129, 0, 300, 1, 128, 127};
constexpr int64_t kSpareRows = 5;

// exact: codes of the integers -3..3 (block sums exact, CPU comparable bitwise); else every
// finite E4M3 pattern.
Fp8GemmProblem problem(int64_t n, int64_t k, bool exact, uint32_t seed) {
  Fp8GemmProblem p(GroupedShape{kRowsE, kSpareRows, n, k});
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> pick(0, 6), byte(0, 255);
  p.fill(
      [&]() -> uint8_t {
        if (exact) return kE4m3Ints[pick(rng)];
        for (;;) {
          const uint8_t v = static_cast<uint8_t>(byte(rng));
          if ((v & 0x7F) != 0x7F) return v;  // 0x7F / 0xFF: NaN
        }
      },
      rng);
  return p;
}

std::vector<bf16_t> run_loop(const Fp8GemmProblem& p, const Fp8GemmDevice& d, int overlap) {
  cuda::Fp8GroupedGemmArgs x = d.args(p);
  x.overlap = overlap;
  return run_rows(p, x);
}

TEST(GpuGemmFp8Overlap, RowsEpilogueBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  const std::vector<std::pair<int64_t, int64_t>> nk = {
      {128, 128},   // one k-block: the drain only
      {2880, 256},  // two k-blocks, wide N
      {200, 384},   // three (odd), partial n-block
      {384, 320},   // 2.5 k-blocks: partial last one, odd count
      {1536, 1152}, // nine
      {256, 7168},  // 56, a model-sized K
      {128, 7040},  // 55
  };
  uint32_t seed = 300;
  for (const auto& [N, K] : nk) {
    const Fp8GemmProblem p = problem(N, K, false, seed++);
    const Fp8GemmDevice d(p);
    const std::vector<bf16_t> one = run_loop(p, d, 0), two = run_loop(p, d, 1);
    EXPECT_LT(untouched(p, one), static_cast<size_t>(p.N)) << p.name();
    expect_bitwise(one, two, p.N, "rows " + p.name());
  }
}

TEST(GpuGemmFp8Overlap, ExactBlocksEqualCpuTwin) {
  EPMOE_REQUIRE_GPU();
  uint32_t seed = 400;
  for (const auto& [N, K] : std::vector<std::pair<int64_t, int64_t>>{{128, 128}, {256, 384}, {200, 320}, {128, 1024}}) {
    const Fp8GemmProblem p = problem(N, K, true, seed++);
    const Fp8GemmDevice d(p);
    expect_bitwise(p.reference(), run_loop(p, d, 1), p.N, "exact vs cpu " + p.name());
  }
}

// Rows stored into combine slots (R = 1) by both loops.
TEST(GpuGemmFp8Overlap, ScatterEpilogueBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  uint32_t seed = 500;
  for (const auto& [N, K] : std::vector<std::pair<int64_t, int64_t>>{{2880, 384}, {256, 1280}}) {
    const Fp8GemmProblem p = problem(N, K, false, seed++);
    const Fp8GemmDevice d(p);
    std::mt19937 rng(seed);
    const ScatterSlots slots = scatter_slots(p.M, /*top_k=*/2, rng);
    Dev<int32_t> dsrc(slots.recv_src_M);
    std::vector<bf16_t> outs[2];
    for (int overlap = 0; overlap < 2; ++overlap) {
      cuda::Fp8GroupedGemmArgs x = d.args(p);
      x.overlap = overlap;
      outs[overlap] = run_scatter(p, x, slots, dsrc.ptr);
    }
    expect_bitwise(outs[0], outs[1], p.N, "scatter " + p.name());
  }
}

// The received-rows operand: codes then scales in one buffer (fp8_rows_bytes), the row count on the
// device; both loops equal each other and the plain operand's output.
TEST(GpuGemmFp8Overlap, ReceivedRowsOperandBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  uint32_t seed = 600;
  for (const auto& [N, K] : std::vector<std::pair<int64_t, int64_t>>{{384, 384}, {256, 2048}}) {
    const Fp8GemmProblem p = problem(N, K, false, seed++);
    const Fp8GemmDevice d(p);
    Dev<uint8_t> dbuf(received_rows(p));
    Dev<int32_t> drows(std::vector<int32_t>{p.offsets.back()});
    const std::vector<bf16_t> plain = run_loop(p, d, 0);
    for (int overlap = 0; overlap < 2; ++overlap) {
      cuda::Fp8GroupedGemmArgs x = with_received_rows(d.args(p), dbuf.ptr, drows.ptr);
      x.overlap = overlap;
      expect_bitwise(plain, run_rows(p, x), p.N, "a_rows_1 overlap " + std::to_string(overlap) + " " + p.name());
    }
  }
}

// Host only: the selection, explicit or from the environment.
TEST(GpuGemmFp8Overlap, SelectionFromArgsAndEnvironment) {
  EXPECT_FALSE(cuda::fp8_overlap_selected(0));
  EXPECT_TRUE(cuda::fp8_overlap_selected(1));
  const char* saved = std::getenv("EPMOE_FP8_OVERLAP");
  const std::string restore = saved != nullptr ? saved : "";
  unsetenv("EPMOE_FP8_OVERLAP");
  EXPECT_TRUE(cuda::fp8_overlap_selected(-1));
  setenv("EPMOE_FP8_OVERLAP", "1", 1);
  EXPECT_TRUE(cuda::fp8_overlap_selected(-1));
  EXPECT_FALSE(cuda::fp8_overlap_selected(0));
  setenv("EPMOE_FP8_OVERLAP", "0", 1);
  EXPECT_FALSE(cuda::fp8_overlap_selected(-1));
  setenv("EPMOE_FP8_OVERLAP", "yes", 1);
  EXPECT_THROW(cuda::fp8_overlap_selected(-1), Error);
  if (saved != nullptr) {
    setenv("EPMOE_FP8_OVERLAP", restore.c_str(), 1);
  } else {
    unsetenv("EPMOE_FP8_OVERLAP");
  }
  cuda::Fp8GroupedGemmArgs args;
  args.E = 1;
  args.N = 128;
  args.K = 128;
  args.ld_out = 128;
  args.overlap = 2;
  try {
    cuda::fp8_grouped_gemm(args, nullptr);
    ADD_FAILURE() << "overlap = 2 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "overlap");
  }
}

}  // namespace
}  // namespace epmoe::test
