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

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/fp8_terms.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cpu/gemm_fp8_reference.h"
#include "cuda/gemm/fp8_gemm.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

const std::vector<int32_t> kRowsE = {129, 0, 300, 1, 128, 127};
constexpr int64_t kSpareRows = 5;

struct Problem {
  int E = 0;
  int64_t M = 0, N = 0, K = 0, S = 0, B = 0, ld_sa = 0;
  std::vector<int32_t> offsets;
  std::vector<uint8_t> a, b;
  std::vector<float> sa_SM, sb;

  // exact: codes of the integers -3..3 (block sums exact, CPU comparable bitwise); else every
  // finite E4M3 pattern.
  Problem(int64_t n, int64_t k, bool exact, uint32_t seed) : N(n), K(k) {
    E = static_cast<int>(kRowsE.size());
    offsets.assign(1, 0);
    for (int32_t r : kRowsE) offsets.push_back(offsets.back() + r);
    M = offsets.back() + kSpareRows;
    S = (K + 127) / 128;
    B = (N + 127) / 128;
    ld_sa = (M + 3) / 4 * 4;
    std::mt19937 rng(seed);
    const uint8_t kInts[7] = {0xC8, 0xC0, 0xB8, 0x00, 0x38, 0x40, 0x48};
    std::uniform_int_distribution<int> pick(0, 6), byte(0, 255);
    auto code = [&]() -> uint8_t {
      if (exact) return kInts[pick(rng)];
      for (;;) {
        const uint8_t v = static_cast<uint8_t>(byte(rng));
        if ((v & 0x7F) != 0x7F) return v;  // 0x7F / 0xFF: NaN
      }
    };
    a.resize(static_cast<size_t>(M * K));
    b.resize(static_cast<size_t>(E * N * K));
    for (uint8_t& v : a) v = code();
    for (uint8_t& v : b) v = code();
    std::uniform_real_distribution<float> scale(0.01f, 3.0f);
    sa_SM.resize(static_cast<size_t>(S * ld_sa));
    for (float& v : sa_SM) v = scale(rng);
    sb.resize(static_cast<size_t>(E * B * S));
    for (float& v : sb) v = scale(rng);
  }

  std::string name() const { return "N " + std::to_string(N) + " K " + std::to_string(K); }
};

struct DevProblem {
  Dev<uint8_t> a, b;
  Dev<float> sa, sb;
  Dev<int32_t> offsets;
  explicit DevProblem(const Problem& p) : a(p.a), b(p.b), sa(p.sa_SM), sb(p.sb), offsets(p.offsets) {}

  cuda::Fp8GroupedGemmArgs args(const Problem& p, int overlap) const {
    cuda::Fp8GroupedGemmArgs x;
    x.a_MK = a.ptr;
    x.a_scales_SM = sa.ptr;
    x.ld_a_scales = p.ld_sa;
    x.b_ENK = b.ptr;
    x.b_scales_EBS = sb.ptr;
    x.offsets_E1 = offsets.ptr;
    x.E = p.E;
    x.M = p.M;
    x.N = p.N;
    x.K = p.K;
    x.overlap = overlap;
    return x;
  }
};

std::vector<bf16_t> run_rows(const Problem& p, const DevProblem& d, int overlap) {
  Dev<bf16_t> out(static_cast<size_t>(p.M * p.N));
  cuda::Fp8GroupedGemmArgs x = d.args(p, overlap);
  x.out_MN = out.ptr;
  x.ld_out = p.N;
  cuda::fp8_grouped_gemm(x, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  return out.get();
}

// Counts and reports the elements that differ; expects none.
void expect_bitwise(const std::vector<bf16_t>& want, const std::vector<bf16_t>& got, int64_t N,
                    const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  size_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == got[i]) continue;
    if (differ++ < 8) {
      ADD_FAILURE() << what << ": row " << i / static_cast<size_t>(N) << " col " << i % static_cast<size_t>(N)
                    << ": 0x" << std::hex << want[i] << " vs 0x" << got[i] << std::dec;
    }
  }
  std::printf("%s: %zu of %zu outputs differ\n", what.c_str(), differ, want.size());
  EXPECT_EQ(differ, 0u) << what;
}

