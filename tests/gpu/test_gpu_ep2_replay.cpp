// EP = 2 on two GPUs of one process, under CUDA-graph capture and activation slots: graph replay on
// both ranks with new routings and live counts equals eager, the per-rank combine (against the CPU
// backend and the per-route combine, and replayed; bf16 and fp8_block), more routes per token than
// a warp has lanes, a stack of layers in one slot whose recomputed results equal the saved ones
// bitwise, and replay at the minimum slot budget (every backward replaying its forward across both
// ranks). Skips where fewer than 2 GPUs exist.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/slot_plan.h"
#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/memory_plan.h"
#include "epmoe/nccl.h"
#include "captured_step.h"
#include "device_call.h"
#include "ep2_support.h"
#include "moe_case.h"
#include "output_compare.h"
#include "slot_stack.h"
#include "tolerances.h"

namespace epmoe::test {
namespace {

// The graph-replay tests' replays: a routing seed and each rank's live count.
struct Replay {
  uint64_t seed;
  int64_t live0, live1;
};
const std::vector<Replay> kReplays = {{2, 256, 256}, {3, 100, 200}, {4, 1, 0}, {5, 256, 17}};

TEST(GpuEp2, GraphReplayOnBothRanksEqualsEager) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 2.0;
  // Same x, weights, grad_y every time; fresh ids and scores per seed; live counts per rank.
  auto routing = [&](uint64_t seed, int64_t live0, int64_t live1) {
    return rerouted(p, 100, seed, 256, {live0, live1});
  };
  const std::vector<Replay>& replays = kReplays;
  const auto first = routing(1, 256, 256);
  std::vector<std::vector<RankOutputs>> replayed(replays.size(), std::vector<RankOutputs>(kRanks));
  std::vector<std::vector<RankOutputs>> eager(replays.size(), std::vector<RankOutputs>(kRanks));
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    auto graph_ctx = Context::create(p.config(), t);
    auto eager_ctx = Context::create(p.config(), t);  // same transport: same stream order below
    DeviceCall call(p, first[r], r);
    CapturedStep step(*graph_ctx, call);
    for (size_t i = 0; i < replays.size(); ++i) {
      const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
      replayed[i][r] = step.replay(in[r]);
      DeviceCall eager_call(p, in[r], r);
      eager[i][r] = run_once(*eager_ctx, eager_call, step.stream());
    }
    graph_ctx->close();
    eager_ctx->close();
  });
  for (size_t i = 0; i < replays.size(); ++i) {
    expect_bitwise_equal(replayed[i], eager[i],
                         "graph replay, routing seed " + std::to_string(replays[i].seed));
    const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
    const OutputErrors err = compare(eager[i], run_layer(p, in));
    EXPECT_LE(err[Output::y], backend_rel_l2_bound(Precision::bf16, Output::y)) << err.to_string();
  }
}

// Per-rank combine (Config.combine = per_rank, inference) at EP = 2: y against the CPU backend's
// per-rank y with 2 thread ranks (tolerance table; the send and reduce kernels sum in the CPU's
// order, the GEMMs differ in accumulation order) and the float64 reference, close to the
// per-route combine, repeat calls bitwise, and a captured forward replayed with new routings and
// live counts equal to eager on both ranks.
// Training with the per-rank combine at EP = 2: every output against the CPU backend's per-rank
// outputs and the float64 reference (tolerance tables); grad_scores and both weight gradients
// bitwise equal to the per-route combine's (the same dots and GEMMs, now on the expert side).
TEST(GpuEp2, PerRankCombineTrainingMatchesCpuAndPerRoute) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 2.0;
  p.combine = CombineMode::per_rank;
  const auto in = make_inputs(p, 31, 256);
  const auto gpu = run_gpu_layer(p, in);
  expect_matches_cpu(p, in, gpu, "per_rank");
  Problem q = p;
  q.combine = CombineMode::per_route;
  const auto route = run_gpu_layer(q, in);
  for (int r = 0; r < kRanks; ++r) {
    const size_t i = static_cast<size_t>(r);
    EXPECT_EQ(gpu[i].grad_scores_TK, route[i].grad_scores_TK) << "grad_scores rank " << r;
    EXPECT_EQ(gpu[i].grad_w13_EFD, route[i].grad_w13_EFD) << "grad_w13 rank " << r;
    EXPECT_EQ(gpu[i].grad_w2_EDF, route[i].grad_w2_EDF) << "grad_w2 rank " << r;
  }
}

