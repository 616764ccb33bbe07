// Activation slots packed across layers with save-or-recompute decided by the planner
// (DESIGN.md §4): a stack of layers in one slot under budgets from the minimum (every layer saves
// only its input and backward replays the forward) to the maximum useful (every layer saves
// everything). Replayed results must equal saved results bitwise, and the decisions must follow
// the look-ahead rule, which this file re-derives from the routing on its own.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "epmoe/error.h"
#include "core/plan_terms.h"
#include "epmoe/memory_plan.h"
#include "harness.h"
#include "moe_case.h"

namespace epmoe::test {
namespace {

constexpr int kLayers = 4;

Problem stack_problem(int R, bool fused, CombineMode combine = CombineMode::per_route) {
  Problem p;
  p.combine = combine;
  p.ranks = R;
  p.max_tokens = 16;
  p.hidden = 32;
  p.intermediate = 24;
  p.top_k = 2;
  p.experts = 8;
  p.fused = fused;
  p.layers_per_slot = kLayers;
  return p;
}

// Tokens of each layer's call: different row counts, so that the packed sizes differ.
const int64_t kTokens[kLayers] = {16, 5, 16, 9};

std::vector<std::vector<RankInputs>> stack_inputs(const Problem& p) {
  std::vector<std::vector<RankInputs>> in;
  for (int l = 0; l < kLayers; ++l) in.push_back(make_inputs(p, 100 + l, kTokens[l]));
  return in;
}

struct StackRun {
  std::vector<std::vector<RankOutputs>> out;  // [layer][rank]
  std::vector<bool> recomputed;               // [layer], rank 0's answer (all ranks must agree)
  int64_t peak = 0;
};

// slot_bytes < 0: the default (maximum useful) budget. Runs the stack twice on one context group:
// the second pass must give the same bits (the slot was rewound by the first backward).
StackRun run_stack(const Problem& p, const std::vector<std::vector<RankInputs>>& in,
                   int64_t slot_bytes) {
  ConfigFields f = p.config().fields();
  if (slot_bytes >= 0) f.slots.slot_bytes = slot_bytes;
  const Config config(f);
  StackRun run;
  run.out.assign(kLayers, std::vector<RankOutputs>(p.ranks));
  std::vector<std::vector<bool>> decided(p.ranks);
  std::vector<int64_t> peaks(p.ranks);
  run_on_ranks(p.ranks, [&](int rank, std::shared_ptr<Transport> transport) {
    auto ctx = Context::create(config, std::move(transport));
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<RankCall> calls;
      for (int l = 0; l < kLayers; ++l) calls.emplace_back(p, in[l][rank]);
      std::vector<SavedLayer> saved;
      for (int l = 0; l < kLayers; ++l) saved.push_back(ctx->forward(calls[l].forward_args(0)));
      if (pass == 0) {
        for (int l = 0; l < kLayers; ++l) decided[rank].push_back(ctx->recomputes(saved[l]));
      }
      for (int l = kLayers - 1; l >= 0; --l) ctx->backward(calls[l].backward_args(saved[l]));
      for (int l = 0; l < kLayers; ++l) {
        const RankOutputs o = calls[l].outputs();
        if (pass == 0) {
          run.out[l][rank] = o;
        } else {
          EXPECT_EQ(o.y_TD, run.out[l][rank].y_TD) << "second pass, layer " << l;
          EXPECT_EQ(o.grad_x_TD, run.out[l][rank].grad_x_TD) << "second pass, layer " << l;
          EXPECT_EQ(o.grad_w13_EFD, run.out[l][rank].grad_w13_EFD) << "second pass, layer " << l;
        }
      }
    }
    peaks[rank] = ctx->slot_peak_bytes(0);
    ctx->close();
  });
  for (int r = 1; r < p.ranks; ++r) {
    EXPECT_EQ(decided[r], decided[0]) << "rank " << r << " decided differently from rank 0";
    EXPECT_EQ(peaks[r], peaks[0]) << "rank " << r;
  }
  run.recomputed = decided[0];
  run.peak = peaks[0];
  return run;
}

void expect_same_bits(const StackRun& a, const StackRun& b, const std::string& what) {
  for (int l = 0; l < kLayers; ++l) {
    expect_bitwise_equal(a.out[l], b.out[l], what + ", layer " + std::to_string(l));
  }
}

// ---- the rule, re-derived: bytes of a full save and of an input save (docs/memory.md) ----
int64_t up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
int64_t full_bytes(const Problem& p, int64_t rows, int64_t G) {
  const int64_t D = p.hidden, F = p.intermediate;
  return up(up(rows * D * 2, 128) + up(rows * 2 * F * 2, 128), G);  // x_gathered | h13
}
int64_t input_bytes(const Problem& p, int64_t G) { return up(up(p.max_tokens * p.hidden * 2, 128), G); }

// Rows rank q receives in each layer: active routes to its experts.
std::vector<std::vector<int64_t>> rows_per_rank(const Problem& p,
                                                const std::vector<std::vector<RankInputs>>& in) {
  std::vector<std::vector<int64_t>> rows(kLayers, std::vector<int64_t>(p.ranks, 0));
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < p.ranks; ++s) {
      for (int64_t id : in[l][s].ids_TK) {
        if (id >= 0) ++rows[l][id / p.local_experts()];
      }
    }
  }
  return rows;
}