// Group rows that still hold the 0xA5A5 fill: the kernel missed them.
size_t untouched(const Problem& p, const std::vector<bf16_t>& out) {
  size_t n = 0;
  for (int64_t i = 0; i < p.offsets.back() * p.N; ++i) n += out[static_cast<size_t>(i)] == 0xA5A5;
  return n;
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
    const Problem p(N, K, false, seed++);
    const DevProblem d(p);
    const std::vector<bf16_t> one = run_rows(p, d, 0), two = run_rows(p, d, 1);
    EXPECT_LT(untouched(p, one), static_cast<size_t>(p.N)) << p.name();
    expect_bitwise(one, two, p.N, "rows " + p.name());
  }
}

TEST(GpuGemmFp8Overlap, ExactBlocksEqualCpuTwin) {
  EPMOE_REQUIRE_GPU();
  uint32_t seed = 400;
  for (const auto& [N, K] : std::vector<std::pair<int64_t, int64_t>>{{128, 128}, {256, 384}, {200, 320}, {128, 1024}}) {
    const Problem p(N, K, true, seed++);
    const DevProblem d(p);
    std::vector<bf16_t> cpu(static_cast<size_t>(p.M * p.N), static_cast<bf16_t>(0xA5A5));
    cpu::fp8_grouped_gemm_reference(p.a.data(), p.sa_SM.data(), p.ld_sa, p.b.data(), p.sb.data(),
                                    p.offsets.data(), p.E, p.N, p.K, cpu.data(), p.N, nullptr);
    expect_bitwise(cpu, run_rows(p, d, 1), p.N, "exact vs cpu " + p.name());
  }
}

// Rows stored into combine slots (R = 1) by both loops.
TEST(GpuGemmFp8Overlap, ScatterEpilogueBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  uint32_t seed = 500;
  for (const auto& [N, K] : std::vector<std::pair<int64_t, int64_t>>{{2880, 384}, {256, 1280}}) {
    const Problem p(N, K, false, seed++);
    const DevProblem d(p);
    std::mt19937 rng(seed);
    const int top_k = 2;
    const int64_t T = (p.M + top_k - 1) / top_k + 3;
    std::vector<int32_t> slots(static_cast<size_t>(T * top_k));
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<int32_t> recv_src(slots.begin(), slots.begin() + p.M);
    for (int32_t& v : recv_src) v = encode_src(0, v / top_k, v % top_k, T, top_k);
    Dev<int32_t> dsrc(recv_src);
    std::vector<bf16_t> outs[2];
    for (int overlap = 0; overlap < 2; ++overlap) {
      Dev<bf16_t> combine(static_cast<size_t>(T * top_k * p.N));
      Dev<bf16_t*> table(std::vector<bf16_t*>{combine.ptr});
      cuda::Fp8GroupedGemmArgs x = d.args(p, overlap);
      x.combine_R = table.ptr;
      x.recv_src_M = dsrc.ptr;
      x.T = T;
      x.top_k = top_k;
      cuda::fp8_grouped_gemm(x, nullptr);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      outs[overlap] = combine.get();
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
    const Problem p(N, K, false, seed++);
    const DevProblem d(p);
    const int64_t rows = p.offsets.back();
    std::vector<uint8_t> buf(static_cast<size_t>(fp8_rows_bytes(p.M, p.K)), 0);
    std::copy(p.a.begin(), p.a.begin() + rows * p.K, buf.begin());
    float* scales = reinterpret_cast<float*>(buf.data() + fp8_rows_scales_offset(rows, p.K));
    const int64_t ld = fp8_rows_ld(rows);
    for (int64_t s = 0; s < p.S; ++s) {
      for (int64_t m = 0; m < rows; ++m) scales[s * ld + m] = p.sa_SM[static_cast<size_t>(s * p.ld_sa + m)];
    }
    Dev<uint8_t> dbuf(buf);
    Dev<int32_t> drows(std::vector<int32_t>{static_cast<int32_t>(rows)});
    const std::vector<bf16_t> plain = run_rows(p, d, 0);
    for (int overlap = 0; overlap < 2; ++overlap) {
      Dev<bf16_t> out(static_cast<size_t>(p.M * p.N));
      cuda::Fp8GroupedGemmArgs x = d.args(p, overlap);
      x.a_MK = dbuf.ptr;
      x.a_scales_SM = nullptr;
      x.ld_a_scales = 0;
      x.a_rows_1 = drows.ptr;
      x.out_MN = out.ptr;
      x.ld_out = p.N;
      cuda::fp8_grouped_gemm(x, nullptr);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      expect_bitwise(plain, out.get(), p.N, "a_rows_1 overlap " + std::to_string(overlap) + " " + p.name());
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
