// The whole routed-experts layer on one GPU through the public API (EP = 1): against the CPU
// backend on identical inputs (tolerance table), against the float64 reference, fused vs unfused
// (bitwise), repeat runs (bitwise), CUDA-graph replay with new routings vs eager (bitwise), edge
// routings, capacity overflow and bad ids reported through check() on a context that stays usable.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "captured_step.h"
#include "device_call.h"
#include "moe_case.h"
#include "output_compare.h"
#include "scoped_env.h"
#include "require_gpu.h"
#include "tolerances.h"

namespace epmoe::test {
namespace {

std::unique_ptr<Context> gpu_context(const Problem& p) {
  return Context::create(p.config(), make_single_gpu_transport(0));
}


std::vector<RankOutputs> run_gpu_layer(const Problem& p, const RankInputs& in) {
  auto ctx = gpu_context(p);
  DeviceCall call(p, in);
  std::vector<RankOutputs> out{run_once(*ctx, call, nullptr)};
  ctx->close();
  return out;
}

void expect_gpu_matches_cpu(const Problem& p, const RankInputs& in, const std::string& what) {
  const std::vector<RankInputs> all{in};
  const auto gpu = run_gpu_layer(p, in);
  const auto cpu = run_layer(p, all);
  const OutputErrors vs_cpu = compare(gpu, cpu);
  const OutputErrors vs_ref = measure(gpu, reference_layer(p, all), all);
  report_errors(what + " gpu vs cpu", vs_cpu);
  report_errors(what + " gpu vs float64", vs_ref);
  for (int o = 0; o < kNumOutputs; ++o) {
    const Output out = static_cast<Output>(o);
    EXPECT_LE(vs_cpu[out], backend_rel_l2_bound(Precision::bf16, out))
        << what << ": " << to_string(out) << " CUDA vs CPU backend (" << vs_cpu.to_string() << ")";
  }
  expect_within_tolerance(vs_ref, what + " (CUDA vs float64)");
}

Problem problem(int64_t T, int64_t D, int64_t F, int experts, int K) {
  return make_problem(1, T, D, F, K, experts);
}

// A problem and the live tokens its inputs hold.
struct TokensCase {
  Problem p;
  int64_t tokens;
};

TEST(GpuContext, MatchesCpuBackendAndReference) {
  EPMOE_REQUIRE_GPU();
  std::vector<TokensCase> cases;
  cases.push_back({problem(64, 128, 96, 8, 2), 64});      // ci-tiny
  cases.push_back({problem(333, 256, 520, 16, 4), 333});  // ragged tiles in every dimension
  cases.push_back({problem(512, 1024, 768, 8, 2), 512});  // many k-blocks, several tiles
  cases.push_back({problem(1, 64, 64, 4, 2), 1});         // T = 1
  Problem clamped = problem(96, 192, 136, 8, 2);
  clamped.act = Activation::swiglu_clamped();
  cases.push_back({clamped, 96});
  Problem f32 = problem(80, 128, 64, 6, 3);
  f32.wgrad_dtype = DType::f32;
  cases.push_back({f32, 80});
  uint64_t seed = 11;
  for (const TokensCase& c : cases) {
    const auto in = make_inputs(c.p, seed++, c.tokens);
    expect_gpu_matches_cpu(c.p, in[0], c.p.name());
  }
}

// W13 overlapped with dispatch (programmatic launch, arrival counters) computes the same rows as
// the staged sequence: bitwise equal, forward and backward, on random and edge routings.
TEST(GpuContext, ArrivalGatedEqualsStagedBitwise) {
  EPMOE_REQUIRE_GPU();
  struct Case {
    Problem p;
    int64_t live;
    Router router;
  };
  const auto one_expert = [](int, int64_t, int, std::mt19937_64&) -> int64_t { return 3; };
  const auto two_experts = [](int, int64_t t, int k, std::mt19937_64&) -> int64_t {
    return (t + k) % 2 ? 5 : 2;  // zero-token experts around them
  };
  std::vector<Case> cases = {
      {problem(333, 256, 520, 16, 4), 333, nullptr},   // ragged tiles
      {problem(1024, 512, 256, 8, 2), 1024, nullptr},  // many 128-row arrival blocks per expert
      {problem(1, 64, 64, 4, 2), 1, nullptr},          // T = 1
      {problem(130, 128, 96, 8, 2), 77, nullptr},      // live count below T
      {problem(130, 128, 96, 8, 2), 0, nullptr},       // no live tokens
      {problem(300, 128, 96, 8, 2), 300, one_expert},
      {problem(300, 128, 96, 8, 2), 300, two_experts},
  };
  uint64_t seed = 70;
  for (const Case& c : cases) {
    Router router = c.router ? c.router : distinct_router(c.p.experts, c.p.top_k);
    auto in = make_inputs(c.p, seed++, c.p.max_tokens, router)[0];
    in.live = c.live;
    Problem gated = c.p, staged = c.p;
    gated.arrival_gated_w13 = true;
    staged.arrival_gated_w13 = false;
    expect_bitwise_equal(run_gpu_layer(gated, in), run_gpu_layer(staged, in),
                         c.p.name() + " live " + std::to_string(c.live) + ": gated vs staged");
  }
}

TEST(GpuContext, FusedEqualsUnfusedBitwise) {
  EPMOE_REQUIRE_GPU();
  for (bool clamped : {false, true}) {
    Problem p = problem(200, 256, 200, 8, 2);
    if (clamped) p.act = Activation::swiglu_clamped();
    const auto in = make_inputs(p, 5, 200);
    Problem unfused = p;
    unfused.fused = false;
    const std::vector<RankOutputs> fused = run_gpu_layer(p, in[0]);
    expect_bitwise_equal(fused, run_gpu_layer(unfused, in[0]), p.name() + " vs unfused");
    // The fused W2 DGRAD stage with the SwiGLU backward in the GEMM's epilogue instead of the
    // kernel after it (the default): the same bits.
    const ScopedEnv epilogue("EPMOE_SWIGLU_BACKWARD", "epilogue");
    expect_bitwise_equal(fused, run_gpu_layer(p, in[0]), p.name() + " SwiGLU backward epilogue");
  }
}

// The ping-pong consumer schedule (64-row tiles, one warpgroup each) computes every output element
// with the same k-order as the cooperative one: the results are bitwise equal.
TEST(GpuContext, PingPongScheduleEqualsCooperativeBitwise) {
  EPMOE_REQUIRE_GPU();
  std::vector<TokensCase> cases;
  cases.push_back({problem(333, 256, 520, 16, 4), 333});
  // More k-blocks than pipeline stages and many tiles per CTA: the warpgroups' turns matter.
  cases.push_back({problem(2048, 1024, 768, 4, 2), 2048});
  Problem clamped = problem(300, 512, 256, 8, 2);
  clamped.act = Activation::swiglu_clamped();
  cases.push_back({clamped, 300});
  Problem f32 = problem(200, 256, 192, 6, 3);
  f32.wgrad_dtype = DType::f32;
  cases.push_back({f32, 200});
  uint64_t seed = 71;
  for (const TokensCase& c : cases) {
    const auto in = make_inputs(c.p, seed++, c.tokens);
    const auto cooperative = run_gpu_layer(c.p, in[0]);
    setenv("EPMOE_GEMM_SCHEDULE", "pingpong", 1);
    std::vector<RankOutputs> pingpong;
    try {
      pingpong = run_gpu_layer(c.p, in[0]);
    } catch (const Error& e) {
      unsetenv("EPMOE_GEMM_SCHEDULE");
      GTEST_SKIP() << "ping-pong schedule not in this build (EPMOE_GEMM_CONFIGS=CI): " << e.what();
    }
    unsetenv("EPMOE_GEMM_SCHEDULE");
    expect_bitwise_equal(pingpong, cooperative, c.p.name() + " ping-pong vs cooperative");
  }
}

// CTA pairs multicasting B (EPMOE_GEMM_CLUSTER=2) give the bits of single CTAs, under both
// schedules: odd m-tile counts (a pair's tile past the group, rows and reduction grouping), experts
// with no rows, one m-tile per expert, many tiles per CTA, f32 weight gradients.
TEST(GpuContext, ClusterPairsEqualSingleCtasBitwise) {
  EPMOE_REQUIRE_GPU();
  std::vector<TokensCase> cases;
  cases.push_back({problem(333, 256, 520, 16, 4), 333});  // 2F = 1040: 9 WGRAD m-tiles
  cases.push_back({problem(2048, 1024, 768, 4, 2), 2048});
  cases.push_back({problem(40, 128, 96, 64, 2), 40});     // most experts empty
  Problem clamped = problem(300, 512, 256, 8, 2);
  clamped.act = Activation::swiglu_clamped();
  cases.push_back({clamped, 300});
  Problem f32 = problem(200, 256, 192, 6, 3);
  f32.wgrad_dtype = DType::f32;
  cases.push_back({f32, 200});
  uint64_t seed = 91;
  for (const char* schedule : {"cooperative", "pingpong"}) {
    for (const TokensCase& c : cases) {
      const auto in = make_inputs(c.p, seed++, c.tokens);
      setenv("EPMOE_GEMM_SCHEDULE", schedule, 1);
      std::vector<RankOutputs> single, pairs;
      try {
        single = run_gpu_layer(c.p, in[0]);
        setenv("EPMOE_GEMM_CLUSTER", "2", 1);
        pairs = run_gpu_layer(c.p, in[0]);
      } catch (const Error& e) {
        unsetenv("EPMOE_GEMM_SCHEDULE");
        unsetenv("EPMOE_GEMM_CLUSTER");
        GTEST_SKIP() << "clustered kernels not in this build (EPMOE_GEMM_CONFIGS=CI): " << e.what();
      }
      unsetenv("EPMOE_GEMM_SCHEDULE");
      unsetenv("EPMOE_GEMM_CLUSTER");
      expect_bitwise_equal(pairs, single, c.p.name() + " " + schedule + " pairs vs single CTAs");
    }
  }
}

// WGRAD cases: 2F = 1040 (an edge m-tile) and F = 520 (an edge n-tile), experts with no rows (zero
// tiles), several tiles per CTA, more k-blocks than stages.
std::vector<TokensCase> wgrad_cases() {
  return {{problem(333, 256, 520, 16, 4), 333},
          {problem(40, 128, 96, 64, 2), 40},
          {problem(2048, 1024, 768, 4, 2), 2048},
          {problem(4096, 2048, 1024, 8, 2), 4096}};
}

// The bf16 WGRAD stored by the threads (EPMOE_WGRAD_STORE=direct, 4 stages) gives the bits of
// the TMA-store epilogue (3 stages): the same fp32 sums rounded once; so do the TMA stores issued
// by the producer warpgroup's store warp (EPMOE_WGRAD_STORE=tma_warp). The wgrad_cases(), and
// clusters of two where the build has them.
TEST(GpuContext, WgradStoresEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  uint64_t seed = 131;
  for (const TokensCase& c : wgrad_cases()) {
    const auto in = make_inputs(c.p, seed++, c.tokens);
    std::vector<RankOutputs> tma;
    {
      const ScopedEnv store("EPMOE_WGRAD_STORE", "tma");
      tma = run_gpu_layer(c.p, in[0]);
    }
    {
      const ScopedEnv warp("EPMOE_WGRAD_STORE", "tma_warp");
      expect_bitwise_equal(run_gpu_layer(c.p, in[0]), tma,
                           c.p.name() + " WGRAD stores issued by the producer warpgroup's store warp");
    }
    const ScopedEnv store("EPMOE_WGRAD_STORE", "direct");
    const std::string what = c.p.name() + " WGRAD stored directly vs through the TMA";
    expect_bitwise_equal(run_gpu_layer(c.p, in[0]), tma, what);
    std::vector<RankOutputs> pairs;
    try {
      const ScopedEnv cluster("EPMOE_GEMM_CLUSTER", "2");
      pairs = run_gpu_layer(c.p, in[0]);
    } catch (const Error&) {
      continue;  // EPMOE_GEMM_CONFIGS=CI: no clustered kernels
    }
    expect_bitwise_equal(pairs, tma, what + ", CTA pairs");
  }
}

// WGRAD cases for the k-tail and the tile sequence: groups ending inside a k-block (at and off a
// 16-row step), groups of whole k-blocks, groups of less than one k-block, experts with no rows,
// one and many tiles per CTA, experts with more k-blocks than stages.
std::vector<TokensCase> wgrad_tail_cases() {
  return {{problem(333, 256, 520, 16, 4), 333},   {problem(40, 128, 96, 64, 2), 40},
          {problem(256, 256, 128, 4, 2), 256},    {problem(2048, 1024, 768, 4, 2), 2048},
          {problem(3001, 2048, 1024, 32, 4), 3001}, {problem(1200, 512, 256, 32, 4), 1200},
          {problem(4096, 2048, 1024, 8, 2), 4096}};
}

// The bf16 WGRAD's loop with the partial k-block peeled out of it (the default: only the k-steps of
// 16 rows that hold group rows run, the rows past the group zeroed up to the next 16) gives the bits
// of the loop that retires every batch and runs all four k-steps of the zeroed block
// (EPMOE_WGRAD_PEEL=0; the same k-order, skipped steps add exact zeros), on the TMA-store and the
// direct-store kernels, on the wgrad_tail_cases().
TEST(GpuContext, WgradMainloopsEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  const std::vector<TokensCase> cases = wgrad_tail_cases();
  struct Variant {
    const char* store;
    const char* peel;
  };
  const Variant variants[] = {{"tma", "1"}, {"direct", "1"}, {"direct", "0"}};
  uint64_t seed = 151;
  for (const TokensCase& c : cases) {
    const auto in = make_inputs(c.p, seed++, c.tokens);
    std::vector<RankOutputs> plain;
    {
      const ScopedEnv store("EPMOE_WGRAD_STORE", "tma"), peel("EPMOE_WGRAD_PEEL", "0");
      plain = run_gpu_layer(c.p, in[0]);
    }
    for (const Variant& v : variants) {
      const ScopedEnv store("EPMOE_WGRAD_STORE", v.store), peel("EPMOE_WGRAD_PEEL", v.peel);
      expect_bitwise_equal(run_gpu_layer(c.p, in[0]), plain,
                           c.p.name() + " WGRAD store " + v.store + ", peel " + v.peel +
                               " vs the loop retiring every batch");
    }
  }
}

// The TMA-store WGRAD on 128 x 192 tiles with four stages (EPMOE_WGRAD_TILE=128x192, built with
// EPMOE_GEMM_CONFIGS=ALL) gives the bits of the 128 x 256 tile: every output element sums the same
// k-steps in the same order. Peeled and unpeeled loops on the wgrad_cases() (partial last n-tiles:
// 520 = 2 x 192 + 136, 256 = 192 + 64).
TEST(GpuContext, WgradTilesEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  uint64_t seed = 171;
  for (const TokensCase& c : wgrad_cases()) {
    const auto in = make_inputs(c.p, seed++, c.tokens);
    for (const char* peel : {"1", "0"}) {
      const ScopedEnv store("EPMOE_WGRAD_STORE", "tma"), peeled("EPMOE_WGRAD_PEEL", peel);
      std::vector<RankOutputs> wide, narrow;
      {
        const ScopedEnv tile("EPMOE_WGRAD_TILE", "128x256");
        wide = run_gpu_layer(c.p, in[0]);
      }
      try {
        const ScopedEnv tile("EPMOE_WGRAD_TILE", "128x192");
        narrow = run_gpu_layer(c.p, in[0]);
      } catch (const Error& e) {
        GTEST_SKIP() << "128 x 192 WGRAD not in this build (EPMOE_GEMM_CONFIGS=CI): " << e.what();
      }
      expect_bitwise_equal(narrow, wide,
                           c.p.name() + " WGRAD 128 x 192 vs 128 x 256, peel " + peel);
    }
  }
}

// Runs fn(case, inputs, the case unfused, schedule) for each case (inputs of seeds seed, seed + 1,
// ...) under each rows-GEMM schedule, forced on W2 FPROP, W2 DGRAD and W13 DGRAD for fn's scope.
template <class Fn>
void for_each_rows_schedule(const std::vector<TokensCase>& cases, uint64_t seed, Fn fn) {
  for (const TokensCase& c : cases) {
    const auto in = make_inputs(c.p, seed++, c.tokens);
    Problem unfused = c.p;
    unfused.fused = false;
    for (const char* schedule : {"cooperative", "pingpong"}) {
      const ScopedEnv w2f("EPMOE_GEMM_SCHEDULE_W2_FPROP", schedule),
          w2d("EPMOE_GEMM_SCHEDULE_W2_DGRAD", schedule), w13d("EPMOE_GEMM_SCHEDULE_W13_DGRAD", schedule);
      fn(c, in[0], unfused, schedule);
      if (::testing::Test::IsSkipped()) return;  // fn's GTEST_SKIP returns from fn only
    }
  }
}

// W2 FPROP, W2 DGRAD and W13 DGRAD on 192-column rows tiles (EPMOE_GEMM_ROWS_TILE_N=192, built
// with EPMOE_GEMM_CONFIGS=ALL) give the bits of the 256-column tiles: every output element sums the
// same k-steps in the same order. Under both schedules, fused (the scatter epilogues; the SwiGLU
// backward as the kernel and in the W2 DGRAD epilogue) and unfused (the plain rows epilogue): D = F
// = 576 (3 tiles of 192, 2.25 of 256), D = 960 and F = 384 with experts spanning several m-tiles,
// and D = 512, F = 256 (partial last 192-column tiles), clamped SwiGLU.
TEST(GpuContext, RowsTileWidthsEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  std::vector<TokensCase> cases;
  cases.push_back({problem(333, 576, 576, 16, 4), 333});
  cases.push_back({problem(1024, 960, 384, 4, 2), 1024});
  Problem clamped = problem(300, 512, 256, 8, 2);
  clamped.act = Activation::swiglu_clamped();
  cases.push_back({clamped, 300});
  cases.push_back({problem(200, 256, 200, 8, 2), 200});  // F = 200: partial tiles of either width
  for_each_rows_schedule(cases, 191, [](const TokensCase& c, const RankInputs& in, const Problem& unfused,
                                         const char* schedule) {
    for (const char* swiglu_backward : {"kernel", "epilogue"}) {
      const ScopedEnv sb("EPMOE_SWIGLU_BACKWARD", swiglu_backward);
      std::vector<RankOutputs> wide, narrow, wide_unfused, narrow_unfused;
      {
        const ScopedEnv width("EPMOE_GEMM_ROWS_TILE_N", "256");
        wide = run_gpu_layer(c.p, in);
        wide_unfused = run_gpu_layer(unfused, in);
      }
      try {
        const ScopedEnv width("EPMOE_GEMM_ROWS_TILE_N", "192");
        narrow = run_gpu_layer(c.p, in);
        narrow_unfused = run_gpu_layer(unfused, in);
      } catch (const Error& e) {
        GTEST_SKIP() << "192-column rows tiles and ping-pong not in this build (EPMOE_GEMM_CONFIGS=CI): "
                     << e.what();
      }
      const std::string what = c.p.name() + " " + schedule + ", SwiGLU backward " + swiglu_backward;
      expect_bitwise_equal(narrow, wide, what + ": rows tiles 192 vs 256 columns");
      expect_bitwise_equal(narrow_unfused, wide_unfused, what + ", unfused: rows tiles 192 vs 256");
      expect_bitwise_equal(narrow_unfused, narrow, what + ": 192 columns, unfused vs fused");
    }
  });
}

// m-tile bands (EPMOE_GEMM_BAND_ROWS) reorder the rows GEMMs' tiles only: 128 rows make every
// m-tile (cooperative) or pair of them (ping-pong) a band; 192 and 320 leave short last bands
// (512 rows in ping-pong tiles: 8 m-tiles of 64 in bands of 3, 3, 2; 700 rows: 11 in 4, 4, 3).
TEST(GpuContext, BandsEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  std::vector<TokensCase> cases;
  cases.push_back({problem(1024, 960, 384, 4, 2), 1024});  // ~512 rows per expert
  Problem clamped = problem(700, 512, 256, 2, 2);           // every token on both experts: 700 rows
  clamped.act = Activation::swiglu_clamped();
  cases.push_back({clamped, 700});
  for_each_rows_schedule(cases, 211, [](const TokensCase& c, const RankInputs& in, const Problem& unfused,
                                         const char* schedule) {
    std::vector<RankOutputs> whole, whole_unfused;
    try {
      const ScopedEnv none("EPMOE_GEMM_BAND_ROWS", "0");
      whole = run_gpu_layer(c.p, in);
      whole_unfused = run_gpu_layer(unfused, in);
    } catch (const Error& e) {
      GTEST_SKIP() << "ping-pong not in this build (EPMOE_GEMM_CONFIGS=CI): " << e.what();
    }
    for (const char* rows : {"128", "192", "320"}) {
      const ScopedEnv band("EPMOE_GEMM_BAND_ROWS", rows);
      const std::string what = c.p.name() + " " + schedule + ", bands of " + rows + " rows";
      expect_bitwise_equal(run_gpu_layer(c.p, in), whole, what + " vs none");
      expect_bitwise_equal(run_gpu_layer(unfused, in), whole_unfused, what + ", unfused vs none");
    }
  });
}

TEST(GpuContext, RepeatRunsAreBitwiseEqual) {
  EPMOE_REQUIRE_GPU();
  const Problem p = problem(300, 512, 256, 16, 4);
  const auto in = make_inputs(p, 7, 300);
  auto ctx = gpu_context(p);
  DeviceCall call(p, in[0]);
  const std::vector<RankOutputs> first{run_once(*ctx, call, nullptr)};
  const std::vector<RankOutputs> second{run_once(*ctx, call, nullptr)};
  expect_bitwise_equal(first, second, "repeat on one context");
  ctx->close();
}

// One forward + backward captured from `captured` on a context of its own, replayed with new
// routings (same x, weights, grad_y: seed 100, T = 256; ids and scores of seeds 2-5; live counts
// 256, 100, 1, 256): every replay bitwise equal to an eager call on a second context.
void expect_replays_equal_eager(const Problem& p, const RankInputs& captured,
                                const std::string& what) {
  auto routing = [&](uint64_t seed, int64_t live) {
    return rerouted(p, 100, seed, 256, {live})[0];
  };
  auto graph_ctx = gpu_context(p);
  DeviceCall call(p, captured);
  CapturedStep step(*graph_ctx, call);
  auto eager_ctx = gpu_context(p);
  for (const auto& [seed, live] : std::vector<std::pair<uint64_t, int64_t>>{{2, 256}, {3, 100}, {4, 1}, {5, 256}}) {
    const RankInputs in = routing(seed, live);
    const std::vector<RankOutputs> replayed{step.replay(in)};
    DeviceCall eager_call(p, in);
    const std::vector<RankOutputs> eager{run_once(*eager_ctx, eager_call, nullptr)};
    expect_bitwise_equal(replayed, eager, what + "graph replay, routing seed " +
                                              std::to_string(seed) + " live " + std::to_string(live));
  }
  graph_ctx->close();
  eager_ctx->close();
}

TEST(GpuContext, GraphReplayWithNewRoutingsEqualsEager) {
  EPMOE_REQUIRE_GPU();
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 1.0;
  expect_replays_equal_eager(p, rerouted(p, 100, 1, 256, {256})[0], "");
}

// Per-rank combine (Config.combine = per_rank, inference) at EP = 1: one partial per token, so
// y is bitwise the per-route combine's; fused == unfused bitwise; against the CPU backend's
// per-rank y (tolerance table); a captured forward replayed with new routings equals eager.
TEST(GpuContext, PerRankCombineEqualsPerRouteBitwiseAndReplays) {
  EPMOE_REQUIRE_GPU();
  Problem p = problem(256, 256, 192, 8, 4);
  p.inference = true;
  p.combine = CombineMode::per_rank;
  // Same x and weights every time; a new routing per seed.
  auto routing = [&](uint64_t seed, int64_t live) {
    return rerouted(p, 100, seed, 256, {live})[0];
  };
  auto forward_y = [&](const Problem& q, const RankInputs& in) {
    auto ctx = gpu_context(q);
    DeviceCall call(q, in);
    std::vector<bf16_t> y = run_forward_once(*ctx, call, nullptr);
    ctx->close();
    return y;
  };
  const RankInputs first = routing(1, 256);
  const std::vector<bf16_t> per_rank = forward_y(p, first);
  Problem q = p;
  q.combine = CombineMode::per_route;
  EXPECT_EQ(per_rank, forward_y(q, first)) << "per_rank vs per_route at EP = 1";
  q = p;
  q.fused = false;
  EXPECT_EQ(per_rank, forward_y(q, first)) << "per_rank fused vs unfused";
  {
    std::vector<RankOutputs> gpu(1), cpu(1);
    gpu[0].y_TD = per_rank;
    with_contexts(p, [&](int, Context& ctx) {
      RankCall call(p, first);
      ForwardArgs a = call.forward_args();
      a.save_for_backward = false;
      ctx.forward(a);
      cpu[0].y_TD = call.y;
    });
    const double err = compare(gpu, cpu)[Output::y];
    EXPECT_LE(err, backend_rel_l2_bound(Precision::bf16, Output::y)) << "per_rank CUDA vs CPU y";
  }

  auto graph_ctx = gpu_context(p);
  DeviceCall call(p, first);
  CapturedStep step(*graph_ctx, call, Pass::forward);
  auto eager_ctx = gpu_context(p);
  for (const auto& [seed, live] : std::vector<std::pair<uint64_t, int64_t>>{{2, 256}, {3, 100}, {4, 1}, {5, 256}}) {
    const RankInputs in = routing(seed, live);
    const std::vector<bf16_t> replayed = step.replay_y(in);
    DeviceCall eager_call(p, in);
    EXPECT_EQ(replayed, run_forward_once(*eager_ctx, eager_call, nullptr))
        << "per_rank graph replay, routing seed " << seed << " live " << live;
  }
  graph_ctx->close();
  eager_ctx->close();
}

// Training with the per-rank combine at EP = 1: every output bitwise the per-route combine's
// (one partial per token; grad_scores in the same order on the expert side), against the CPU
// backend and the float64 reference, and a captured forward + backward replayed with new
// routings equal to eager.
TEST(GpuContext, PerRankCombineTrainingEqualsPerRouteBitwiseAndReplays) {
  EPMOE_REQUIRE_GPU();
  Problem p = problem(256, 256, 192, 8, 4);
  p.combine = CombineMode::per_rank;
  const RankInputs first = make_inputs(p, 100, 256)[0];
  const auto per_rank = run_gpu_layer(p, first);
  Problem q = p;
  q.combine = CombineMode::per_route;
  expect_bitwise_equal(per_rank, run_gpu_layer(q, first), "per_rank vs per_route at EP = 1");
  q = p;
  q.fused = false;
  expect_bitwise_equal(per_rank, run_gpu_layer(q, first), "per_rank fused vs unfused");
  expect_gpu_matches_cpu(p, first, "per_rank");

  // The captured call passes num_tokens_1 (live = T): captured without it, the graph reads no
  // live count and every replay runs all T tokens, whatever live set_routing writes.
  RankInputs captured = first;
  captured.live = 256;
  expect_replays_equal_eager(p, captured, "per_rank ");
}

TEST(GpuContext, EdgeRoutingsMatchCpu) {
  EPMOE_REQUIRE_GPU();
  const Problem base_problem = problem(130, 128, 96, 8, 2);
  struct Edge {
    const char* name;
    Router router;
    int64_t live;
  };
  const std::vector<Edge> edges = {
      {"zero-token experts", [](int, int64_t t, int k, std::mt19937_64&) -> int64_t { return (t + k) % 2 ? 5 : 2; }, -1},
      {"all routes to one expert", [](int, int64_t, int, std::mt19937_64&) -> int64_t { return 3; }, -1},
      {"inactive routes", [](int, int64_t t, int k, std::mt19937_64&) -> int64_t { return (t % 3 == 0 || k == 1) ? -1 : t % 8; }, -1},
      {"live count below T", distinct_router(8, 2), 77},
      {"no live tokens", distinct_router(8, 2), 0},
  };
  // Both combines: the per-rank one sums each token's routes before its row returns.
  for (const CombineMode combine : {CombineMode::per_route, CombineMode::per_rank}) {
    Problem p = base_problem;
    p.combine = combine;
    SCOPED_TRACE(p.name());
    uint64_t seed = 40;
    for (const Edge& e : edges) {
      auto in = make_inputs(p, seed++, 130, e.router)[0];
      in.live = e.live;
      const std::vector<RankInputs> all{in};
      const auto gpu = run_gpu_layer(p, in);
      const auto cpu = run_layer(p, all);
      const OutputErrors err = compare(gpu, cpu);
      for (int o = 0; o < kNumOutputs; ++o) {
        const Output out = static_cast<Output>(o);
        // Outputs that are all zero compare as 0 / 0 -> check exact equality instead.
        if (std::isnan(err[out])) continue;
        EXPECT_LE(err[out], backend_rel_l2_bound(Precision::bf16, out)) << e.name << " " << to_string(out);
      }
      if (e.live >= 0) {  // padding rows are exactly zero
        for (int64_t t = e.live; t < 130; ++t) {
          for (int64_t d = 0; d < p.hidden; ++d) {
            ASSERT_EQ(gpu[0].y_TD[t * p.hidden + d], 0) << e.name << " y row " << t;
            ASSERT_EQ(gpu[0].grad_x_TD[t * p.hidden + d], 0) << e.name << " grad_x row " << t;
          }
        }
      }
    }
  }
}

TEST(GpuContext, OverflowIsReportedAndContextStaysUsable) {
  EPMOE_REQUIRE_GPU();
  Problem p = problem(128, 128, 64, 8, 2);
  p.capacity_factor = 0.25;  // 64 rows of capacity
  auto ctx = gpu_context(p);
  // Every route to expert 0: 256 rows > 64.
  const auto heavy = make_inputs(p, 3, 128, [](int, int64_t, int k, std::mt19937_64&) -> int64_t { return k; })[0];
  DeviceCall bad(p, heavy);
  const SavedLayer saved = ctx->forward(bad.forward_args(nullptr));
  ctx->backward(bad.backward_args(saved, nullptr));
  try {
    ctx->check();
    ADD_FAILURE() << "capacity overflow was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::capacity_overflow) << e.what();
    EXPECT_NE(std::string(e.what()).find("256"), std::string::npos) << e.what();  // required
    EXPECT_NE(std::string(e.what()).find("64"), std::string::npos) << e.what();   // available
  }
  // y of a skipped step is zero, never garbage.
  const auto skipped = bad.outputs();
  for (bf16_t v : skipped.y_TD) ASSERT_EQ(v, 0);
  // The next valid call on the same context works and matches the CPU backend.
  const auto light = make_inputs(p, 4, 128, [](int, int64_t t, int k, std::mt19937_64&) -> int64_t {
    return t < 16 ? k : -1;  // 32 rows
  })[0];
  DeviceCall good(p, light);
  const std::vector<RankOutputs> gpu{run_once(*ctx, good, nullptr)};
  const OutputErrors err = compare(gpu, run_layer(p, {light}));
  EXPECT_LE(err[Output::y], backend_rel_l2_bound(Precision::bf16, Output::y)) << err.to_string();
  ctx->close();
}

TEST(GpuContext, ExpertIdOutOfRangeIsReported) {
  EPMOE_REQUIRE_GPU();
  const Problem p = problem(32, 64, 64, 4, 2);
  auto ctx = gpu_context(p);
  auto in = make_inputs(p, 9, 32)[0];
  in.ids_TK[13] = 4;  // experts are [0, 4)
  DeviceCall bad(p, in);
  ctx->forward(bad.forward_args(nullptr));
  try {
    ctx->check();
    ADD_FAILURE() << "an out-of-range id was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "topk_ids_TK") << e.what();
  }
  ctx->close();
}

}  // namespace
}  // namespace epmoe::test
