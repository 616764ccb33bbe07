// The FP8 block-scaled forward on one GPU (Config.precision = fp8_block, Config.inference = true)
// through the public API, against the CPU backend on the same inputs:
// - exact blocks: inputs whose every 128-deep block sum is a small integer (exact in fp32 and in
//   the tensor core's reduced-precision fp8 accumulation) and whose SwiGLU gates lie far in the
//   saturated range (sigmoid == 1 in fp32 on both sides, so the host and device expf cannot
//   differ): every step is then the same function on both sides and y matches bitwise;
// - random inputs: y within kBackendTolerances (fp8_block), and within the float64 bound of the
//   CPU path (kTrainingTolerances);
// - fused == unfused, prepared == per-call weights, repeated calls, CUDA-graph replay with new
//   routings and live counts == eager: bitwise;
// - the per-rank combine (Config.combine = per_rank) at EP = 1: y bitwise the per-route one, and
//   bitwise the CPU backend's on exact blocks.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "captured_step.h"
#include "device_call.h"
#include "device_prepared.h"
#include "fp8_exact_inputs.h"
#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/prepared_weights.h"
#include "moe_case.h"
#include "require_gpu.h"
#include "y_compare.h"
#include "tolerances.h"

namespace epmoe::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

Problem fp8_problem(int64_t T, int64_t D, int64_t F, int experts, int K, bool clamped = false) {
  Problem p = make_problem(1, T, D, F, K, experts,
                           clamped ? Activation::swiglu_clamped() : Activation::swiglu());
  p.precision = Precision::fp8_block;
  p.inference = true;
  return p;
}

ForwardArgs inference_args(const DeviceCall& call, const DevicePrepared* prepared,
                           cudaStream_t stream) {
  ForwardArgs a = call.forward_args(stream);
  a.save_for_backward = false;
  if (prepared != nullptr) {
    a.w13_prepared = &prepared->w13;
    a.w2_prepared = &prepared->w2;
  }
  return a;
}

std::vector<bf16_t> download_y(const DeviceCall& call) {
  return download(call.y, call.host.y.size());
}

// First differing element, for failure messages.
// y of `calls` forwards on one fresh single-GPU context (every later call must repeat the first).
std::vector<bf16_t> gpu_forward(const Problem& p, const RankInputs& in, int calls = 1) {
  auto ctx = Context::create(p.config(), make_single_gpu_transport(0));
  DeviceCall call(p, in);
  std::unique_ptr<DevicePrepared> prepared;
  if (p.prepared_weights) prepared = std::make_unique<DevicePrepared>(p, in);
  std::vector<bf16_t> first;
  for (int c = 0; c < calls; ++c) {
    call.poison();
    ctx->forward(inference_args(call, prepared.get(), nullptr));
    ctx->check();
    const std::vector<bf16_t> y = download_y(call);
    if (c == 0) {
      first = y;
    } else {
      EXPECT_TRUE(y == first) << p.name() << ": call " << c << " on the same context: "
                              << first_difference(y, first, p.hidden);
    }
  }
  ctx->close();
  return first;
}

std::vector<bf16_t> cpu_forward(const Problem& p, const RankInputs& in) {
  return forward_y(p, {in})[0];
}

struct ExactCase {
  Problem p;
  int64_t live;  // -1: all tokens
  Router router;
};

TEST(GpuFp8Forward, ExactBlocksMatchCpuBitwise) {
  EPMOE_REQUIRE_GPU();
  const auto one_expert = [](int, int64_t, int, std::mt19937_64&) -> int64_t { return 3; };
  const auto two_experts = [](int, int64_t t, int k, std::mt19937_64&) -> int64_t {
    return (t + k) % 2 ? 5 : 2;  // zero-token experts around them
  };
  std::vector<ExactCase> cases = {
      {fp8_problem(64, 256, 96, 8, 2), -1, nullptr},
      {fp8_problem(333, 384, 272, 16, 4), -1, nullptr},   // partial n-tiles and k-blocks
      {fp8_problem(1, 256, 64, 4, 2), -1, nullptr},       // T = 1
      {fp8_problem(130, 256, 128, 8, 2), 77, nullptr},    // live count below T
      {fp8_problem(130, 256, 128, 8, 2), 0, nullptr},     // no live tokens
      {fp8_problem(300, 272, 160, 8, 2), -1, one_expert},  // 300 rows in one expert, D % 128 = 16
      {fp8_problem(300, 256, 160, 8, 2), -1, two_experts},
      {fp8_problem(96, 256, 144, 8, 2, true), -1, nullptr},  // clamped: gates clamp to the limit
  };
  uint64_t seed = 500;
  for (const ExactCase& c : cases) {
    Router router = c.router ? c.router : distinct_router(c.p.experts, c.p.top_k);
    RankInputs in = make_inputs(c.p, seed, c.p.max_tokens, router)[0];
    in.live = c.live;
    make_exact(c.p, in, seed++);
    const std::string what = c.p.name() + " live " + std::to_string(c.live);
    const std::vector<bf16_t> cpu = cpu_forward(c.p, in);
    for (bool fused : {true, false}) {
      for (bool prepared : {false, true}) {
        Problem q = c.p;
        q.fused = fused;
        q.prepared_weights = prepared;
        expect_same_y(gpu_forward(q, in), cpu, q.hidden, q.name() + ": CUDA vs CPU, exact blocks");
      }
    }
  }
}

