// Bad inputs through Context: every rank gets an epmoe::Error naming the argument (host checks:
// dtype, shape, stride, null; data checks on the status word: ids, non-finite values, live
// count, T' across ranks, capacity overflow), and the next valid call on the same context gives
// the bits of a fresh context.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <latch>
#include <limits>
#include <string>
#include <vector>

#include "epmoe/error.h"
#include "moe_case.h"

namespace epmoe::test {
namespace {

constexpr int64_t kT = 12, kD = 40, kF = 24;
constexpr int kK = 2, kExperts = 4;

Problem base() {
  Problem p;
  p.ranks = 2;
  p.max_tokens = kT;
  p.hidden = kD;
  p.intermediate = kF;
  p.top_k = kK;
  p.experts = kExperts;
  p.capacity_factor = 1.0;  // exactly the balanced load: the good routing fills it
  return p;
}

// Every source sends T*K/experts routes to each expert: each rank receives exactly T*K rows.
std::vector<RankInputs> good_inputs(const Problem& p) {
  Router balanced = [](int rank, int64_t t, int k, std::mt19937_64&) -> int64_t {
    return (t * kK + k + rank) % kExperts;
  };
  return make_inputs(p, 500, p.max_tokens, balanced);
}

struct BadCall {
  std::string name;
  ErrorKind kind;
  std::string argument;                     // Error::argument() on every rank
  std::vector<std::string> message_parts;   // substrings of Error::what()
  std::function<void(int rank, RankInputs&)> edit_inputs;             // data errors
  std::function<void(int rank, ForwardArgs&, RankCall&)> edit_args;  // host-checked errors
  OverflowPolicy overflow = OverflowPolicy::report;
  CombineMode combine = CombineMode::per_route;
};

void PrintTo(const BadCall& c, std::ostream* os) { *os << c.name; }

class BadInputs : public ::testing::TestWithParam<BadCall> {};

TEST_P(BadInputs, EveryRankReportsItAndTheNextCallIsExact) {
  const BadCall& bad = GetParam();
  Problem p = base();
  p.overflow = bad.overflow;
  p.combine = bad.combine;
  const auto good = good_inputs(p);
  auto bad_in = good;
  if (bad.edit_inputs) {
    for (int r = 0; r < p.ranks; ++r) bad.edit_inputs(r, bad_in[r]);
  }
  std::vector<RankOutputs> after(p.ranks);
  std::atomic<int> errors{0};
  with_contexts(p, [&](int rank, Context& ctx) {
    RankCall call(p, bad_in[rank]);
    ForwardArgs args = call.forward_args();
    if (bad.edit_args) bad.edit_args(rank, args, call);
    try {
      ctx.forward(args);
      ADD_FAILURE() << bad.name << ": rank " << rank << " got no error";
    } catch (const Error& e) {
      ++errors;
      EXPECT_EQ(e.kind(), bad.kind) << e.what();
      EXPECT_EQ(e.argument(), bad.argument) << e.what();
      for (const std::string& part : bad.message_parts) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
            << "rank " << rank << ": '" << part << "' missing from: " << e.what();
      }
    }
    ctx.check();  // the status word was cleared when the error was thrown
    RankCall ok(p, good[rank]);
    ctx.backward(ok.backward_args(ctx.forward(ok.forward_args())));
    after[rank] = ok.outputs();
  });
  EXPECT_EQ(errors.load(), p.ranks);
  expect_bitwise_equal(after, run_layer(p, good), bad.name + ": next call vs a fresh context");
  expect_within_tolerance(measure(after, reference_layer(p, good), good), bad.name + ": next call");
}

std::vector<BadCall> bad_calls() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<BadCall> c;
  // ---- data errors: found by the stages, reported through the status word on every rank ----
  c.push_back({"IdOutOfRange", ErrorKind::invalid_routing, "topk_ids_TK",
               {"rank 1", "[-1, 4)", "got 4", "index 7"},
               [](int r, RankInputs& in) { if (r == 1) in.ids_TK[7] = kExperts; }, {}});
  c.push_back({"IdBelowMinusOne", ErrorKind::invalid_routing, "topk_ids_TK",
               {"rank 0", "got -2", "index 0"},
               [](int r, RankInputs& in) { if (r == 0) in.ids_TK[0] = -2; }, {}});
  c.push_back({"Int64IdThatWouldTruncateToValid", ErrorKind::invalid_routing, "topk_ids_TK",
               {"rank 1", "got 8589934592", "index 3"},
               [](int r, RankInputs& in) {
                 in.ids_i64 = true;
                 if (r == 1) in.ids_TK[3] = int64_t{1} << 33;  // low 32 bits: 0
               }, {}});
  c.push_back({"NanInX", ErrorKind::non_finite_input, "x_TD",
               {"rank 1", "index " + std::to_string(5 * kD + 3)},
               [](int r, RankInputs& in) { if (r == 1) in.x_TD[5 * kD + 3] = 0x7fc0; }, {}});
  c.push_back({"InfInScores", ErrorKind::non_finite_input, "topk_scores_TK", {"rank 0", "index 4"},
               [inf](int r, RankInputs& in) { if (r == 0) in.scores_TK[4] = inf; }, {}});
  c.push_back({"NanInBf16Scores", ErrorKind::non_finite_input, "topk_scores_TK",
               {"rank 1", "index 9"},
               [nan](int r, RankInputs& in) {
                 in.scores_bf16 = true;
                 if (r == 1) in.scores_TK[9] = nan;
               }, {}});
  c.push_back({"LiveCountAboveRows", ErrorKind::invalid_routing, "num_tokens_1",
               {"rank 0", "expected 12 tokens, got 13"},
               [](int r, RankInputs& in) { in.live = r == 0 ? kT + 1 : kT; }, {}});
  c.push_back({"LiveCountNegative", ErrorKind::invalid_routing, "num_tokens_1",
               {"rank 1", "got -3"}, {},
               [](int r, ForwardArgs& a, RankCall& call) {
                 call.live = r == 1 ? -3 : static_cast<int32_t>(kT);
                 a.num_tokens_1 = TensorRef::contiguous(&call.live, DType::i32, {1});
               }});
  c.push_back({"TokenCountMismatchAcrossRanks", ErrorKind::invalid_routing, "x_TD",
               {"rank 1", "expected 12 tokens, got 11"},
               [](int r, RankInputs& in) {
                 if (r != 1) return;
                 in.tokens = kT - 1;
                 in.x_TD.resize((kT - 1) * kD);
                 in.grad_y_TD.resize((kT - 1) * kD);
                 in.ids_TK.resize((kT - 1) * kK);
                 in.scores_TK.resize((kT - 1) * kK);
               }, {}});
  auto all_to_expert_0 = [](int, RankInputs& in) {
    for (auto& id : in.ids_TK) id = 0;
  };
  // Rank 0 would receive T*K*R = 48 rows; its capacity is T*K*1.0 = 24.
  c.push_back({"CapacityOverflow", ErrorKind::capacity_overflow, "topk_ids_TK",
               {"rank 0", "expected at most 24 received rows", "got 48"}, all_to_expert_0, {}});
  c.push_back({"CapacityOverflowTrapPolicy", ErrorKind::capacity_overflow, "topk_ids_TK",
               {"rank 0", "expected at most 24 received rows", "got 48"}, all_to_expert_0, {},
               OverflowPolicy::trap});
  // The per-rank combine skips the step the same way (its send, reduce and backward stages too).
  c.push_back({"CapacityOverflowPerRankCombine", ErrorKind::capacity_overflow, "topk_ids_TK",
               {"rank 0", "expected at most 24 received rows", "got 48"}, all_to_expert_0, {},
               OverflowPolicy::report, CombineMode::per_rank});
  c.push_back({"IdOutOfRangePerRankCombine", ErrorKind::invalid_routing, "topk_ids_TK",
               {"rank 1", "[-1, 4)", "got 4", "index 7"},
               [](int r, RankInputs& in) { if (r == 1) in.ids_TK[7] = kExperts; }, {},
               OverflowPolicy::report, CombineMode::per_rank});
  // ---- host-checked argument errors: thrown before any collective, on every rank ----
  c.push_back({"XWrongDtype", ErrorKind::invalid_argument, "x_TD", {"bf16", "f32"}, {},
               [](int, ForwardArgs& a, RankCall&) { a.x_TD.dtype = DType::f32; }});
  c.push_back({"XTooManyRows", ErrorKind::invalid_argument, "x_TD", {"[1, 12]", "got 13"}, {},
               [](int, ForwardArgs& a, RankCall&) { a.x_TD.shape[0] = kT + 1; }});
  c.push_back({"W13WrongShape", ErrorKind::invalid_argument, "w13_EFD",
               {"[2, 48, 40]", "[2, 48, 41]"}, {},
               [](int, ForwardArgs& a, RankCall&) { a.w13_EFD.shape[2] = kD + 1; }});
  c.push_back({"IdsNotContiguous", ErrorKind::invalid_argument, "topk_ids_TK",
               {"contiguous", "[1, 12]"}, {},
               [](int, ForwardArgs& a, RankCall&) { a.topk_ids_TK.stride = {1, kT}; }});
  c.push_back({"IdsAsFloat", ErrorKind::invalid_argument, "topk_ids_TK", {"i32 or i64", "f32"},
               {}, [](int, ForwardArgs& a, RankCall&) { a.topk_ids_TK.dtype = DType::f32; }});
  c.push_back({"ScoresWrongShape", ErrorKind::invalid_argument, "topk_scores_TK",
               {"[12, 2]", "[12, 3]"}, {},
               [](int, ForwardArgs& a, RankCall&) { a.topk_scores_TK.shape[1] = 3; }});
  c.push_back({"W2Null", ErrorKind::invalid_argument, "w2_EDF", {"nullptr"}, {},
               [](int, ForwardArgs& a, RankCall&) { a.w2_EDF.data = nullptr; }});
  c.push_back({"LiveCountWrongDtype", ErrorKind::invalid_argument, "num_tokens_1", {"i32"}, {},
               [](int, ForwardArgs& a, RankCall& call) {
                 a.num_tokens_1 = TensorRef::contiguous(&call.live, DType::i64, {1});
               }});
  return c;
}