std::vector<bool> expected_decisions(const Problem& p, const std::vector<std::vector<int64_t>>& rows,
                                     int64_t packed, int64_t G) {
  std::vector<int64_t> saved(p.ranks, 0);
  std::vector<bool> out;
  for (int l = 0; l < kLayers; ++l) {
    int64_t need = 0;
    for (int r = 0; r < p.ranks; ++r) need = std::max(need, saved[r] + full_bytes(p, rows[l][r], G));
    const bool recompute = need + (kLayers - 1 - l) * input_bytes(p, G) > packed;
    for (int r = 0; r < p.ranks; ++r) {
      saved[r] += recompute ? input_bytes(p, G) : full_bytes(p, rows[l][r], G);
    }
    out.push_back(recompute);
  }
  return out;
}

class Slots : public ::testing::TestWithParam<std::tuple<int, bool, CombineMode>> {};

TEST_P(Slots, MinimumBudgetReplaysEveryLayerBitwise) {
  const auto [R, fused, combine] = GetParam();
  const Problem p = stack_problem(R, fused, combine);
  const auto in = stack_inputs(p);
  const MemoryPlan plan = plan_memory(p.config(), R);
  const StackRun saved = run_stack(p, in, -1);
  const StackRun replayed = run_stack(p, in, plan.minimum_slot_bytes);
  EXPECT_EQ(saved.recomputed, std::vector<bool>(kLayers, false));
  EXPECT_EQ(replayed.recomputed, std::vector<bool>(kLayers, true));
  expect_same_bits(saved, replayed, p.name() + " minimum budget vs full save");
  EXPECT_EQ(replayed.peak, kLayers * plan.saved_input_bytes_per_layer);
  // The saved results are right, not only equal.
  for (int l = 0; l < kLayers; ++l) {
    const OutputErrors errors = measure(saved.out[l], reference_layer(p, in[l]), in[l]);
    expect_within_tolerance(errors, p.name() + " layer " + std::to_string(l));
  }
}

// FP8: the replay re-quantizes the saved bf16 x into the dispatch buffer (the forward's codec on
// the same values), so replayed layers give the full save's bits too.
TEST_P(Slots, Fp8MinimumBudgetReplaysEveryLayerBitwise) {
  const auto [R, fused, combine] = GetParam();
  Problem p = stack_problem(R, fused, combine);
  p.precision = Precision::fp8_block;
  const auto in = stack_inputs(p);
  const MemoryPlan plan = plan_memory(p.config(), R);
  const StackRun saved = run_stack(p, in, -1);
  const StackRun replayed = run_stack(p, in, plan.minimum_slot_bytes);
  EXPECT_EQ(replayed.recomputed, std::vector<bool>(kLayers, true));
  expect_same_bits(saved, replayed, p.name() + " minimum budget vs full save");
  for (int l = 0; l < kLayers; ++l) {
    const OutputErrors errors = measure(saved.out[l], reference_layer(p, in[l]), in[l]);
    expect_within_training_tolerance(errors, Precision::fp8_block, false, Against::float64,
                                     p.name() + " layer " + std::to_string(l));
  }
}

