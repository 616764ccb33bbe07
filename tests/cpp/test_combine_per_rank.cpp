// Per-rank combine (Config.combine = per_rank) through Context on 1-8 CPU thread ranks: inference
// y and training y + all gradients within the bf16 tolerances of the float64 reference; R = 1
// bitwise equal to the per-route combine (y and every gradient); at any R grad_scores and the
// weight gradients bitwise equal to the per-route ones (the same dots and GEMMs, on the expert
// side); fused == unfused and repeated calls bitwise; rows that cross ranks counted for both
// modes; the configurations it does not support are refused naming the field. Recompute == full
// save for per_rank: test_slots.cpp; with fp8_block: test_combine_per_rank_fp8.cpp.
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "epmoe/error.h"
#include "epmoe/layered.h"
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

Problem inference_problem(const Shape& s, CombineMode combine) {
  Problem p = make_problem(s.R, s.T, s.D, s.F, s.K, s.experts,
                           s.clamped ? Activation::swiglu_clamped() : Activation::swiglu());
  p.inference = true;
  p.combine = combine;
  return p;
}

// y of every rank from `calls` forwards on one inference context group (the last call's y;
// every call's y must be the same bits).
std::vector<std::vector<bf16_t>> run_forward(const Problem& p, const std::vector<RankInputs>& in,
                                             int calls = 1) {
  std::vector<std::vector<bf16_t>> y(p.ranks);
  with_contexts(p, [&](int rank, Context& ctx) {
    RankCall call(p, in[rank]);
    for (int c = 0; c < calls; ++c) {
      ForwardArgs a = call.forward_args();
      a.save_for_backward = false;
      ctx.forward(a);
      if (c > 0) {
        EXPECT_EQ(call.y, y[rank]) << "call " << c << " rank " << rank << " " << p.name();
      }
      y[rank] = call.y;
    }
  });
  return y;
}

double y_rel_l2(const std::vector<std::vector<bf16_t>>& got,
                const std::vector<reference::RankOutputs>& ref) {
  std::vector<double> g, r;
  for (size_t i = 0; i < got.size(); ++i) {
    const std::vector<double> w = widen(got[i]);
    g.insert(g.end(), w.begin(), w.end());
    r.insert(r.end(), ref[i].y_TD.begin(), ref[i].y_TD.end());
  }
  return reference::rel_l2(r, g);
}

class CombinePerRank : public ::testing::TestWithParam<Shape> {};

TEST_P(CombinePerRank, ForwardMatchesReferenceFusedEqualsUnfusedAndRepeats) {
  const Shape shape = GetParam();
  Problem p = inference_problem(shape, CombineMode::per_rank);
  const auto in = make_inputs(p, 4321 + static_cast<uint64_t>(shape.T * 5 + shape.R), p.max_tokens);
  const auto ref = reference_layer(p, in);
  const auto fused = run_forward(p, in, 2);
  const double err = y_rel_l2(fused, ref);
  EXPECT_LE(err, rel_l2_bound(Precision::bf16, Output::y)) << p.name();
  p.fused = false;
  EXPECT_EQ(run_forward(p, in), fused) << "fused vs unfused " << p.name();
  // Against the per-route combine: bitwise at R = 1 (one partial per token: the owner's sum of one
  // rounded row is that row), within the tolerance otherwise (one more rounding per partial).
  p.fused = true;
  p.combine = CombineMode::per_route;
  const auto per_route = run_forward(p, in);
  if (shape.R == 1) {
    EXPECT_EQ(fused, per_route) << "per_rank vs per_route at R = 1 " << p.name();
  } else {
    EXPECT_LE(y_rel_l2(per_route, ref), rel_l2_bound(Precision::bf16, Output::y)) << p.name();
  }
}