// More routes per token than a warp has lanes (K = 40): the pull kernels (dispatch, gather_grad,
// the per-rank combine's send) hold routes 0..31 in lanes and read the rest directly
// (src/cuda/pull_walk.cuh). Both combines against the CPU backend and the float64 reference;
// per-rank grad_scores and weight gradients bitwise equal to the per-route combine's.
TEST(GpuEp2, MoreRoutesThanLanesMatchCpu) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(48, 128, 64, 48, 40);
  p.capacity_factor = 2.0;
  const auto in = make_inputs(p, 37, 48);
  std::vector<std::vector<RankOutputs>> got;
  for (const CombineMode combine : {CombineMode::per_route, CombineMode::per_rank}) {
    p.combine = combine;
    got.push_back(run_gpu_layer(p, in));
    expect_matches_cpu(p, in, got.back(), p.name());
  }
  for (int r = 0; r < kRanks; ++r) {
    const size_t i = static_cast<size_t>(r);
    EXPECT_EQ(got[1][i].grad_scores_TK, got[0][i].grad_scores_TK) << "grad_scores rank " << r;
    EXPECT_EQ(got[1][i].grad_w13_EFD, got[0][i].grad_w13_EFD) << "grad_w13 rank " << r;
    EXPECT_EQ(got[1][i].grad_w2_EDF, got[0][i].grad_w2_EDF) << "grad_w2 rank " << r;
  }
}

TEST(GpuEp2, PerRankCombineMatchesCpuAndGraphReplays) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 2.0;
  p.inference = true;
  p.combine = CombineMode::per_rank;
  auto routing = [&](uint64_t seed, int64_t live0, int64_t live1) {
    return rerouted(p, 100, seed, 256, {live0, live1});
  };
  auto y_error = [](const std::vector<std::vector<bf16_t>>& a,
                    const std::vector<std::vector<bf16_t>>& b) {
    std::vector<RankOutputs> x(kRanks), z(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      x[r].y_TD = a[r];
      z[r].y_TD = b[r];
    }
    return compare(x, z)[Output::y];
  };
  auto gpu_forward = [&](const Problem& q, const std::vector<RankInputs>& in) {
    std::vector<std::vector<bf16_t>> y(kRanks);
    run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
      auto ctx = Context::create(q.config(), t);
      DeviceCall call(q, in[r], r);
      y[r] = run_forward_once(*ctx, call, nullptr);
      EXPECT_EQ(run_forward_once(*ctx, call, nullptr), y[r]) << "repeat call, rank " << r;
      ctx->close();
    });
    return y;
  };
  auto cpu_forward = [&](const Problem& q, const std::vector<RankInputs>& in) {
    std::vector<std::vector<bf16_t>> y(kRanks);
    with_contexts(q, [&](int r, Context& ctx) {
      RankCall call(q, in[r]);
      ForwardArgs a = call.forward_args();
      a.save_for_backward = false;
      ctx.forward(a);
      y[r] = call.y;
    });
    return y;
  };
  const auto first = routing(1, 256, 256);
  const auto gpu = gpu_forward(p, first);
  const double vs_cpu = y_error(gpu, cpu_forward(p, first));
  EXPECT_LE(vs_cpu, backend_rel_l2_bound(Precision::bf16, Output::y)) << "per_rank CUDA vs CPU";
  std::vector<RankOutputs> got(kRanks);
  for (int r = 0; r < kRanks; ++r) got[r].y_TD = gpu[r];
  const auto ref = reference_layer(p, first);
  std::vector<double> g, f;
  for (int r = 0; r < kRanks; ++r) {
    const auto w = widen(gpu[r]);
    g.insert(g.end(), w.begin(), w.end());
    f.insert(f.end(), ref[r].y_TD.begin(), ref[r].y_TD.end());
  }
  EXPECT_LE(reference::rel_l2(f, g), rel_l2_bound(Precision::bf16, Output::y)) << "vs float64";
  Problem q = p;
  q.combine = CombineMode::per_route;
  EXPECT_LE(y_error(gpu, gpu_forward(q, first)), backend_rel_l2_bound(Precision::bf16, Output::y))
      << "per_rank vs per_route on CUDA";

  const std::vector<Replay>& replays = kReplays;
  std::vector<std::vector<std::vector<bf16_t>>> replayed(
      replays.size(), std::vector<std::vector<bf16_t>>(kRanks));
  std::vector<std::vector<std::vector<bf16_t>>> eager(replays.size(),
                                                      std::vector<std::vector<bf16_t>>(kRanks));
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    auto graph_ctx = Context::create(p.config(), t);
    auto eager_ctx = Context::create(p.config(), t);  // same transport: same stream order below
    DeviceCall call(p, first[r], r);
    CapturedStep step(*graph_ctx, call, Pass::forward);
    for (size_t i = 0; i < replays.size(); ++i) {
      const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
      replayed[i][r] = step.replay_y(in[r]);
      DeviceCall eager_call(p, in[r], r);
      eager[i][r] = run_forward_once(*eager_ctx, eager_call, step.stream());
    }
    graph_ctx->close();
    eager_ctx->close();
  });
  for (size_t i = 0; i < replays.size(); ++i) {
    EXPECT_EQ(replayed[i], eager[i]) << "per_rank graph replay, seed " << replays[i].seed;
    const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
    EXPECT_LE(y_error(eager[i], cpu_forward(p, in)),
              backend_rel_l2_bound(Precision::bf16, Output::y))
        << "per_rank CUDA vs CPU, seed " << replays[i].seed;
  }
}