TEST_P(Slots, MixedBudgetRecomputesSomeLayers) {
  const auto [R, fused, combine] = GetParam();
  const Problem p = stack_problem(R, fused, combine);
  const auto in = stack_inputs(p);
  const MemoryPlan plan = plan_memory(p.config(), R);
  const int64_t G = plan.packing_granule_bytes;
  const auto rows = rows_per_rank(p, in);
  auto max_full = [&](int l) {
    int64_t m = 0;
    for (int r = 0; r < R; ++r) m = std::max(m, full_bytes(p, rows[l][r], G));
    return m;
  };
  // Room for layer 0's and layer 1's full saves and two inputs: layers 2 and 3 (16 and 9 tokens)
  // cannot save everything; layer 1 (5 tokens) can.
  const int64_t packed = max_full(0) + max_full(1) + 2 * input_bytes(p, G);
  const std::vector<bool> expected = expected_decisions(p, rows, packed, G);
  ASSERT_NE(std::count(expected.begin(), expected.end(), true), 0);
  ASSERT_NE(std::count(expected.begin(), expected.end(), false), 0);
  const StackRun saved = run_stack(p, in, -1);
  const StackRun mixed = run_stack(p, in, plan.slot_metadata_bytes + packed);
  EXPECT_EQ(mixed.recomputed, expected);
  expect_same_bits(saved, mixed, p.name() + " mixed budget vs full save");
  EXPECT_LE(mixed.peak, packed);
}

INSTANTIATE_TEST_SUITE_P(RanksAndEpilogues, Slots,
                         ::testing::Values(std::make_tuple(1, true, CombineMode::per_route),
                                           std::make_tuple(2, true, CombineMode::per_route),
                                           std::make_tuple(2, false, CombineMode::per_route),
                                           std::make_tuple(1, true, CombineMode::per_rank),
                                           std::make_tuple(2, true, CombineMode::per_rank),
                                           std::make_tuple(4, true, CombineMode::per_rank),
                                           std::make_tuple(2, false, CombineMode::per_rank)));

TEST(SlotsBudget, PacksByActualRows) {
  // A budget of metadata + the full saves of the layers as they route (not at capacity rows):
  // nothing recomputes, though L full saves at capacity would not fit.
  const Problem p = stack_problem(2, true);
  const auto in = stack_inputs(p);
  const MemoryPlan plan = plan_memory(p.config(), 2);
  const int64_t G = plan.packing_granule_bytes;
  const auto rows = rows_per_rank(p, in);
  std::vector<int64_t> total(2, 0);
  for (int l = 0; l < kLayers; ++l) {
    for (int r = 0; r < 2; ++r) total[r] += full_bytes(p, rows[l][r], G);
  }
  const int64_t packed = std::max(total[0], total[1]);
  ASSERT_LT(plan.slot_metadata_bytes + packed, plan.maximum_useful_slot_bytes);
  const StackRun run = run_stack(p, in, plan.slot_metadata_bytes + packed);
  EXPECT_EQ(run.recomputed, std::vector<bool>(kLayers, false));
  EXPECT_EQ(run.peak, packed);
}

// CUDA reads x_gathered through one descriptor over the arena as rows of D bf16: wherever the
// planner puts it (a slot's packed region, or the call scratch of a recompute layer) it must
// start on a whole row, for any D and any budget.
TEST(SlotsBudget, GatheredRowsStartOnWholeArenaRows) {
  for (int64_t D : {32, 136, 200, 1000}) {
    for (double factor : {0.0, 0.3, 1.0}) {
      Problem p = stack_problem(2, true);
      p.hidden = D;
      ConfigFields f = p.config().fields();
      if (factor > 0.0) f.slots.slot_capacity_factor = factor;
      f.slots.num_slots = 3;
      const Config config(f);
      const MemoryPlan plan = plan_memory(config, 2);
      const int64_t row = 2 * D;
      const std::string what = "D " + std::to_string(D) + ", factor " + std::to_string(factor);
      EXPECT_EQ(plan.packing_granule_bytes % row, 0) << what;
      EXPECT_EQ(plan.slot_bytes % plan.packing_granule_bytes, 0) << what;
      EXPECT_EQ(plan.slot_metadata_bytes % plan.packing_granule_bytes, 0) << what;
      EXPECT_EQ(plan.saved_input_bytes_per_layer % plan.packing_granule_bytes, 0) << what;
      // The scratch starts after the slots: route scratch, pad, then the call scratch, whose
      // x_gathered follows its layout (fused and unfused alike).
      const Dims d{p.max_tokens, D, p.intermediate, p.top_k, p.local_experts(), 2};
      EXPECT_EQ(plan.activation_bytes % plan.packing_granule_bytes, 0) << what;
      EXPECT_LT(plan.call_scratch_pad_bytes, plan.packing_granule_bytes) << what;
      for (bool unfused : {false, true}) {
        const CallScratchLayout call = call_scratch_layout(d, plan.recv_capacity_rows, unfused);
        const int64_t x_gathered = plan.activation_bytes + plan.route_scratch_bytes +
                                   plan.call_scratch_pad_bytes + call.x_gathered;
        EXPECT_EQ(x_gathered % row, 0) << what << ", unfused " << unfused;
        EXPECT_EQ(x_gathered % plan.packing_granule_bytes, 0) << what << ", unfused " << unfused;
      }
    }
  }
}

