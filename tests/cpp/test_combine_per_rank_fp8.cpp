// Per-rank combine with FP8 block-scaled training and inference (Config.combine = per_rank,
// precision = fp8_block) through Context on 1-3 CPU thread ranks. per_rank changes only where the
// k-sum of a token's routes happens, so the FP8 GEMMs see the same operands as per_route:
// - R = 1: y and every gradient bitwise equal to per_route (one partial per token: the owner adds
//   one rounded row to 0), fused and unfused;
// - any R: grad_scores and both weight gradients bitwise equal to per_route (expert-side dots and
//   WGRADs of the same rows); y and grad_x within the fp8_block tolerances of the float64
//   reference (one more bf16 rounding per partial row);
// - fused == unfused, prepared == per-call weights, repeated calls, inference y == training y,
//   all bitwise. Recompute == full save: test_slots.cpp.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "harness.h"
#include "moe_case.h"

namespace epmoe::test {
namespace {

struct Shape {
  int R;
  int64_t T, D, F;
  int K, experts;
  bool clamped;
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "R=" << s.R << " T=" << s.T << " D=" << s.D << " F=" << s.F << " K=" << s.K
      << " experts=" << s.experts << (s.clamped ? " clamped" : " swiglu");
}

Problem fp8_per_rank(const Shape& s) {
  Problem p = make_problem(s.R, s.T, s.D, s.F, s.K, s.experts,
                           s.clamped ? Activation::swiglu_clamped() : Activation::swiglu());
  p.precision = Precision::fp8_block;
  p.combine = CombineMode::per_rank;
  return p;
}

// Forward + backward twice on one context group: the second call must repeat the first's bits.
std::vector<RankOutputs> run_twice(const Problem& p, const std::vector<RankInputs>& in) {
  std::vector<RankOutputs> out(p.ranks), again(p.ranks);
  with_contexts(p, [&](int rank, Context& ctx) {
    for (int pass = 0; pass < 2; ++pass) {
      RankCall call(p, in[rank]);
      const SavedLayer saved = ctx.forward(call.forward_args());
      ctx.backward(call.backward_args(saved));
      (pass == 0 ? out : again)[rank] = call.outputs();
    }
  });
  expect_bitwise_equal(out, again, p.name() + ": second call on the same context");
  return out;
}

class CombinePerRankFp8 : public ::testing::TestWithParam<Shape> {};

TEST_P(CombinePerRankFp8, TrainingMatchesReferenceAndPerRouteWhereItMust) {
  const Problem p = fp8_per_rank(GetParam());
  const std::vector<RankInputs> in =
      make_inputs(p, 6100 + static_cast<uint64_t>(p.max_tokens * 7 + p.ranks), p.max_tokens);
  const std::vector<RankOutputs> per_rank = run_twice(p, in);
  expect_within_training_tolerance(measure(per_rank, reference_layer(p, in), in),
                                   Precision::fp8_block, GetParam().clamped, Against::float64,
                                   "fp8 per_rank vs float64 | " + p.name());
  Problem unfused = p;
  unfused.fused = false;
  expect_bitwise_equal(run_layer(unfused, in), per_rank, "unfused vs fused " + p.name());
  Problem prepared = p;
  prepared.prepared_weights = true;
  expect_bitwise_equal(run_layer(prepared, in), per_rank, "prepared vs per-call " + p.name());

  for (bool fused : {true, false}) {
    Problem route = p;
    route.combine = CombineMode::per_route;
    route.fused = fused;
    const std::vector<RankOutputs> per_route = run_layer(route, in);
    if (p.ranks == 1) {
      expect_bitwise_equal(per_rank, per_route, "per_rank vs per_route at R = 1 " + route.name());
      continue;
    }
    for (int r = 0; r < p.ranks; ++r) {
      const std::string what = " rank " + std::to_string(r) + " " + route.name();
      EXPECT_EQ(per_rank[r].grad_scores_TK, per_route[r].grad_scores_TK) << "grad_scores" << what;
      EXPECT_EQ(per_rank[r].grad_w13_EFD, per_route[r].grad_w13_EFD) << "grad_w13" << what;
      EXPECT_EQ(per_rank[r].grad_w2_EDF, per_route[r].grad_w2_EDF) << "grad_w2" << what;
    }
  }
}

// An inference context (FP8 forward alone, its scratch trimmed to the h rows, rows_MD kept for the
// send) gives the training context's y bitwise, with a live count below T on rank 0.
TEST_P(CombinePerRankFp8, InferenceForwardEqualsTrainingForwardBitwise) {
  const Problem p = fp8_per_rank(GetParam());
  std::vector<RankInputs> in =
      make_inputs(p, 6300 + static_cast<uint64_t>(p.max_tokens * 3 + p.ranks), p.max_tokens);
  in[0].live = p.max_tokens - 3;
  const std::vector<RankOutputs> training = run_layer(p, in);
  for (bool fused : {true, false}) {
    for (bool prepared : {false, true}) {
      Problem q = p;
      q.inference = true;
      q.fused = fused;
      q.prepared_weights = prepared;
      const std::vector<std::vector<bf16_t>> y = forward_y(q, in, 2);
      for (int r = 0; r < p.ranks; ++r) {
        EXPECT_EQ(y[r], training[r].y_TD) << "inference vs training y, rank " << r << " "
                                          << q.name();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CombinePerRankFp8,
    ::testing::Values(Shape{1, 16, 32, 24, 4, 8, false}, Shape{1, 19, 111, 40, 3, 6, true},
                      Shape{2, 16, 32, 24, 4, 8, false}, Shape{2, 24, 256, 200, 2, 4, false},
                      Shape{3, 19, 136, 72, 4, 6, true}, Shape{3, 40, 64, 48, 3, 9, false}));

}  // namespace
}  // namespace epmoe::test