// Packed activation slots at EP = 2: a stack of 4 layers at the minimum and at a mixed budget
// equals the full save bitwise on both ranks (the replay re-runs dispatch and the W2 scatter
// across ranks, with barriers), and both ranks take the decisions the rule gives from the
// fullest rank's rows.
TEST(GpuEp2, RecomputeStackEqualsFullSaveBitwise) {
  EPMOE_REQUIRE_2GPUS();
  const int64_t tokens[kStackLayers] = {96, 29, 96, 61};
  struct Variant {
    bool fused;
    CombineMode combine;
  };
  for (const Variant v : {Variant{true, CombineMode::per_route},
                          Variant{false, CombineMode::per_route},
                          Variant{true, CombineMode::per_rank}}) {
    Problem p = problem(96, 136, 104, 8, 2);  // 2D = 272: granule 2176; h13 rows of 416 bytes
    p.fused = v.fused;
    p.combine = v.combine;
    p.layers_per_slot = kStackLayers;
    SCOPED_TRACE(p.name());
    std::vector<std::vector<RankInputs>> in;  // [layer][rank]
    for (int l = 0; l < kStackLayers; ++l) {
      in.push_back(make_inputs(p, 700 + static_cast<uint64_t>(l), tokens[l]));
    }
    const MemoryPlan plan = plan_memory(stack_config(p, -1), kRanks);
    const int64_t G = plan.packing_granule_bytes;
    const auto rows = stack_rows(p, in);
    const int64_t mixed_packed = stack_mixed_packed(p, rows, G);
    const std::vector<bool> expected = stack_decisions(p, rows, mixed_packed, G);
    ASSERT_NE(std::count(expected.begin(), expected.end(), true), 0);
    ASSERT_NE(std::count(expected.begin(), expected.end(), false), 0);
    auto run = [&](int64_t slot_bytes) {
      std::vector<StackResult> res(kRanks);
      run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
        auto ctx = Context::create(stack_config(p, slot_bytes), t);
        std::vector<RankInputs> mine;
        for (int l = 0; l < kStackLayers; ++l) mine.push_back(in[static_cast<size_t>(l)][static_cast<size_t>(r)]);
        auto calls = stack_calls(p, mine, r);
        res[static_cast<size_t>(r)] = run_stack(*ctx, calls, nullptr);
        ctx->close();
      });
      return res;
    };
    const std::vector<StackResult> saved = run(-1);
    const std::vector<StackResult> minimum = run(plan.minimum_slot_bytes);
    const std::vector<StackResult> mixed = run(plan.slot_metadata_bytes + mixed_packed);
    for (int r = 0; r < kRanks; ++r) {
      const size_t i = static_cast<size_t>(r);
      const std::string rank = "rank " + std::to_string(r);
      EXPECT_EQ(saved[i].recomputed, std::vector<bool>(kStackLayers, false)) << rank;
      EXPECT_EQ(minimum[i].recomputed, std::vector<bool>(kStackLayers, true)) << rank;
      EXPECT_EQ(mixed[i].recomputed, expected) << rank;
      EXPECT_EQ(mixed[i].peak, mixed[0].peak) << rank << ": the ranks' slot accounts differ";
      EXPECT_LE(mixed[i].peak, mixed_packed) << rank;
      expect_stack_bitwise_equal(saved[i], minimum[i], rank + " minimum budget vs full save");
      expect_stack_bitwise_equal(saved[i], mixed[i], rank + " mixed budget vs full save");
    }
    // The saved results are right: each layer's both ranks against the CPU backend.
    for (int l = 0; l < kStackLayers; ++l) {
      const std::vector<RankOutputs> gpu{saved[0].out[static_cast<size_t>(l)],
                                         saved[1].out[static_cast<size_t>(l)]};
      expect_matches_cpu(p, in[static_cast<size_t>(l)], gpu, "stack layer " + std::to_string(l));
    }
  }
}

