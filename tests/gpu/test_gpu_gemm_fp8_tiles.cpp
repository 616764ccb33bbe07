// The FP8 grouped GEMM's tiles (cuda/gemm/fp8_gemm.h Fp8Tile: cooperative 128 x 128 and ping-pong
// 64 x 256 in its two tile orders) compute every output element alike: the same wgmma shape over each 128-deep
// k-block and the same per-block promotion in k order, so their outputs must agree bitwise on any
// input, here random E4M3 codes (all finite values) and random scales. Shapes: experts of 0, 1, 63,
// 64, 65, 300 rows (empty, a single row, around the 64-row tile and the 128-row unit), N of 128,
// 256, 384 (a half tile past N), 2880; partial k-blocks; more tiles than CTAs. Both epilogues
// (plain rows, rows scattered into combine slots) and the received-rows operand (a_rows_1). The
// ping-pong tile is also compared with the CPU twin on exact blocks (bitwise, as in
// test_gpu_gemm_fp8.cpp), and the EPMOE_FP8_TILE parsing runs without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_terms.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cpu/gemm_fp8_reference.h"
#include "cuda/gemm/fp8_gemm.h"
#include "device_buffer.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

using cuda::Fp8Tile;

const Fp8Tile kPingPong[2] = {Fp8Tile::m64_n256, Fp8Tile::m64_n256_spread};

std::string name(Fp8Tile t) { return t == Fp8Tile::m64_n256 ? "64x256" : "64x256-spread"; }

struct Shape {
  std::vector<int32_t> rows_E;  // rows per expert
  int64_t spare_rows;           // capacity past the last group
  int64_t N, K;
};

std::string describe(const Shape& s) {
  std::string r = "E " + std::to_string(s.rows_E.size()) + " rows {";
  for (size_t i = 0; i < s.rows_E.size() && i < 12; ++i) r += std::to_string(s.rows_E[i]) + " ";
  if (s.rows_E.size() > 12) r += "... ";
  return r + "} N " + std::to_string(s.N) + " K " + std::to_string(s.K);
}

std::vector<Shape> shapes() {
  std::vector<Shape> v = {
      {{0, 1, 63, 64, 65, 300}, 7, 128, 320},   // half a 256-column tile; 2.5 k-blocks
      {{0, 1, 63, 64, 65, 300}, 0, 256, 512},
      {{65, 0, 300, 1, 64, 63}, 5, 384, 256},   // the second tile's upper half past N
      {{300, 63, 0, 64, 1, 65}, 3, 2880, 384},  // 11.25 tiles of 256 columns
      {{2000}, 0, 256, 128},                    // one expert, 16 units of 128 rows
  };
  std::mt19937 rng(7);  // many experts: more units than CTAs, each CTA runs several
  std::uniform_int_distribution<int32_t> rows(0, 160);
  Shape many{{}, 9, 512, 128};
  for (int e = 0; e < 160; ++e) many.rows_E.push_back(rows(rng));
  v.push_back(many);
  return v;
}

struct Problem {
  int E = 0;
  int64_t M = 0, N = 0, K = 0, S = 0, B = 0, ld_sa = 0;
  std::vector<int32_t> offsets;
  std::vector<uint8_t> a, b;
  std::vector<float> sa_SM, sb;

