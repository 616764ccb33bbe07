// The FP8 grouped GEMM's tiles (cuda/gemm/fp8_gemm.h Fp8Tile: cooperative 128 x 128 and 192 x 128,
// ping-pong 64 x 256 in its two tile orders) compute every output element alike: the same wgmma shape over each 128-deep
// k-block and the same per-block promotion in k order, so their outputs must agree bitwise on any
// input, here random E4M3 codes (all finite values) and random scales. Shapes: experts of 0, 1, 63,
// 64, 65, 300 rows (empty, a single row, around the 64-row tile and the 128-row unit), N of 128,
// 256, 384 (a half tile past N), 2880; partial k-blocks; more tiles than CTAs. Both epilogues
// (plain rows, rows scattered into combine slots) and the received-rows operand (a_rows_1). The
// other tiles are also compared with the CPU twin on exact blocks (bitwise, as in
// test_gpu_gemm_fp8.cpp), and the EPMOE_FP8_TILE parsing runs without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_terms.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cuda/gemm/fp8_gemm.h"
#include "device_buffer.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "fp8_gemm_problem.h"
#include "grouped_shape.h"
#include "require_gpu.h"
#include "scoped_env.h"

namespace epmoe::test {
namespace {

using cuda::Fp8Tile;

// The tiles compared with 128 x 128.
const Fp8Tile kOthers[3] = {Fp8Tile::m64_n256, Fp8Tile::m64_n256_spread, Fp8Tile::m192_n128};
const Fp8Tile kTiles[4] = {Fp8Tile::m128_n128, Fp8Tile::m64_n256, Fp8Tile::m64_n256_spread, Fp8Tile::m192_n128};

std::string name(Fp8Tile t) {
  switch (t) {
    case Fp8Tile::m64_n256: return "64x256";
    case Fp8Tile::m64_n256_spread: return "64x256-spread";
    case Fp8Tile::m192_n128: return "192x128";
    default: return "128x128";
  }
}

std::vector<GroupedShape> shapes() {
  std::vector<GroupedShape> v = {
      {{0, 1, 63, 64, 65, 300}, 7, 128, 320},   // half a 256-column tile; 2.5 k-blocks
      {{0, 1, 63, 64, 65, 300}, 0, 256, 512},
      {{65, 0, 300, 1, 64, 63}, 5, 384, 256},   // the second tile's upper half past N
      {{300, 63, 0, 64, 1, 65}, 3, 2880, 384},  // 11.25 tiles of 256 columns
      {{2000}, 0, 256, 128},                    // one expert, 16 units of 128 rows
  };
  std::mt19937 rng(7);  // many experts: more units than CTAs, each CTA runs several
  std::uniform_int_distribution<int32_t> rows(0, 160);
  GroupedShape many{{}, 9, 512, 128};
  for (int e = 0; e < 160; ++e) many.rows_E.push_back(rows(rng));
  v.push_back(many);
  return v;
}

// codes: random finite E4M3 (exact = false) or the integers -3..3 (exact block sums).
Fp8GemmProblem problem(const GroupedShape& s, bool exact, std::mt19937& rng) {
  Fp8GemmProblem p(s);
  std::uniform_int_distribution<int> byte(0, 255), pick(0, 6);
  p.fill(
      [&]() -> uint8_t {
        if (exact) return kE4m3Ints[pick(rng)];
        const int c = byte(rng);
        return static_cast<uint8_t>((c & 0x7F) == 0x7F ? c & 0xF0 : c);  // no NaN encodings
      },
      rng);
  return p;
}

std::vector<bf16_t> run_tile(const Fp8GemmProblem& p, const Fp8GemmDevice& d, Fp8Tile tile,
                             const int32_t* skip = nullptr) {
  cuda::Fp8GroupedGemmArgs x = d.args(p);
  x.tile = tile;
  x.skip = skip;
  return run_rows(p, x);
}

TEST(GpuGemmFp8Tiles, TilesEqualCooperativeBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(31);
  for (const GroupedShape& s : shapes()) {
    const Fp8GemmProblem p = problem(s, /*exact=*/false, rng);
    const Fp8GemmDevice d(p);
    const std::vector<bf16_t> coop = run_tile(p, d, Fp8Tile::m128_n128);
    for (Fp8Tile t : kOthers) expect_bitwise(coop, run_tile(p, d, t), p.N, "rows, " + name(t) + ", " + describe(s));
    // The comparison is not vacuous.
    EXPECT_LT(untouched(p, coop), static_cast<size_t>(p.offsets.back() * p.N) / 2) << describe(s);
  }
}

TEST(GpuGemmFp8Tiles, TilesEqualCpuTwinOnExactBlocks) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(32);
  for (const GroupedShape& s : shapes()) {
    const Fp8GemmProblem p = problem(s, /*exact=*/true, rng);
    const Fp8GemmDevice d(p);
    const std::vector<bf16_t> cpu = p.reference();
    for (Fp8Tile t : kOthers) {
      expect_bitwise(cpu, run_tile(p, d, t), p.N, "cpu twin, " + name(t) + ", " + describe(s));
    }
  }
}

// Rows stored into combine slots (R = 1): both tiles write the same bytes to the same slots.
TEST(GpuGemmFp8Tiles, ScatterEpilogueEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(33);
  for (const GroupedShape& s : shapes()) {
    const Fp8GemmProblem p = problem(s, /*exact=*/false, rng);
    const Fp8GemmDevice d(p);
    const ScatterSlots slots = scatter_slots(p.M, /*top_k=*/2, rng);
    Dev<int32_t> dsrc(slots.recv_src_M);
    std::vector<bf16_t> got[4];
    for (int i = 0; i < 4; ++i) {
      cuda::Fp8GroupedGemmArgs x = d.args(p);
      x.tile = kTiles[i];
      got[i] = run_scatter(p, x, slots, dsrc.ptr);
    }
    for (int i = 1; i < 4; ++i) expect_bitwise(got[0], got[i], p.N, "scatter, " + name(kTiles[i]) + ", " + describe(s));
    // Row m of the plain output is slot recv_src[m] of the combine buffer.
    const std::vector<bf16_t> plain = run_tile(p, d, Fp8Tile::m64_n256);
    for (int64_t m = 0; m < p.offsets.back(); ++m) {
      const int64_t slot = src_slot(slots.recv_src_M[static_cast<size_t>(m)], slots.T, slots.top_k);
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
  for (const GroupedShape& s : shapes()) {
    const Fp8GemmProblem p = problem(s, /*exact=*/false, rng);
    const Fp8GemmDevice d(p);
    Dev<uint8_t> drows(received_rows(p));
    Dev<int32_t> dcount(std::vector<int32_t>{p.offsets.back()});
    std::vector<bf16_t> got[4];
    for (int i = 0; i < 4; ++i) {
      cuda::Fp8GroupedGemmArgs x = with_received_rows(d.args(p), drows.ptr, dcount.ptr);
      x.tile = kTiles[i];
      got[i] = run_rows(p, x);
    }
    for (int i = 1; i < 4; ++i) {
      expect_bitwise(got[0], got[i], p.N, "received rows, " + name(kTiles[i]) + ", " + describe(s));
    }
    // The same as the plain operand with its own scales.
    expect_bitwise(run_tile(p, d, Fp8Tile::m64_n256), got[1], p.N, "received vs plain, " + describe(s));
  }
}

// Tiles trimmed to their 64-row blocks (Fp8GroupedGemmArgs::trim_rows = 1, the default: A loaded
// and multiplied only where a tile has rows) equal whole tiles bitwise, on both cooperative tiles
// and both main loops, for plain rows and combine slots. Row counts around 64, 128 and 192 give
// tiles of one, two and three live blocks.
TEST(GpuGemmFp8Tiles, TrimmedTilesEqualWholeTilesBitwise) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(36);
  std::vector<GroupedShape> v = shapes();
  v.push_back({{129, 191, 192, 193, 127, 128, 0, 257, 320, 385}, 4, 384, 640});
  v.push_back({{1, 65, 130, 250, 64}, 0, 2880, 256});
  for (const GroupedShape& s : v) {
    const Fp8GemmProblem p = problem(s, /*exact=*/false, rng);
    const Fp8GemmDevice d(p);
    const ScatterSlots slots = scatter_slots(p.M, /*top_k=*/2, rng);
    Dev<int32_t> dsrc(slots.recv_src_M);
    for (Fp8Tile t : {Fp8Tile::m128_n128, Fp8Tile::m192_n128}) {
      for (int overlap : {0, 1}) {
        if (t == Fp8Tile::m192_n128 && overlap == 1) continue;  // one block accumulator there
        std::vector<bf16_t> rows[2], scattered[2];
        for (int trim : {0, 1}) {
          cuda::Fp8GroupedGemmArgs x = d.args(p);
          x.tile = t;
          x.overlap = overlap;
          x.trim_rows = trim;
          rows[trim] = run_rows(p, x);
          scattered[trim] = run_scatter(p, x, slots, dsrc.ptr);
        }
        const std::string what = name(t) + " overlap " + std::to_string(overlap) + ", " + describe(s);
        expect_bitwise(rows[0], rows[1], p.N, "trimmed rows, " + what);
        expect_bitwise(scattered[0], scattered[1], p.N, "trimmed scatter, " + what);
        EXPECT_LT(untouched(p, rows[1]), static_cast<size_t>(p.offsets.back() * p.N) / 2) << what;
      }
    }
  }
}

// Host only: EPMOE_FP8_TRIM_ROWS decides where trim_rows = -1 (unset: trimmed); 0 and 1 decide
// themselves. The layer's rule: trimmed from 256 rows per expert, the variable over it.
TEST(GpuGemmFp8Tiles, TrimRowsFromEnvironment) {
  {
    const ScopedEnv unset("EPMOE_FP8_TRIM_ROWS", nullptr);
    EXPECT_TRUE(cuda::fp8_trim_rows_selected(-1));
    EXPECT_FALSE(cuda::fp8_trim_rows_selected(0));
  }
  {
    const ScopedEnv off("EPMOE_FP8_TRIM_ROWS", "0");
    EXPECT_FALSE(cuda::fp8_trim_rows_selected(-1));
    EXPECT_TRUE(cuda::fp8_trim_rows_selected(1));
  }
  {
    const ScopedEnv unset("EPMOE_FP8_TRIM_ROWS", nullptr);
    const Fp8Tile t128 = Fp8Tile::m128_n128;
    EXPECT_EQ(cuda::fp8_trim_rows_rule(128, t128), 0);   // deepseek-v3
    EXPECT_EQ(cuda::fp8_trim_rows_rule(255, t128), 0);
    EXPECT_EQ(cuda::fp8_trim_rows_rule(256, t128), 1);   // gpt-oss-120b
    EXPECT_EQ(cuda::fp8_trim_rows_rule(2048, t128), 1);  // mixtral-8x7b
    EXPECT_EQ(cuda::fp8_trim_rows_rule(128, Fp8Tile::m192_n128), 1);  // the tall tile: always
    const ScopedEnv on("EPMOE_FP8_TRIM_ROWS", "1");
    EXPECT_EQ(cuda::fp8_trim_rows_rule(128, t128), 1);
  }
  {
    const ScopedEnv off("EPMOE_FP8_TRIM_ROWS", "0");
    EXPECT_EQ(cuda::fp8_trim_rows_rule(128, Fp8Tile::m192_n128), 0);
  }
  const ScopedEnv bad("EPMOE_FP8_TRIM_ROWS", "yes");
  std::string field;
  try {
    cuda::fp8_trim_rows_selected(-1);
  } catch (const Error& e) {
    field = e.argument();
  }
  EXPECT_EQ(field, "EPMOE_FP8_TRIM_ROWS");
}

TEST(GpuGemmFp8Tiles, SkipFlagLeavesOutputUntouched) {
  EPMOE_REQUIRE_GPU();
  std::mt19937 rng(35);
  const Fp8GemmProblem p = problem(shapes()[2], /*exact=*/false, rng);
  const Fp8GemmDevice d(p);
  Dev<int32_t> skip(std::vector<int32_t>{1});
  for (Fp8Tile t : kOthers) {
    for (bf16_t v : run_tile(p, d, t, skip.ptr)) ASSERT_EQ(v, 0xA5A5) << name(t);
  }
}

// Host only: the tile of the D-wide GEMMs (W2 FPROP, W13 DGRAD) by the rule (K against N, then rows
// per expert), and EPMOE_FP8_TILE over it when set.
TEST(GpuGemmFp8Tiles, TileForDRowsRule) {
  const ScopedEnv unset("EPMOE_FP8_TILE", nullptr);
  EXPECT_EQ(cuda::fp8_tile_for_d_rows(2048, 768, 512), Fp8Tile::m64_n256_spread);  // qwen3 W2 FPROP
  EXPECT_EQ(cuda::fp8_tile_for_d_rows(7168, 4096, 128), Fp8Tile::m192_n128);        // deepseek W13 DGRAD
  EXPECT_EQ(cuda::fp8_tile_for_d_rows(7168, 2048, 192), Fp8Tile::m192_n128);
  EXPECT_EQ(cuda::fp8_tile_for_d_rows(7168, 2048, 193), Fp8Tile::m64_n256_spread);
  EXPECT_EQ(cuda::fp8_tile_for_d_rows(2880, 2880, 256), Fp8Tile::m128_n128);        // gpt-oss W2 FPROP
  EXPECT_EQ(cuda::fp8_tile_for_d_rows(4096, 28672, 2048), Fp8Tile::m128_n128);      // mixtral W13 DGRAD
  EXPECT_EQ(cuda::fp8_tile_for_d_rows(2880, 2880, 64), Fp8Tile::m128_n128);         // K >= N: rows aside
  const ScopedEnv forced("EPMOE_FP8_TILE", "128x128");
  EXPECT_EQ(cuda::fp8_tile_for_d_rows(2048, 768, 128), Fp8Tile::m128_n128);
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
  setenv("EPMOE_FP8_TILE", "192x128", 1);
  EXPECT_EQ(cuda::fp8_tile_from_env(), Fp8Tile::m192_n128);
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