// One layer at the minimum slot budget, captured once and replayed with new routings and live
// counts: equal to eager on a second context group with the same budget, on both ranks. The
// minimum fits one input x [T, D]; a full save (x_gathered and h13 at the received rows) fits
// only when it is no larger on the fullest rank (slot_plan.h): a replay with few live tokens
// saves everything, the others replay the forward's W13 in backward.
void graph_replay_with_recompute(CombineMode combine, Precision precision = Precision::bf16) {
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 2.0;
  p.combine = combine;
  p.precision = precision;
  SCOPED_TRACE(p.name());
  const MemoryPlan plan = plan_memory(p.config(), kRanks);
  ConfigFields f = p.config().fields();
  f.slots.slot_bytes = plan.minimum_slot_bytes;
  const Config config(f);
  auto routing = [&](uint64_t seed, int64_t live0, int64_t live1) {
    return rerouted(p, 100, seed, 256, {live0, live1});
  };
  const std::vector<Replay>& replays = kReplays;
  const auto first = routing(1, 256, 256);
  std::vector<std::vector<RankOutputs>> replayed(replays.size(), std::vector<RankOutputs>(kRanks));
  std::vector<std::vector<RankOutputs>> eager(replays.size(), std::vector<RankOutputs>(kRanks));
  std::vector<int> replayed_layers(kRanks, 0);
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    auto graph_ctx = Context::create(config, t);
    auto eager_ctx = Context::create(config, t);  // same transport: same stream order below
    DeviceCall call(p, first[static_cast<size_t>(r)], r);
    CapturedStep step(*graph_ctx, call);
    for (size_t i = 0; i < replays.size(); ++i) {
      const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
      step.launch(in[static_cast<size_t>(r)]);
      replayed_layers[static_cast<size_t>(r)] += graph_ctx->recomputes(step.saved()) ? 1 : 0;
      replayed[i][static_cast<size_t>(r)] = call.outputs();
      DeviceCall eager_call(p, in[static_cast<size_t>(r)], r);
      eager[i][static_cast<size_t>(r)] = run_once(*eager_ctx, eager_call, step.stream());
    }
    graph_ctx->close();
    eager_ctx->close();
  });
  // The planner's rule for the first layer of an empty slot of the minimum budget: save
  // everything only if the fullest rank's full save fits the packed region (L inputs) with the
  // L - 1 later layers' inputs. Rows a rank receives: the live routes to its experts.
  auto recomputes = [&](const std::vector<RankInputs>& in) {
    std::vector<int64_t> rows_R(kRanks, 0);
    for (const RankInputs& src : in) {
      const int64_t live = src.live < 0 ? src.tokens : src.live;
      for (int64_t i = 0; i < live * p.top_k; ++i) {
        const int64_t id = src.ids_TK[static_cast<size_t>(i)];
        if (id >= 0) ++rows_R[static_cast<size_t>(id / p.local_experts())];
      }
    }
    const int64_t packed = plan.minimum_slot_bytes - plan.slot_metadata_bytes;
    const int64_t later_inputs = (plan.layers_per_slot - 1) * plan.saved_input_bytes_per_layer;
    for (const int64_t rows : rows_R) {
      const int64_t full =
          full_save_layout(rows, p.hidden, p.intermediate, plan.packing_granule_bytes).total;
      if (full + later_inputs > packed) return true;
    }
    return false;
  };
  int expected_recomputes = 0;
  for (const Replay& rp : replays) {
    expected_recomputes += recomputes(routing(rp.seed, rp.live0, rp.live1)) ? 1 : 0;
  }
  // 3 of 4 with either combine and precision (the replay with live 1 and 0 receives at most K
  // rows a rank; fp8_block saves the same bytes as bf16).
  EXPECT_EQ(expected_recomputes, static_cast<int>(replays.size()) - 1);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(replayed_layers[static_cast<size_t>(r)], expected_recomputes)
        << "rank " << r << ": replays that recompute at the minimum budget";
  }
  for (size_t i = 0; i < replays.size(); ++i) {
    expect_bitwise_equal(replayed[i], eager[i],
                         "graph replay with recompute, routing seed " + std::to_string(replays[i].seed));
    const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
    const OutputErrors err = compare(eager[i], run_layer(p, in));
    EXPECT_LE(err[Output::y], backend_rel_l2_bound(precision, Output::y)) << err.to_string();
    EXPECT_LE(err[Output::grad_x], backend_rel_l2_bound(precision, Output::grad_x))
        << err.to_string();
  }
}