// 2D = 272 (granule 2176): the call scratch needs a pad after the route scratch. The Context
// asserts that x_gathered lands on the granule; replaying every layer from the call scratch gives
// the full-save bits.
TEST(SlotsBudget, PaddedCallScratchReplaysBitwise) {
  Problem p = stack_problem(2, true);
  p.hidden = 136;
  const auto in = stack_inputs(p);
  const MemoryPlan plan = plan_memory(p.config(), 2);
  ASSERT_EQ(plan.packing_granule_bytes, 2176);
  ASSERT_GT(plan.call_scratch_pad_bytes, 0);
  const StackRun saved = run_stack(p, in, -1);
  const StackRun replayed = run_stack(p, in, plan.minimum_slot_bytes);
  EXPECT_EQ(replayed.recomputed, std::vector<bool>(kLayers, true));
  expect_same_bits(saved, replayed, p.name() + " padded call scratch");
}

// One layer (L = 1) at the minimum budget: a full save (x_gathered and h13 at the received rows)
// fits only when, on the fullest rank, it is no larger than the input x [T, D]: a call with one
// live token on rank 0 and none on rank 1 (at most K rows a rank) saves everything, a call with
// every token live recomputes, with either combine. Either way the default budget's bits.
TEST(SlotsBudget, MinimumBudgetSavesACallOfFewRows) {
  struct Run {
    std::vector<RankOutputs> out;
    std::vector<bool> recomputed;  // [rank]
  };
  auto run = [](const Problem& p, const std::vector<RankInputs>& in, int64_t slot_bytes) {
    ConfigFields f = p.config().fields();
    if (slot_bytes >= 0) f.slots.slot_bytes = slot_bytes;
    const Config config(f);
    Run r{std::vector<RankOutputs>(2), std::vector<bool>(2)};
    run_on_ranks(2, [&](int rank, std::shared_ptr<Transport> transport) {
      auto ctx = Context::create(config, std::move(transport));
      RankCall call(p, in[static_cast<size_t>(rank)]);
      const SavedLayer saved = ctx->forward(call.forward_args(0));
      r.recomputed[static_cast<size_t>(rank)] = ctx->recomputes(saved);
      ctx->backward(call.backward_args(saved));
      r.out[static_cast<size_t>(rank)] = call.outputs();
      ctx->close();
    });
    return r;
  };
  for (const CombineMode combine : {CombineMode::per_route, CombineMode::per_rank}) {
    Problem p = stack_problem(2, true, combine);
    p.layers_per_slot = 1;
    const MemoryPlan plan = plan_memory(p.config(), 2);
    for (const int64_t live0 : {int64_t{16}, int64_t{1}}) {
      std::vector<RankInputs> in = make_inputs(p, 7, 16);
      in[0].live = live0;
      in[1].live = live0 == 16 ? 16 : 0;
      const std::string what = p.name() + " live " + std::to_string(in[0].live) + " and " +
                               std::to_string(in[1].live);
      const bool saves = live0 == 1;
      const Run minimum = run(p, in, plan.minimum_slot_bytes);
      EXPECT_EQ(minimum.recomputed, std::vector<bool>(2, !saves)) << what;
      const Run full = run(p, in, -1);
      EXPECT_EQ(full.recomputed, std::vector<bool>(2, false)) << what;
      expect_bitwise_equal(minimum.out, full.out, what + ": minimum budget vs full save");
    }
  }
}

TEST(SlotsBudget, BelowTheMinimumNamesTheField) {
  const Problem p = stack_problem(2, true);
  const MemoryPlan plan = plan_memory(p.config(), 2);
  ConfigFields f = p.config().fields();
  f.slots.slot_bytes = plan.minimum_slot_bytes - plan.packing_granule_bytes;
  const Config config(f);
  try {
    run_on_ranks(2, [&](int, std::shared_ptr<Transport> transport) {
      (void)Context::create(config, std::move(transport));
    });
    ADD_FAILURE() << "no error for a slot below the minimum";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "Config.slots.slot_bytes") << e.what();
    EXPECT_NE(std::string(e.what()).find(">= " + std::to_string(plan.minimum_slot_bytes)),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace epmoe::test
