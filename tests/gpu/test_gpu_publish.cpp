// publish_forward / publish_backward on the GPU against the CPU reference: the whole routing
// buffer (header, ids, scores) and the live rows of the dispatch buffer, bitwise; and the
// input-check rule pinned by explicit expectations:
//   live count outside [0, T'] (always checked), then with check_inputs ids outside [-1, E*R),
//   non-finite x of live rows, non-finite scores of active routes of live rows; the first check
//   in that order that fails, at its smallest flat index, is recorded.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "step_builder.h"

namespace epmoe::test {
namespace {

const Shape kShape{19, 24, 8, 3, 4, 2, 0};  // T, D, F, K, E (8 global experts), R

std::vector<uint8_t> routing_bytes(World& w, int r) {
  const Shape& sh = w.shape();
  return w.read<uint8_t>(w.routing(r), routing_buffer_layout(sh.T, sh.K).bytes);
}

RoutingHeader header_of(World& w, int r) { return w.read<RoutingHeader>(w.routing(r), 1)[0]; }

void expect_same_publication(Pair& p, const std::vector<int64_t>& live) {
  const Shape& sh = p.gpu.shape();
  for (int r = 0; r < sh.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(same_bits(routing_bytes(p.cpu, r), routing_bytes(p.gpu, r))) << "routing buffer";
    const int64_t n = live[static_cast<size_t>(r)] * sh.D;
    EXPECT_TRUE(same_bits(p.cpu.read<bf16_t>(p.cpu.dispatch(r), n),
                          p.gpu.read<bf16_t>(p.gpu.dispatch(r), n)))
        << "dispatch rows";
  }
}

// Publishes rank inputs built by make_input and then edited by `edit`, on both backends.
std::unique_ptr<Pair> publish(const std::function<void(std::vector<RankInput>&)>& edit,
                              bool check_inputs = true, uint32_t seed = 3) {
  auto p = std::make_unique<Pair>(kShape);
  p->set_flags(ActivationParams{}, check_inputs);
  Rng rng(seed);
  std::vector<RankInput> in;
  for (int r = 0; r < kShape.R; ++r) {
    in.push_back(make_input(rng, kShape, r, kShape.T, std::nullopt, Pattern::distinct));
  }
  edit(in);
  std::vector<int64_t> live;
  for (int r = 0; r < kShape.R; ++r) {
    p->set_input(r, in[static_cast<size_t>(r)]);
    live.push_back(in[static_cast<size_t>(r)].live_rows());
  }
  p->all([](Backend& b, const Step& s) { b.publish_forward(s); });
  expect_same_publication(*p, live);
  return p;
}

void expect_no_error(const RoutingHeader& h) {
  EXPECT_EQ(h.error_code, 0);
  EXPECT_EQ(h.error_arg, 0);
  EXPECT_EQ(h.error_index, -1);
}

void expect_error(const RoutingHeader& h, StatusCode code, StatusArg arg, int64_t value,
                  int64_t bound, int64_t index) {
  EXPECT_EQ(h.error_code, static_cast<int32_t>(code));
  EXPECT_EQ(h.error_arg, static_cast<int32_t>(arg));
  EXPECT_EQ(h.error_value, value);
  EXPECT_EQ(h.error_bound, bound);
  EXPECT_EQ(h.error_index, index);
}

TEST(GpuPublish, CleanInputsEveryDtypeAndLiveCount) {
  EPMOE_REQUIRE_GPU();
  for (DType ids_dtype : {DType::i32, DType::i64}) {
    for (DType scores_dtype : {DType::f32, DType::bf16}) {
      for (int64_t tokens : {kShape.T, kShape.T - 3, int64_t{1}}) {
        for (std::optional<int32_t> live : {std::optional<int32_t>{}, std::optional<int32_t>{0},
                                            std::optional<int32_t>{1},
                                            std::optional<int32_t>(static_cast<int32_t>(tokens))}) {
          SCOPED_TRACE(std::string(to_string(ids_dtype)) + " " + to_string(scores_dtype) + " T'=" +
                       std::to_string(tokens) + " live=" + (live ? std::to_string(*live) : "null"));
          auto p = publish([&](std::vector<RankInput>& in) {
            Rng rng(static_cast<uint32_t>(tokens) + 100);
            for (int r = 0; r < kShape.R; ++r) {
              in[static_cast<size_t>(r)] =
                  make_input(rng, kShape, r, tokens, r == 0 ? live : std::nullopt, Pattern::duplicates);
              in[static_cast<size_t>(r)].ids_dtype = ids_dtype;
              in[static_cast<size_t>(r)].scores_dtype = scores_dtype;
            }
          });
          const RoutingHeader h = header_of(p->gpu, 0);
          expect_no_error(h);
          EXPECT_EQ(h.tokens, tokens);
          EXPECT_EQ(h.live, live ? *live : tokens);
          EXPECT_EQ(h.sequence, 1);
        }
      }
    }
  }
}

TEST(GpuPublish, LiveCountOutOfRangeIsAlwaysReported) {
  EPMOE_REQUIRE_GPU();
  for (bool check : {true, false}) {
    for (int32_t live : {-1, static_cast<int32_t>(kShape.T + 1)}) {
      SCOPED_TRACE("live " + std::to_string(live) + (check ? " checked" : " unchecked"));
      auto p = publish(
          [&](std::vector<RankInput>& in) {
            in[0].live = live;
            in[0].ids[4] = 1000;  // a later-ordered error: not the one reported
          },
          check);
      const RoutingHeader h = header_of(p->gpu, 0);
      expect_error(h, StatusCode::token_count_mismatch, StatusArg::num_tokens_1, live, kShape.T, 0);
      EXPECT_EQ(h.live, live < 0 ? 0 : kShape.T) << "published live count is clamped";
    }
  }
}

TEST(GpuPublish, ExpertIdsOutOfRange) {
  EPMOE_REQUIRE_GPU();
  const int64_t bound = kShape.experts();
  {
    auto p = publish([&](std::vector<RankInput>& in) {
      in[1].ids[20] = bound;
      in[1].ids[9] = -2;
      in[1].ids[40] = 1;
    });
    expect_error(header_of(p->gpu, 1), StatusCode::expert_id_out_of_range, StatusArg::topk_ids_TK,
                 -2, bound, 9);
    expect_no_error(header_of(p->gpu, 0));
    const auto ids = p->gpu.read<int32_t>(p->gpu.routing(1) + routing_buffer_layout(kShape.T, kShape.K).ids_offset,
                                          kShape.T * kShape.K);
    EXPECT_EQ(ids[9], -1) << "an invalid id is published as -1";
    EXPECT_EQ(ids[20], -1);
    EXPECT_EQ(ids[40], 1);
  }
  {
    auto p = publish([&](std::vector<RankInput>& in) {
      in[0].ids_dtype = DType::i64;
      in[0].ids[33] = int64_t{1} << 40;
    });
    expect_error(header_of(p->gpu, 0), StatusCode::expert_id_out_of_range, StatusArg::topk_ids_TK,
                 int64_t{1} << 40, bound, 33);
  }
  {  // Past the live count nothing is read.
    auto p = publish([&](std::vector<RankInput>& in) {
      in[0].live = 5;
      in[0].ids[5 * kShape.K] = bound + 7;
    });
    expect_no_error(header_of(p->gpu, 0));
  }
}

TEST(GpuPublish, NonFiniteScoresOfActiveRoutesOnly) {
  EPMOE_REQUIRE_GPU();
  {
    auto p = publish([&](std::vector<RankInput>& in) {
      in[0].ids[2] = -1;
      in[0].scores[2] = NAN;  // inactive: never read, not an error
      in[0].ids[7] = 3;
      in[0].scores[7] = INFINITY;
      in[0].ids[11] = 5;
      in[0].scores[11] = NAN;
    });
    expect_error(header_of(p->gpu, 0), StatusCode::non_finite_input, StatusArg::topk_scores_TK, 0, 0, 7);
  }
  {
    auto p = publish([&](std::vector<RankInput>& in) {
      in[0].live = 3;
      in[0].ids[3 * kShape.K] = 1;
      in[0].scores[3 * kShape.K] = NAN;  // padding row
      in[0].scores_dtype = DType::bf16;
    });
    expect_no_error(header_of(p->gpu, 0));
  }
}

TEST(GpuPublish, NonFiniteRowsOfLiveTokensOnly) {
  EPMOE_REQUIRE_GPU();
  const int64_t D = kShape.D;
  {
    auto p = publish([&](std::vector<RankInput>& in) {
      in[1].x[static_cast<size_t>(5 * D + 13)] = 0x7f80;  // +inf
      in[1].x[static_cast<size_t>(5 * D + 9)] = 0xffc1;   // NaN, same vector, lower index
      in[1].x[static_cast<size_t>(9 * D)] = 0x7fc0;       // NaN, later row
    });
    expect_error(header_of(p->gpu, 1), StatusCode::non_finite_input, StatusArg::x_TD, 0, 0, 5 * D + 9);
  }
  {
    auto p = publish([&](std::vector<RankInput>& in) {
      in[0].live = 4;
      in[0].x[static_cast<size_t>(4 * D)] = 0x7fc0;  // padding row
    });
    expect_no_error(header_of(p->gpu, 0));
  }
}

TEST(GpuPublish, CheckOrderIdsThenRowsThenScores) {
  EPMOE_REQUIRE_GPU();
  const int64_t D = kShape.D;
  {  // x and scores: x reported, although the score's index is smaller
    auto p = publish([&](std::vector<RankInput>& in) {
      in[0].ids[1] = 2;
      in[0].scores[1] = NAN;
      in[0].x[static_cast<size_t>(7 * D + 3)] = 0x7f80;
    });
    expect_error(header_of(p->gpu, 0), StatusCode::non_finite_input, StatusArg::x_TD, 0, 0, 7 * D + 3);
  }
  {  // ids and x: the id
    auto p = publish([&](std::vector<RankInput>& in) {
      in[0].ids[50] = 99;
      in[0].x[0] = 0x7f80;
    });
    expect_error(header_of(p->gpu, 0), StatusCode::expert_id_out_of_range, StatusArg::topk_ids_TK,
                 99, kShape.experts(), 50);
  }
}

TEST(GpuPublish, UncheckedInputsStillPublishSafeIds) {
  EPMOE_REQUIRE_GPU();
  auto p = publish(
      [&](std::vector<RankInput>& in) {
        in[0].ids[3] = 1000;
        in[0].x[0] = 0x7fc0;
        in[0].ids[4] = 1;
        in[0].scores[4] = NAN;
      },
      false);
  expect_no_error(header_of(p->gpu, 0));
  const auto ids = p->gpu.read<int32_t>(p->gpu.routing(0) + routing_buffer_layout(kShape.T, kShape.K).ids_offset, 8);
  EXPECT_EQ(ids[3], -1);
}

TEST(GpuPublish, ErrorKeyIsClearedForTheNextCall) {
  EPMOE_REQUIRE_GPU();
  Pair p(kShape);
  Rng rng(5);
  for (int r = 0; r < kShape.R; ++r) {
    RankInput in = make_input(rng, kShape, r, kShape.T, std::nullopt, Pattern::distinct);
    if (r == 0) in.ids[0] = -9;
    p.set_input(r, in);
  }
  p.all([](Backend& b, const Step& s) { b.publish_forward(s); });
  EXPECT_EQ(header_of(p.gpu, 0).error_code, static_cast<int32_t>(StatusCode::expert_id_out_of_range));
  p.set_input(0, make_input(rng, kShape, 0, kShape.T, std::nullopt, Pattern::distinct));
  p.cpu.sequence = p.gpu.sequence = 2;
  p.all([](Backend& b, const Step& s) { b.publish_forward(s); });
  const RoutingHeader h = header_of(p.gpu, 0);
  expect_no_error(h);
  EXPECT_EQ(h.sequence, 2);
  for (int32_t w : h.reserved) EXPECT_EQ(w, 0) << "reserved header words are zero between calls";
  EXPECT_TRUE(same_bits(routing_bytes(p.cpu, 0), routing_bytes(p.gpu, 0)));
}

TEST(GpuPublish, BackwardPublishesGradYWithTheForwardsLiveCount) {
  EPMOE_REQUIRE_GPU();
  Pair p(kShape);
  Rng rng(6);
  std::vector<RankInput> in;
  for (int r = 0; r < kShape.R; ++r) {
    in.push_back(make_input(rng, kShape, r, kShape.T - 2, r == 1 ? std::optional<int32_t>(6) : std::nullopt,
                            Pattern::duplicates));
    p.set_input(r, in.back());
  }
  p.all([](Backend& b, const Step& s) { b.publish_forward(s); });
  p.all([](Backend& b, const Step& s) { b.route(s); });
  p.cpu.sequence = p.gpu.sequence = 2;
  p.all([](Backend& b, const Step& s) { b.publish_backward(s); });
  for (int r = 0; r < kShape.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(same_bits(routing_bytes(p.cpu, r), routing_bytes(p.gpu, r)));
    const int64_t live = in[static_cast<size_t>(r)].live_rows();
    const auto rows = p.gpu.read<bf16_t>(p.gpu.dispatch(r), live * kShape.D);
    EXPECT_TRUE(same_bits(std::vector<bf16_t>(in[static_cast<size_t>(r)].grad_y.begin(),
                                              in[static_cast<size_t>(r)].grad_y.begin() + live * kShape.D),
                          rows));
    const RoutingHeader h = header_of(p.gpu, r);
    EXPECT_EQ(h.live, live);
    EXPECT_EQ(h.sequence, 2);
    expect_no_error(h);
  }
}

TEST(GpuPublish, BackwardOfASkippedStepWritesNothing) {
  EPMOE_REQUIRE_GPU();
  Pair p(kShape);
  Rng rng(7);
  for (int r = 0; r < kShape.R; ++r) {
    RankInput in = make_input(rng, kShape, r, kShape.T, std::nullopt, Pattern::distinct);
    if (r == 1) in.ids[3] = 100;
    p.set_input(r, in);
  }
  p.all([](Backend& b, const Step& s) { b.publish_forward(s); });
  p.all([](Backend& b, const Step& s) { b.route(s); });
  ASSERT_EQ(p.gpu.layout_header(0)[kLayoutSkip], 1);
  const auto routing_before = routing_bytes(p.gpu, 0);
  const auto dispatch_before = p.gpu.read<bf16_t>(p.gpu.dispatch(0), kShape.T * kShape.D);
  p.all([](Backend& b, const Step& s) { b.publish_backward(s); });
  EXPECT_TRUE(same_bits(routing_before, routing_bytes(p.gpu, 0)));
  EXPECT_TRUE(same_bits(dispatch_before, p.gpu.read<bf16_t>(p.gpu.dispatch(0), kShape.T * kShape.D)));
  EXPECT_TRUE(same_bits(routing_bytes(p.cpu, 0), routing_bytes(p.gpu, 0)));
}

}  // namespace
}  // namespace epmoe::test