TEST_P(CombinePerRank, TrainingMatchesReferenceAndPerRouteWhereItMust) {
  const Shape shape = GetParam();
  Problem p = inference_problem(shape, CombineMode::per_rank);
  p.inference = false;
  const auto in = make_inputs(p, 8765 + static_cast<uint64_t>(shape.T * 3 + shape.R), p.max_tokens);
  const auto per_rank = run_and_check(p, in, "per_rank training");
  expect_bitwise_equal(per_rank, run_layer(p, in), "second run " + p.name());
  p.fused = false;
  expect_bitwise_equal(per_rank, run_layer(p, in), "fused vs unfused " + p.name());
  p.fused = true;
  p.combine = CombineMode::per_route;
  const auto per_route = run_layer(p, in);
  if (shape.R == 1) {
    expect_bitwise_equal(per_rank, per_route, "per_rank vs per_route at R = 1 " + p.name());
    return;
  }
  for (int r = 0; r < p.ranks; ++r) {
    const std::string what = " rank " + std::to_string(r) + " " + p.name();
    EXPECT_EQ(per_rank[r].grad_scores_TK, per_route[r].grad_scores_TK) << "grad_scores" << what;
    EXPECT_EQ(per_rank[r].grad_w13_EFD, per_route[r].grad_w13_EFD) << "grad_w13" << what;
    EXPECT_EQ(per_rank[r].grad_w2_EDF, per_route[r].grad_w2_EDF) << "grad_w2" << what;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CombinePerRank,
    ::testing::Values(Shape{1, 16, 32, 24, 4, 8, false}, Shape{1, 9, 40, 16, 2, 4, true},
                      Shape{2, 16, 32, 24, 4, 8, false}, Shape{2, 19, 111, 40, 3, 6, true},
                      Shape{4, 12, 64, 32, 4, 8, false}, Shape{4, 7, 16, 8, 1, 4, false},
                      Shape{8, 10, 48, 24, 8, 16, true}, Shape{8, 5, 32, 16, 4, 8, false}));

TEST(CombinePerRankLive, PaddingRowsAreZeroAndLiveRowsMatchReference) {
  Problem p = inference_problem({2, 16, 32, 24, 4, 8, false}, CombineMode::per_rank);
  auto in = make_inputs(p, 77, p.max_tokens);
  for (RankInputs& r : in) r.live = 11;
  const auto y = run_forward(p, in);
  EXPECT_LE(y_rel_l2(y, reference_layer(p, in)), rel_l2_bound(Precision::bf16, Output::y));
  for (int r = 0; r < p.ranks; ++r) {
    for (int64_t i = 11 * p.hidden; i < p.max_tokens * p.hidden; ++i) {
      ASSERT_EQ(y[r][i], 0) << "rank " << r << " element " << i;
    }
  }
}

// Rows that cross to the owner per call: per_route one per active route (the layout's received
// rows M, which the scatter stores), per_rank one per (token, rank holding >= 1 of its routes)
// (the layout's pulls P, which the send stage walks). Counted from the ids and from the layouts
// build_layout_reference gives every receiver. K = 4 of 8 experts on 2 and 4 ranks: most tokens
// have two or more routes on one rank.
TEST(CombinePerRankRows, PerRankSendsOneRowPerTokenAndRank) {
  for (int R : {2, 4}) {
    const Problem p = inference_problem({R, 64, 32, 24, 4, 8, false}, CombineMode::per_rank);
    const auto in = make_inputs(p, 5, p.max_tokens);
    const int64_t T = p.max_tokens;
    const int K = p.top_k, E = p.local_experts();
    int64_t route_rows = 0, rank_rows = 0;
    std::vector<std::vector<int32_t>> ids(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      for (int64_t t = 0; t < T; ++t) {
        std::set<int64_t> ranks;
        for (int k = 0; k < K; ++k) {
          const int64_t id = in[r].ids_TK[t * K + k];
          ids[r].push_back(static_cast<int32_t>(id));
          if (id < 0) continue;
          ++route_rows;
          ranks.insert(id / E);
        }
        rank_rows += static_cast<int64_t>(ranks.size());
      }
    }
    EXPECT_EQ(route_rows, R * T * K);
    EXPECT_LT(rank_rows, route_rows);
    EXPECT_GE(rank_rows, R * T);  // >= one rank per token
    std::vector<const int32_t*> ids_R;
    for (const auto& v : ids) ids_R.push_back(v.data());
    const int64_t capacity = R * T * K;
    int64_t layout_rows = 0, layout_pulls = 0;
    for (int q = 0; q < R; ++q) {
      std::vector<int32_t> storage(static_cast<size_t>(layout_bytes(capacity, T, K, E, R).total) / 4);
      const LayoutView view = carve_layout(storage.data(), capacity, T, K, E, R);
      build_layout_reference(ids_R.data(), T, K, E, R, q, capacity, view);
      layout_rows += view.header[kLayoutRows];
      layout_pulls += view.header[kLayoutPulls];
    }
    EXPECT_EQ(layout_rows, route_rows) << "R = " << R;
    EXPECT_EQ(layout_pulls, rank_rows) << "R = " << R;
    std::printf("combine rows per call (R=%d, T=64, K=4, 8 experts): per_route %lld, per_rank %lld\n",
                R, static_cast<long long>(route_rows), static_cast<long long>(rank_rows));
  }
}

// fp8_block is accepted (training and inference: test_combine_per_rank_fp8.cpp); the weight-only
// formats and the layered API are refused naming the field.
TEST(CombinePerRankConfig, Fp8AcceptedWeightOnlyFormatsAndLayeredRefusedNamingTheField) {
  Problem p = inference_problem({2, 8, 32, 16, 2, 4, false}, CombineMode::per_rank);
  p.inference = false;
  p.precision = Precision::fp8_block;
  EXPECT_NE(p.config().to_string().find("combine=per_rank"), std::string::npos);
  p.inference = true;
  EXPECT_NO_THROW((void)p.config());
  p.prepared_weights = true;
  for (const Precision weight_only : {Precision::nvfp4, Precision::mxfp8}) {
    p.precision = weight_only;
    try {
      (void)p.config();
      ADD_FAILURE() << "per_rank " << to_string(weight_only) << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "Config.precision") << e.what();
    }
  }
  p.prepared_weights = false;
  p.precision = Precision::bf16;
  p.inference = true;
  p.ranks = 1;
  p.experts = 4;
  const Config config = p.config();
  EXPECT_NE(config.to_string().find("combine=per_rank"), std::string::npos);
  run_on_ranks(1, [&](int, std::shared_ptr<Transport> transport) {
    auto ctx = Context::create(config, transport);
    EXPECT_EQ(ctx->plan().combine_buffer_bytes, align_bytes(8 * 1 * 32 * 2));
    try {
      Layered::create(*ctx, transport);
      ADD_FAILURE() << "the layered API accepted per_rank";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "Config.combine") << e.what();
    }
    ctx->close();
  });
}

}  // namespace
}  // namespace epmoe::test
