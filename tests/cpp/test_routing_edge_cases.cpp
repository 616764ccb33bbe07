// Routing edge cases through Context: experts with no tokens, every route to one expert, -1
// routes, live counts below T (padding rows hold garbage and come out zero), a rank that receives
// nothing, a call with fewer rows than Config T; each with the per-route and the per-rank combine.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moe_case.h"

namespace epmoe::test {
namespace {

Problem base(int R, int64_t T, int K, int experts, CombineMode combine) {
  Problem p;
  p.combine = combine;
  p.ranks = R;
  p.max_tokens = T;
  p.hidden = 40;
  p.intermediate = 24;
  p.top_k = K;
  p.experts = experts;
  return p;
}

// Expert-e slice of a rank's weight gradients is exactly zero.
void expect_expert_grads_zero(const Problem& p, const RankOutputs& out, int e, const char* what) {
  const int64_t n13 = 2 * p.intermediate * p.hidden, n2 = p.hidden * p.intermediate;
  for (int64_t i = 0; i < n13; ++i) {
    ASSERT_EQ(out.grad_w13_EFD[e * n13 + i], 0.0f) << what << ": expert " << e;
  }
  for (int64_t i = 0; i < n2; ++i) {
    ASSERT_EQ(out.grad_w2_EDF[e * n2 + i], 0.0f) << what << ": expert " << e;
  }
}

class RoutingEdgeCases : public ::testing::TestWithParam<CombineMode> {};

TEST_P(RoutingEdgeCases, ExpertsWithZeroTokens) {
  const Problem p = base(2, 15, 2, 8, GetParam());
  // Only experts 0, 2 and 5 are picked: 1, 3 (rank 0) and 4, 6, 7 (rank 1) get no rows.
  const int64_t used[3] = {0, 2, 5};
  Router router = [&](int, int64_t t, int k, std::mt19937_64&) { return used[(t + k) % 3]; };
  const auto in = make_inputs(p, 31, p.max_tokens, router);
  const auto out = run_and_check(p, in, "zero-token experts");
  expect_expert_grads_zero(p, out[0], 1, "rank 0");
  expect_expert_grads_zero(p, out[0], 3, "rank 0");
  for (int e : {0, 2, 3}) expect_expert_grads_zero(p, out[1], e, "rank 1");  // globals 4, 6, 7
}

TEST_P(RoutingEdgeCases, EveryRouteToOneExpert) {
  // 3 ranks x 12 tokens x K = 2, all to global expert 4 (rank 2): every token picks it twice,
  // so rank 2 receives T*K*R = 72 rows (its whole capacity) and the other ranks none.
  Problem p = base(3, 12, 2, 6, GetParam());
  Router router = [](int, int64_t, int, std::mt19937_64&) -> int64_t { return 4; };
  const auto in = make_inputs(p, 41, p.max_tokens, router);
  const auto out = run_and_check(p, in, "all routes to one expert");
  for (int r = 0; r < 2; ++r) {
    for (int e = 0; e < 2; ++e) expect_expert_grads_zero(p, out[r], e, "non-owner");
  }
  expect_expert_grads_zero(p, out[2], 1, "rank 2 expert 5");
  p.fused = false;
  expect_bitwise_equal(out, run_layer(p, in), "fused vs unfused, one expert");
}

TEST_P(RoutingEdgeCases, InactiveRoutes) {
  // About 40% of routes are -1; tokens 0 and 5 have no active route at all.
  const Problem p = base(2, 14, 3, 8, GetParam());
  auto in = make_inputs(p, 51, p.max_tokens);
  std::mt19937_64 rng(52);
  std::bernoulli_distribution drop(0.4);
  for (auto& r : in) {
    for (int64_t t = 0; t < p.max_tokens; ++t) {
      for (int k = 0; k < p.top_k; ++k) {
        if (t == 0 || t == 5 || drop(rng)) r.ids_TK[t * p.top_k + k] = -1;
      }
    }
  }
  const auto out = run_and_check(p, in, "inactive routes");
  for (int r = 0; r < p.ranks; ++r) {
    for (int64_t i = 0; i < p.max_tokens * p.top_k; ++i) {
      if (in[r].ids_TK[i] == -1) {
        EXPECT_EQ(out[r].grad_scores_TK[i], 0.0f) << "rank " << r << " route " << i;
      }
    }
    for (int64_t t : {0, 5}) {
      for (int64_t d = 0; d < p.hidden; ++d) {
        ASSERT_EQ(out[r].y_TD[t * p.hidden + d], 0) << "token " << t;
        ASSERT_EQ(out[r].grad_x_TD[t * p.hidden + d], 0) << "token " << t;
      }
    }
  }
}

TEST_P(RoutingEdgeCases, LiveCountBelowTokensPaddingRowsAreZero) {
  // Config T = 16, the call passes T' = 13 rows; live counts 7, 0 and 13. Padding rows hold NaN x,
  // NaN scores and ids out of range: all ignored, and their y / grad_x / grad_scores are zero.
  const Problem p = base(3, 16, 2, 6, GetParam());
  const int64_t tokens = 13;
  const int64_t live[3] = {7, 0, 13};
  auto in = make_inputs(p, 61, tokens);
  for (int r = 0; r < p.ranks; ++r) {
    in[r].live = live[r];
    for (int64_t t = live[r]; t < tokens; ++t) {
      for (int64_t d = 0; d < p.hidden; ++d) in[r].x_TD[t * p.hidden + d] = 0x7fc0;
      for (int k = 0; k < p.top_k; ++k) {
        in[r].ids_TK[t * p.top_k + k] = k == 0 ? 1000 : -5;
        in[r].scores_TK[t * p.top_k + k] = std::nanf("");
      }
    }
  }
  const auto out = run_and_check(p, in, "live < T'");
  for (int r = 0; r < p.ranks; ++r) {
    for (int64_t i = live[r] * p.hidden; i < tokens * p.hidden; ++i) {
      ASSERT_EQ(out[r].y_TD[i], 0) << "rank " << r << " y element " << i;
      ASSERT_EQ(out[r].grad_x_TD[i], 0) << "rank " << r << " grad_x element " << i;
    }
    for (int64_t i = live[r] * p.top_k; i < tokens * p.top_k; ++i) {
      ASSERT_EQ(out[r].grad_scores_TK[i], 0.0f) << "rank " << r << " grad_scores element " << i;
    }
  }
}

TEST_P(RoutingEdgeCases, RankThatReceivesNothing) {
  // Nobody routes to rank 1's experts (2, 3): it still sends its tokens and gets their results.
  const Problem p = base(3, 9, 2, 6, GetParam());
  const int64_t allowed[4] = {0, 1, 4, 5};
  Router router = [&](int, int64_t, int k, std::mt19937_64& rng) {
    std::uniform_int_distribution<int> pick(0, 1);  // k = 0 from {0, 1}, k = 1 from {4, 5}
    return allowed[(k == 0 ? 0 : 2) + pick(rng)];
  };
  const auto in = make_inputs(p, 71, p.max_tokens, router);
  const auto out = run_and_check(p, in, "rank receives nothing");
  expect_expert_grads_zero(p, out[1], 0, "rank 1");
  expect_expert_grads_zero(p, out[1], 1, "rank 1");
  double norm = 0.0;
  for (bf16_t v : out[1].y_TD) norm += std::fabs(bf16_to_float(v));
  EXPECT_GT(norm, 0.0) << "rank 1's own tokens were served by the other ranks";
}

TEST_P(RoutingEdgeCases, SingleTokenFourRanks) {
  const Problem p = base(4, 1, 1, 4, GetParam());
  run_and_check(p, make_inputs(p, 81, 1), "T = 1, R = 4, K = 1");
}

INSTANTIATE_TEST_SUITE_P(Combine, RoutingEdgeCases,
                         ::testing::Values(CombineMode::per_route, CombineMode::per_rank));

}  // namespace
}  // namespace epmoe::test