  // codes: random finite E4M3 (exact = false) or the integers -3..3 (exact block sums).
  Problem(const Shape& s, bool exact, std::mt19937& rng) {
    E = static_cast<int>(s.rows_E.size());
    N = s.N;
    K = s.K;
    offsets.assign(1, 0);
    for (int32_t r : s.rows_E) offsets.push_back(offsets.back() + r);
    M = offsets.back() + s.spare_rows;
    S = (K + 127) / 128;
    B = (N + 127) / 128;
    ld_sa = (M + 3) / 4 * 4;
    const uint8_t kInts[7] = {0xC8, 0xC0, 0xB8, 0x00, 0x38, 0x40, 0x48};  // e4m3 -3 .. 3
    std::uniform_int_distribution<int> byte(0, 255), pick(0, 6);
    auto code = [&]() -> uint8_t {
      if (exact) return kInts[pick(rng)];
      const int c = byte(rng);
      return static_cast<uint8_t>((c & 0x7F) == 0x7F ? c & 0xF0 : c);  // no NaN encodings
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
};

// Device copies of a problem and the argument block with plain row output (out: [M, N]).
struct DeviceProblem {
  Dev<uint8_t> a, b;
  Dev<float> sa, sb;
  Dev<int32_t> offsets;
  explicit DeviceProblem(const Problem& p) : a(p.a), b(p.b), sa(p.sa_SM), sb(p.sb), offsets(p.offsets) {}

  cuda::Fp8GroupedGemmArgs args(const Problem& p, Fp8Tile tile) const {
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
    x.ld_out = p.N;
    x.tile = tile;
    return x;
  }
};

std::vector<bf16_t> run_rows(const Problem& p, const DeviceProblem& d, Fp8Tile tile,
                             const int32_t* skip = nullptr) {
  Dev<bf16_t> out(static_cast<size_t>(p.M * p.N));  // 0xA5A5: rows outside the groups stay so
  cuda::Fp8GroupedGemmArgs x = d.args(p, tile);
  x.out_MN = out.ptr;
  x.skip = skip;
  cuda::fp8_grouped_gemm(x, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  return out.get();
}

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
  EXPECT_EQ(differ, 0u) << what;
}

TEST(GpuGemmFp8Tiles, PingPongEqualsCooperativeBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(31);
  for (const Shape& s : shapes()) {
    const Problem p(s, /*exact=*/false, rng);
    const DeviceProblem d(p);
    const std::vector<bf16_t> coop = run_rows(p, d, Fp8Tile::m128_n128);
    for (Fp8Tile t : kPingPong) expect_bitwise(coop, run_rows(p, d, t), p.N, "rows, " + name(t) + ", " + describe(s));
    size_t written = 0;  // the comparison is not vacuous
    for (int64_t i = 0; i < p.offsets.back() * p.N; ++i) written += coop[static_cast<size_t>(i)] != 0xA5A5;
    EXPECT_GT(written, static_cast<size_t>(p.offsets.back() * p.N) / 2) << describe(s);
  }
}

TEST(GpuGemmFp8Tiles, PingPongEqualsCpuTwinOnExactBlocks) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(32);
  for (const Shape& s : shapes()) {
    const Problem p(s, /*exact=*/true, rng);
    const DeviceProblem d(p);
    std::vector<bf16_t> cpu(static_cast<size_t>(p.M * p.N), static_cast<bf16_t>(0xA5A5));
    cpu::fp8_grouped_gemm_reference(p.a.data(), p.sa_SM.data(), p.ld_sa, p.b.data(), p.sb.data(),
                                    p.offsets.data(), p.E, p.N, p.K, cpu.data(), p.N, nullptr);
    for (Fp8Tile t : kPingPong) {
      expect_bitwise(cpu, run_rows(p, d, t), p.N, "cpu twin, " + name(t) + ", " + describe(s));
    }
  }
}

// Rows stored into combine slots (R = 1): both tiles write the same bytes to the same slots.
TEST(GpuGemmFp8Tiles, ScatterEpilogueEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(33);
  for (const Shape& s : shapes()) {
    const Problem p(s, /*exact=*/false, rng);
    const DeviceProblem d(p);
    const int top_k = 2;
    const int64_t T = (p.M + top_k - 1) / top_k + 3;
    std::vector<int32_t> slots(static_cast<size_t>(T * top_k));
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<int32_t> recv_src(slots.begin(), slots.begin() + p.M);
    for (int32_t& v : recv_src) v = encode_src(0, v / top_k, v % top_k, T, top_k);
    Dev<int32_t> dsrc(recv_src);
    std::vector<bf16_t> got[3];
    const Fp8Tile tiles[3] = {Fp8Tile::m128_n128, Fp8Tile::m64_n256, Fp8Tile::m64_n256_spread};
    for (int i = 0; i < 3; ++i) {
      Dev<bf16_t> combine(static_cast<size_t>(T * top_k * p.N));
      Dev<bf16_t*> table(std::vector<bf16_t*>{combine.ptr});
      cuda::Fp8GroupedGemmArgs x = d.args(p, tiles[i]);
      x.ld_out = 0;
      x.combine_R = table.ptr;
      x.recv_src_M = dsrc.ptr;
      x.T = T;
      x.top_k = top_k;
      cuda::fp8_grouped_gemm(x, nullptr);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      got[i] = combine.get();
    }
    expect_bitwise(got[0], got[1], p.N, "scatter, 64x256, " + describe(s));
    expect_bitwise(got[0], got[2], p.N, "scatter, 64x256-spread, " + describe(s));
    // Row m of the plain output is slot recv_src[m] of the combine buffer.
    const std::vector<bf16_t> plain = run_rows(p, d, Fp8Tile::m64_n256);
    for (int64_t m = 0; m < p.offsets.back(); ++m) {
      const int64_t slot = src_slot(recv_src[static_cast<size_t>(m)], T, top_k);
      for (int64_t n = 0; n < p.N; ++n) {
        ASSERT_EQ(got[1][static_cast<size_t>(slot * p.N + n)], plain[static_cast<size_t>(m * p.N + n)])
            << describe(s) << ": row " << m << " col " << n;
      }
    }
  }
}

// A received-rows operand (a_rows_1): codes then scales in one buffer, the count on the device.
TEST(GpuGemmFp8Tiles, ReceivedRowsOperandEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(34);
  for (const Shape& s : shapes()) {
    const Problem p(s, /*exact=*/false, rng);
    const int64_t count = p.offsets.back();
    const int64_t ld = fp8_rows_ld(count), scales_at = fp8_rows_scales_offset(count, p.K);
    // The TMA reads all M rows of codes; rows past the count (outside the groups) read whatever
    // follows them, so the buffer covers M rows too.
    std::vector<uint8_t> rows(static_cast<size_t>(std::max(fp8_rows_bytes(count, p.K), p.M * p.K)), 0);
    std::copy(p.a.begin(), p.a.begin() + count * p.K, rows.begin());
    for (int64_t kb = 0; kb < p.S; ++kb) {
      for (int64_t m = 0; m < count; ++m) {
        std::memcpy(&rows[static_cast<size_t>(scales_at + (kb * ld + m) * 4)],
                    &p.sa_SM[static_cast<size_t>(kb * p.ld_sa + m)], 4);
      }
    }
    const DeviceProblem d(p);
    Dev<uint8_t> drows(rows);
    Dev<int32_t> dcount(std::vector<int32_t>{static_cast<int32_t>(count)});
    std::vector<bf16_t> got[3];
    const Fp8Tile tiles[3] = {Fp8Tile::m128_n128, Fp8Tile::m64_n256, Fp8Tile::m64_n256_spread};
    for (int i = 0; i < 3; ++i) {
      Dev<bf16_t> out(static_cast<size_t>(p.M * p.N));
      cuda::Fp8GroupedGemmArgs x = d.args(p, tiles[i]);
      x.a_MK = drows.ptr;
      x.a_scales_SM = nullptr;
      x.ld_a_scales = 0;
      x.a_rows_1 = dcount.ptr;
      x.out_MN = out.ptr;
      cuda::fp8_grouped_gemm(x, nullptr);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      got[i] = out.get();
    }
    expect_bitwise(got[0], got[1], p.N, "received rows, 64x256, " + describe(s));
    expect_bitwise(got[0], got[2], p.N, "received rows, 64x256-spread, " + describe(s));
    // The same as the plain operand with its own scales.
    expect_bitwise(run_rows(p, d, Fp8Tile::m64_n256), got[1], p.N, "received vs plain, " + describe(s));
  }
}

TEST(GpuGemmFp8Tiles, PingPongSkipFlagLeavesOutputUntouched) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(35);
  const Problem p(shapes()[2], /*exact=*/false, rng);
  const DeviceProblem d(p);
  Dev<int32_t> skip(std::vector<int32_t>{1});
  for (Fp8Tile t : kPingPong) {
    for (bf16_t v : run_rows(p, d, t, skip.ptr)) ASSERT_EQ(v, 0xA5A5) << name(t);
  }
}