// rel-L2 of a against b.
TEST(GpuFp8Forward, RandomInputsWithinBoundsFusedUnfusedPreparedRepeatBitwise) {
  EPMOE_REQUIRE_GPU();
  std::vector<Problem> cases = {
      fp8_problem(64, 128, 96, 8, 2),     // ci-tiny
      fp8_problem(333, 256, 528, 16, 4),  // ragged tiles in every dimension
      fp8_problem(512, 1024, 768, 8, 2),  // many k-blocks, several tiles
      fp8_problem(1, 64, 64, 4, 2),       // T = 1
      fp8_problem(96, 192, 144, 8, 2, true),
  };
  uint64_t seed = 600;
  for (const Problem& p : cases) {
    const RankInputs in = make_inputs(p, seed++, p.max_tokens)[0];
    const std::vector<bf16_t> gpu = gpu_forward(p, in, 2);
    const std::vector<bf16_t> cpu = cpu_forward(p, in);
    // y against the CPU backend: the FP8 steps are the same functions; the GEMMs' block sums are
    // accumulated with reduced precision by the tensor core (and SwiGLU's expf differs by ulps),
    // which flips single roundings of h13 / h and, through h's 1x128 scales, whole blocks' codes.
    const double vs_cpu = rel_l2(gpu, cpu);
    EXPECT_LE(vs_cpu, backend_rel_l2_bound(Precision::fp8_block, Output::y))
        << p.name() << ": y CUDA vs CPU backend";
    // y against float64: the CPU path's bound (kTrainingTolerances, y).
    const std::vector<double> ref = reference_layer(p, {in})[0].y_TD;
    double num = 0, den = 0, dot = 0, got2 = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double g = bf16_to_float(gpu[i]);
      num += (g - ref[i]) * (g - ref[i]);
      den += ref[i] * ref[i];
      dot += g * ref[i];
      got2 += g * g;
    }
    const double vs_ref = std::sqrt(num / std::max(den, 1e-300));
    const double cosine = dot / std::sqrt(std::max(den * got2, 1e-300));
    if (std::getenv("EPMOE_REPORT_ERRORS") != nullptr) {
      std::printf("%s: y rel-L2 CUDA vs CPU %.3e, CUDA vs float64 %.3e (cos %.6f)\n",
                  p.name().c_str(), vs_cpu, vs_ref, cosine);
    }
    const bool clamped = p.act.kind == ActivationKind::swiglu_clamped;
    const TrainingTolerance* t =
        training_tolerance(Precision::fp8_block, clamped, Output::y, Against::float64);
    ASSERT_NE(t, nullptr);
    if (p.max_tokens > 1) {  // one 64-element row is too few for the statistical bound
      EXPECT_LE(vs_ref, t->rel_l2) << p.name() << ": y CUDA vs float64";
      EXPECT_GE(cosine, t->cosine) << p.name() << ": y CUDA vs float64";
    }
    Problem unfused = p;
    unfused.fused = false;
    expect_same_y(gpu_forward(unfused, in), gpu, p.hidden, p.name() + ": unfused vs fused");
    Problem prepared = p;
    prepared.prepared_weights = true;
    expect_same_y(gpu_forward(prepared, in), gpu, p.hidden, p.name() + ": prepared vs per-call");
  }
}