TEST(GpuEp2, GraphReplayWithRecomputeEqualsEager) {
  EPMOE_REQUIRE_2GPUS();
  graph_replay_with_recompute(CombineMode::per_route);
}

// The same with the per-rank combine: the replay rebuilds x_gathered and h13 (no W2, no send), and
// grad_scores come from the W2 DGRAD on the expert side, as per-route.
TEST(GpuEp2, PerRankGraphReplayWithRecomputeEqualsEager) {
  EPMOE_REQUIRE_2GPUS();
  graph_replay_with_recompute(CombineMode::per_rank);
}

// fp8_block with the per-rank combine: the replay re-quantizes x and rebuilds x_gathered and h13
// on the FP8 W13; W2's rows stay in the call scratch for the send.
TEST(GpuEp2, Fp8PerRankGraphReplayWithRecomputeEqualsEager) {
  EPMOE_REQUIRE_2GPUS();
  graph_replay_with_recompute(CombineMode::per_rank, Precision::fp8_block);
}

// fp8_block training with the per-rank combine at EP = 2: grad_scores and both weight gradients
// bitwise equal to the per-route combine's (the FP8 GEMMs see the same rows; only the k-sum moves
// to the expert side), fused and unfused. y and grad_x against the CPU backend:
// GpuEp2.Fp8TrainingMatchesCpu.
TEST(GpuEp2, Fp8PerRankTrainingEqualsPerRouteOnTheExpertSide) {
  EPMOE_REQUIRE_2GPUS();
  for (bool fused : {true, false}) {
    Problem p = problem(256, 256, 192, 16, 4);
    p.capacity_factor = 2.0;
    p.precision = Precision::fp8_block;
    p.fused = fused;
    p.combine = CombineMode::per_rank;
    std::vector<RankInputs> in = make_inputs(p, 33, 256);
    in[0].live = 219;
    const auto rank = run_gpu_layer(p, in);
    Problem q = p;
    q.combine = CombineMode::per_route;
    const auto route = run_gpu_layer(q, in);
    for (int r = 0; r < kRanks; ++r) {
      const size_t i = static_cast<size_t>(r);
      const std::string what = " rank " + std::to_string(r) + " " + p.name();
      EXPECT_EQ(rank[i].grad_scores_TK, route[i].grad_scores_TK) << "grad_scores" << what;
      EXPECT_EQ(rank[i].grad_w13_EFD, route[i].grad_w13_EFD) << "grad_w13" << what;
      EXPECT_EQ(rank[i].grad_w2_EDF, route[i].grad_w2_EDF) << "grad_w2" << what;
    }
  }
}

}  // namespace
}  // namespace epmoe::test
