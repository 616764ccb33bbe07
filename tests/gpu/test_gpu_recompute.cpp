// Packed activation slots on one GPU (EP = 1) through the public API: a stack of 4 layers in one
// slot at the minimum budget (every layer saves only its input and backward replays its forward),
// at a mixed budget (the planner decides per layer on the device) and at the default budget
// (everything saved). Replayed results equal saved results bitwise, forward and every gradient;
// the decisions follow the rule re-derived from the routing; a second pass on the same context
// gives the same bits (the slot rewound). CUDA-graph capture of the whole stack (forwards and
// backwards, replay launches included) replayed with new routings equals eager, with recompute
// off, on for every layer, and routing-dependent. Awkward sizes: 2D = 272 (granule 2176) and
// 4F = 416 (h13 rows not 128-byte multiples).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "captured_step.h"
#include "device_call.h"
#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/memory_plan.h"
#include "moe_case.h"
#include "slot_stack.h"
#include "tolerances.h"

namespace epmoe::test {
namespace {

#define EPMOE_REQUIRE_GPU()                                  \
  do {                                                       \
    if (cuda_device_count() == 0) {                          \
      GTEST_SKIP() << "no CUDA device: GPU tests skipped";   \
    }                                                        \
  } while (0)

Problem stack_problem(bool fused, bool gated, CombineMode combine) {
  Problem p;
  p.combine = combine;
  p.ranks = 1;
  p.max_tokens = 96;
  p.hidden = 136;       // 2D = 272 bytes: granule lcm(128, 272) = 2176
  p.intermediate = 104; // h13 rows of 416 bytes
  p.top_k = 2;
  p.experts = 8;
  p.fused = fused;
  p.arrival_gated_w13 = gated;
  p.layers_per_slot = kStackLayers;
  return p;
}

// Tokens of each layer's call: different row counts, so the packed sizes differ.
const int64_t kTokens[kStackLayers] = {96, 29, 96, 61};

std::vector<RankInputs> layer_inputs(const Problem& p, uint64_t seed) {
  std::vector<RankInputs> in;
  for (int l = 0; l < kStackLayers; ++l) {
    in.push_back(make_inputs(p, seed + static_cast<uint64_t>(l), kTokens[l])[0]);
  }
  return in;
}

// Runs the stack twice on one context at `slot_bytes` (second pass bitwise equal to the first).
StackResult run_budget(const Problem& p, const std::vector<RankInputs>& in, int64_t slot_bytes) {
  auto ctx = Context::create(stack_config(p, slot_bytes), make_single_gpu_transport(0));
  auto calls = stack_calls(p, in, 0);
  const StackResult first = run_stack(*ctx, calls, nullptr);
  const StackResult second = run_stack(*ctx, calls, nullptr);
  expect_stack_bitwise_equal(first, second, p.name() + " second pass, slot " + std::to_string(slot_bytes));
  EXPECT_EQ(first.recomputed, second.recomputed);
  ctx->close();
  return first;
}

class GpuRecompute : public ::testing::TestWithParam<std::tuple<bool, bool, CombineMode>> {};

TEST_P(GpuRecompute, MinimumAndMixedBudgetsEqualFullSaveBitwise) {
  EPMOE_REQUIRE_GPU();
  const auto [fused, gated, combine] = GetParam();
  const Problem p = stack_problem(fused, gated, combine);
  const std::vector<RankInputs> in = layer_inputs(p, 300);
  const MemoryPlan plan = plan_memory(stack_config(p, -1), 1);
  const int64_t G = plan.packing_granule_bytes;
  ASSERT_EQ(G, 2176);
  std::vector<std::vector<RankInputs>> per_layer;
  for (const RankInputs& x : in) per_layer.push_back({x});
  const auto rows = stack_rows(p, per_layer);
  const int64_t mixed_packed = stack_mixed_packed(p, rows, G);
  const std::vector<bool> mixed_expected = stack_decisions(p, rows, mixed_packed, G);
  ASSERT_NE(std::count(mixed_expected.begin(), mixed_expected.end(), true), 0);
  ASSERT_NE(std::count(mixed_expected.begin(), mixed_expected.end(), false), 0);

  const StackResult saved = run_budget(p, in, -1);
  const StackResult minimum = run_budget(p, in, plan.minimum_slot_bytes);
  const StackResult mixed = run_budget(p, in, plan.slot_metadata_bytes + mixed_packed);
  EXPECT_EQ(saved.recomputed, std::vector<bool>(kStackLayers, false));
  EXPECT_EQ(minimum.recomputed, std::vector<bool>(kStackLayers, true));
  EXPECT_EQ(mixed.recomputed, mixed_expected);
  EXPECT_EQ(minimum.peak, kStackLayers * plan.saved_input_bytes_per_layer);
  EXPECT_LE(mixed.peak, mixed_packed);
  expect_stack_bitwise_equal(saved, minimum, p.name() + " minimum budget vs full save");
  expect_stack_bitwise_equal(saved, mixed, p.name() + " mixed budget vs full save");
  // The saved results are right, not only equal: each layer against the float64 reference.
  for (int l = 0; l < kStackLayers; ++l) {
    const std::vector<RankInputs> one{in[static_cast<size_t>(l)]};
    const OutputErrors vs_ref = measure({saved.out[static_cast<size_t>(l)]}, reference_layer(p, one), one);
    expect_within_tolerance(vs_ref, p.name() + " layer " + std::to_string(l) + " (CUDA vs float64)");
  }
}

INSTANTIATE_TEST_SUITE_P(FusedAndGated, GpuRecompute,
                         ::testing::Values(std::make_tuple(true, false, CombineMode::per_route),
                                           std::make_tuple(false, false, CombineMode::per_route),
                                           std::make_tuple(true, true, CombineMode::per_route),
                                           std::make_tuple(true, false, CombineMode::per_rank),
                                           std::make_tuple(false, false, CombineMode::per_rank)));

// The whole stack captured once (4 forwards, 4 backwards with their replay launches), replayed
// with new routings and live counts: equal to eager on a second context with the same budget.
// At the mixed budget the planner's decisions change with the routing between replays.
TEST(GpuRecomputeGraph, ReplayWithNewRoutingsEqualsEager) {
  EPMOE_REQUIRE_GPU();
  const Problem p = stack_problem(true, false, CombineMode::per_route);
  const MemoryPlan plan = plan_memory(stack_config(p, -1), 1);
  const int64_t G = plan.packing_granule_bytes;
  const int64_t input_b = plan.saved_input_bytes_per_layer;
  // Two balanced full saves and two inputs: full-length calls recompute layers 2 and 3, short
  // calls save everything.
  const int64_t balanced_full = stack_full_bytes(p, p.max_tokens * p.top_k, G);
  const int64_t mixed_slot = plan.slot_metadata_bytes + 2 * balanced_full + 2 * input_b;
  // Same x, weights, grad_y for every replay; fresh ids and scores; a live count per replay.
  auto routing = [&](uint64_t seed, int64_t live) {
    std::vector<RankInputs> in = layer_inputs(p, 500);
    for (int l = 0; l < kStackLayers; ++l) {
      const RankInputs fresh = make_inputs(p, seed * 10 + static_cast<uint64_t>(l), kTokens[l])[0];
      in[static_cast<size_t>(l)].ids_TK = fresh.ids_TK;
      in[static_cast<size_t>(l)].scores_TK = fresh.scores_TK;
      in[static_cast<size_t>(l)].live = std::min(live, kTokens[l]);
    }
    return in;
  };
  struct Budget {
    const char* name;
    int64_t slot_bytes;
  };
  for (const Budget& b : {Budget{"full save", -1}, Budget{"minimum", plan.minimum_slot_bytes},
                          Budget{"mixed", mixed_slot}}) {
    SCOPED_TRACE(b.name);
    const Config config = stack_config(p, b.slot_bytes);
    auto graph_ctx = Context::create(config, make_single_gpu_transport(0));
    auto eager_ctx = Context::create(config, make_single_gpu_transport(0));
    auto calls = stack_calls(p, routing(1, 96), 0);
    std::vector<SavedLayer> saved;
    StreamGraph graph(
        [&](cudaStream_t stream) { run_stack(*graph_ctx, calls, stream); },  // warm-up outside capture
        [&](cudaStream_t stream) {
          for (auto& c : calls) saved.push_back(graph_ctx->forward(c->forward_args(stream)));
          for (int l = kStackLayers - 1; l >= 0; --l) {
            graph_ctx->backward(calls[static_cast<size_t>(l)]->backward_args(saved[static_cast<size_t>(l)], stream));
          }
        });
    int recomputed = 0, kept = 0, kept_at_full_count = 0;
    for (const auto& [seed, live] : std::vector<std::pair<uint64_t, int64_t>>{{2, 96}, {3, 7}, {4, 96}, {5, 40}}) {
      const std::vector<RankInputs> in = routing(seed, live);
      for (int l = 0; l < kStackLayers; ++l) {
        calls[static_cast<size_t>(l)]->set_routing(in[static_cast<size_t>(l)]);
        calls[static_cast<size_t>(l)]->poison();
      }
      graph.launch();
      graph_ctx->check();
      StackResult replayed;
      for (int l = 0; l < kStackLayers; ++l) {
        replayed.out.push_back(calls[static_cast<size_t>(l)]->outputs());
        replayed.recomputed.push_back(graph_ctx->recomputes(saved[static_cast<size_t>(l)]));
      }
      auto eager_calls = stack_calls(p, in, 0);
      const StackResult eager = run_stack(*eager_ctx, eager_calls, graph.stream());
      const std::string what = std::string(b.name) + " graph replay, seed " + std::to_string(seed);
      EXPECT_EQ(replayed.recomputed, eager.recomputed) << what;
      expect_stack_bitwise_equal(replayed, eager, what);
      for (bool r : eager.recomputed) (r ? recomputed : kept) += 1;
      for (int l = 0; l < kStackLayers; ++l) {
        const bool full = std::min(live, kTokens[l]) == p.max_tokens;
        kept_at_full_count += full && !eager.recomputed[static_cast<size_t>(l)] ? 1 : 0;
      }
    }
    if (b.slot_bytes < 0) {
      EXPECT_EQ(recomputed, 0);
    }
    // At the minimum budget calls of max_tokens live tokens recompute; a call of few live rows
    // (7) may fit its whole saved state (x_gathered and h13 only) and keep it.
    if (b.slot_bytes == plan.minimum_slot_bytes) {
      EXPECT_EQ(kept_at_full_count, 0);
      EXPECT_GT(recomputed, 0);
    }
    if (b.slot_bytes == mixed_slot) {
      EXPECT_GT(recomputed, 0) << "the mixed budget should make some layer recompute";
      EXPECT_GT(kept, 0) << "the mixed budget should let some layer save everything";
    }
    graph_ctx->close();
    eager_ctx->close();
  }
}

}  // namespace
}  // namespace epmoe::test