// The per-rank combine at EP = 1: the W2 rows go to rows_MD and the send sums a token's routes
// (score-weighted, k ascending, fp32) into one row, which the reduce adds to 0: y is bitwise the
// per-route y (fused, unfused, prepared, a live count below T), and on exact blocks bitwise the
// CPU backend's per-rank y.
TEST(GpuFp8Forward, PerRankCombineEqualsPerRouteAtEp1) {
  EPMOE_REQUIRE_GPU();
  uint64_t seed = 560;
  for (Problem base : {fp8_problem(64, 128, 96, 8, 2), fp8_problem(333, 256, 528, 16, 4),
                       fp8_problem(96, 192, 144, 8, 2, true)}) {
    RankInputs in = make_inputs(base, seed++, base.max_tokens)[0];
    in.live = base.max_tokens - base.max_tokens / 4;
    const std::vector<bf16_t> per_route = gpu_forward(base, in);
    for (bool fused : {true, false}) {
      for (bool prepared : {false, true}) {
        Problem q = base;
        q.combine = CombineMode::per_rank;
        q.fused = fused;
        q.prepared_weights = prepared;
        expect_same_y(gpu_forward(q, in, 2), per_route, q.hidden,
                      q.name() + ": per_rank vs per_route");
      }
    }
  }
  Problem exact = fp8_problem(333, 384, 272, 16, 4);
  exact.combine = CombineMode::per_rank;
  RankInputs in = make_inputs(exact, seed, exact.max_tokens)[0];
  make_exact(exact, in, seed);
  expect_same_y(gpu_forward(exact, in), cpu_forward(exact, in), exact.hidden,
                exact.name() + ": CUDA vs CPU, exact blocks");
}

TEST(GpuFp8Forward, GraphReplayWithNewRoutingsEqualsEager) {
  EPMOE_REQUIRE_GPU();
  struct Variant {
    bool prepared;
    CombineMode combine;
  };
  for (const Variant v : {Variant{false, CombineMode::per_route},
                          Variant{true, CombineMode::per_route},
                          Variant{false, CombineMode::per_rank}}) {
    const bool prepared = v.prepared;
    Problem p = fp8_problem(256, 256, 192, 16, 4);
    p.capacity_factor = 1.0;
    p.prepared_weights = prepared;
    p.combine = v.combine;
    // Same x and weights every time; a new routing per seed.
    auto routing = [&](uint64_t seed, int64_t live) {
      return rerouted(p, 100, seed, 256, {live})[0];
    };
    const RankInputs first = routing(1, 256);
    auto graph_ctx = Context::create(p.config(), make_single_gpu_transport(0));
    DeviceCall call(p, first);
    DevicePrepared weights(p, first);
    const DevicePrepared* w = prepared ? &weights : nullptr;
    StreamGraph graph(
        [&](cudaStream_t stream) {
          graph_ctx->forward(inference_args(call, w, stream));  // warm-up outside capture
          CUDA_OK(cudaStreamSynchronize(stream));
        },
        [&](cudaStream_t stream) { graph_ctx->forward(inference_args(call, w, stream)); });
    for (const auto& [seed, live] :
         std::vector<std::pair<uint64_t, int64_t>>{{2, 256}, {3, 100}, {4, 1}, {5, 0}, {6, 256}}) {
      const RankInputs in = routing(seed, live);
      call.set_routing(in);
      call.poison();
      graph.launch();
      graph_ctx->check();
      const std::vector<bf16_t> replayed = download_y(call);
      expect_same_y(replayed, gpu_forward(p, in), p.hidden,
                    p.name() + ": graph replay, routing seed " + std::to_string(seed) + " live " +
                        std::to_string(live));
    }
    graph_ctx->close();
  }
}

// Capacity overflow is reported through check() and the context stays usable (FP8 stages skip).
TEST(GpuFp8Forward, OverflowIsReportedAndTheContextStaysUsable) {
  EPMOE_REQUIRE_GPU();
  Problem p = fp8_problem(128, 128, 96, 8, 2);
  p.capacity_factor = 0.5;
  const auto one_expert = [](int, int64_t, int, std::mt19937_64&) -> int64_t { return 3; };
  const RankInputs skewed = make_inputs(p, 700, 128, one_expert)[0];
  const RankInputs balanced = make_inputs(p, 701, 64)[0];
  auto ctx = Context::create(p.config(), make_single_gpu_transport(0));
  {
    DeviceCall call(p, skewed);
    ctx->forward(inference_args(call, nullptr, nullptr));
    const Status st = ctx->take_status();
    EXPECT_EQ(st.code, static_cast<int32_t>(StatusCode::capacity_overflow));
  }
  DeviceCall call(p, balanced);
  ctx->forward(inference_args(call, nullptr, nullptr));
  ctx->check();
  expect_same_y(download_y(call), gpu_forward(p, balanced), p.hidden,
                "after an overflow vs a fresh context");
  ctx->close();
}

}  // namespace
}  // namespace epmoe::test