// Host only: EPMOE_FP8_TILE is parsed before any CUDA call (M = 0 launches nothing).
TEST(GpuGemmFp8Tiles, TileFromEnvironment) {
  const char* saved = std::getenv("EPMOE_FP8_TILE");
  const std::string saved_value = saved != nullptr ? saved : "";
  unsetenv("EPMOE_FP8_TILE");
  EXPECT_EQ(cuda::fp8_tile_from_env(), Fp8Tile::m128_n128);
  setenv("EPMOE_FP8_TILE", "64x256", 1);
  EXPECT_EQ(cuda::fp8_tile_from_env(), Fp8Tile::m64_n256);
  setenv("EPMOE_FP8_TILE", "64x256-spread", 1);
  EXPECT_EQ(cuda::fp8_tile_from_env(), Fp8Tile::m64_n256_spread);
  setenv("EPMOE_FP8_TILE", "128x128", 1);
  EXPECT_EQ(cuda::fp8_tile_from_env(), Fp8Tile::m128_n128);
  setenv("EPMOE_FP8_TILE", "256x64", 1);
  std::string field;
  try {
    cuda::fp8_tile_from_env();
  } catch (const Error& e) {
    field = e.argument();
  }
  EXPECT_EQ(field, "EPMOE_FP8_TILE");
  // Through the launcher, with M = 0 (nothing launched; pointers only need to pass the checks).
  alignas(16) static int32_t dummy[4] = {};
  cuda::Fp8GroupedGemmArgs x;
  x.b_ENK = reinterpret_cast<const uint8_t*>(dummy);
  x.b_scales_EBS = reinterpret_cast<const float*>(dummy);
  x.offsets_E1 = dummy;
  x.E = 1;
  x.M = 0;
  x.N = 128;
  x.K = 128;
  x.ld_out = 128;
  field.clear();
  try {
    cuda::fp8_grouped_gemm(x, nullptr);
  } catch (const Error& e) {
    field = e.argument();
  }
  EXPECT_EQ(field, "EPMOE_FP8_TILE");
  x.tile = Fp8Tile::m64_n256;  // an explicit tile does not read the environment
  EXPECT_NO_THROW(cuda::fp8_grouped_gemm(x, nullptr));
  if (saved != nullptr) {
    setenv("EPMOE_FP8_TILE", saved_value.c_str(), 1);
  } else {
    unsetenv("EPMOE_FP8_TILE");
  }
}

}  // namespace
}  // namespace epmoe::test