INSTANTIATE_TEST_SUITE_P(Cases, BadInputs, ::testing::ValuesIn(bad_calls()),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(BadInputsBackward, WrongGradientDtypeThenRetry) {
  const Problem p = base();
  const auto good = good_inputs(p);
  std::vector<RankOutputs> after(p.ranks);
  with_contexts(p, [&](int rank, Context& ctx) {
    RankCall call(p, good[rank]);
    const SavedLayer saved = ctx.forward(call.forward_args());
    BackwardArgs wrong = call.backward_args(saved);
    wrong.grad_w2_EDF.dtype = DType::f32;
    try {
      ctx.backward(wrong);
      ADD_FAILURE() << "f32 grad_w2 accepted by a bf16-wgrad context";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      EXPECT_EQ(e.argument(), "grad_w2_EDF");
    }
    ctx.backward(call.backward_args(saved));  // the saved layer is still there
    after[rank] = call.outputs();
  });
  expect_bitwise_equal(after, run_layer(p, good), "backward retried after a bad call");
}

TEST(BadInputsOneRank, OtherRanksTimeOutNamingItThenTheContextWorks) {
  // Only rank 0 passes a bad dtype: it fails its host check and never reaches the publish
  // barrier; rank 1 times out there naming rank 0. Rank 0 starts its next call only after rank 1
  // has given up, so both meet again at the next call.
  Problem p = base();
  p.barrier_timeout_ms = 300;
  const auto good = good_inputs(p);
  std::latch gave_up(1);
  std::vector<RankOutputs> after(p.ranks);
  with_contexts(p, [&](int rank, Context& ctx) {
    RankCall call(p, good[rank]);
    ForwardArgs args = call.forward_args();
    if (rank == 0) args.x_TD.dtype = DType::f32;
    try {
      ctx.forward(args);
      ADD_FAILURE() << "rank " << rank << " got no error";
    } catch (const Error& e) {
      if (rank == 0) {
        EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
        EXPECT_EQ(e.argument(), "x_TD");
      } else {
        EXPECT_EQ(e.kind(), ErrorKind::timeout);
        EXPECT_NE(std::string(e.what()).find("rank(s) 0 "), std::string::npos) << e.what();
        EXPECT_NE(e.argument().find("stream barrier 0"), std::string::npos) << e.argument();
        gave_up.count_down();
      }
    }
    if (rank == 0) gave_up.wait();
    RankCall ok(p, good[rank]);
    ctx.backward(ok.backward_args(ctx.forward(ok.forward_args())));
    after[rank] = ok.outputs();
  });
  expect_bitwise_equal(after, run_layer(base(), good), "after a one-rank failure");
}

}  // namespace
}  // namespace epmoe::test
