// Every non-GEMM stage on the GPU against the CPU reference, through a whole step of R simulated
// ranks (one GPU, real peer tables): publish, route, dispatch, SwiGLU, scatter, reduce, and the
// backward's publish, grad_scores, gather_grad, SwiGLU backward, scatter, reduce, in the layered
// API's form (score in gather_grad, grad_scores from h3) and in the Context's (score after the W2
// DGRAD). The GEMM outputs are replaced by the same random rows on both sides. Everything is
// compared bitwise except the SwiGLU outputs and what is summed from them (expf of the host libm
// vs the device: within one bf16 ulp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include <string>
#include <vector>

#include "core/activation.h"
#include "step_builder.h"

namespace epmoe::test {
namespace {

struct StagesCase {
  std::string name;
  Shape shape;
  Pattern pattern;
  int64_t tokens_minus = 0;           // T' = T - tokens_minus
  std::optional<int32_t> live_rank0;  // live count of rank 0
  ActivationParams act{};
  DType scores_dtype = DType::f32;
  bool with_h3 = true;                // false: grad_scores reads the combine buffer
};
StagesCase stages_case(std::string name, const Shape& shape, Pattern pattern, int64_t tokens_minus = 0,
                       std::optional<int32_t> live_rank0 = std::nullopt, ActivationParams act = {},
                       DType scores_dtype = DType::f32, bool with_h3 = true) {
  return StagesCase{std::move(name), shape, pattern, tokens_minus, live_rank0, act, scores_dtype, with_h3};
}

// Active routes of rank r's live rows: slot t*K + k with route_row >= 0.
std::vector<int64_t> active_slots(World& w, int r, int64_t live) {
  const Shape& sh = w.shape();
  const auto rows = w.read<int32_t>(w.step(r).layout.route_row_TK, sh.T * sh.K);
  std::vector<int64_t> slots;
  for (int64_t i = 0; i < live * sh.K; ++i) {
    if (rows[static_cast<size_t>(i)] >= 0) slots.push_back(i);
  }
  return slots;
}

// The rows [T, K, D] buffer `base` holds at the given slots.
std::vector<bf16_t> slot_rows(World& w, const bf16_t* base, const std::vector<int64_t>& slots) {
  const int64_t D = w.shape().D;
  const auto all = w.read<bf16_t>(base, w.shape().T * w.shape().K * D);
  std::vector<bf16_t> out;
  for (int64_t s : slots) {
    out.insert(out.end(), all.begin() + s * D, all.begin() + (s + 1) * D);
  }
  return out;
}

// Rows [0, M) of an [capacity, width] buffer of rank r.
std::vector<bf16_t> rows_of(World& w, const bf16_t* base, int r, int64_t width) {
  return w.read<bf16_t>(base, w.rows(r) * width);
}

void run_stages(const StagesCase& c, uint32_t seed) {
  SCOPED_TRACE(c.name);
  const Shape& sh = c.shape;
  const int R = sh.R;
  const int64_t T = sh.T, D = sh.D, F = sh.F, K = sh.K, cap = sh.cap();
  Pair p(sh, c.with_h3);
  p.set_flags(c.act, true);
  // Dispatch counts arrivals only for a gated W13: every other case counts them (one warp per
  // pull), the rest run the column-sliced pull and leave the counters zero.
  p.cpu.arrival_gated_w13 = p.gpu.arrival_gated_w13 = (seed % 2) == 0;
  Rng rng(seed);
  std::vector<RankInput> in;
  const int64_t tokens = T - c.tokens_minus;
  for (int r = 0; r < R; ++r) {
    in.push_back(make_input(rng, sh, r, tokens, r == 0 ? c.live_rank0 : std::nullopt, c.pattern));
    in.back().scores_dtype = c.scores_dtype;
    p.set_input(r, in.back());
  }
  auto live = [&](int r) { return in[static_cast<size_t>(r)].live_rows(); };

  // ---- forward ----
  p.all([](Backend& b, const Step& s) { b.publish_forward(s); });
  p.all([](Backend& b, const Step& s) { b.route(s); });
  for (int r = 0; r < R; ++r) {
    ASSERT_EQ(p.gpu.status(r).code, 0) << p.gpu.status(r).to_string();
    ASSERT_TRUE(same_bits(p.cpu.layout_header(r), p.gpu.layout_header(r)));
    ASSERT_LE(p.gpu.rows(r), cap);
  }

  p.all([](Backend& b, const Step& s) { b.dispatch(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("dispatch, rank " + std::to_string(r));
    const auto got = rows_of(p.gpu, p.gpu.step(r).x_gathered_MD, r, D);
    EXPECT_TRUE(same_bits(rows_of(p.cpu, p.cpu.step(r).x_gathered_MD, r, D), got));
    // Rank-coded rows: row m holds (src rank + 1, src token % 256 + 1, ...).
    const auto src = p.gpu.read<int32_t>(p.gpu.step(r).layout.recv_src_M, p.gpu.rows(r));
    for (size_t m = 0; m < src.size(); ++m) {
      const int q = src_rank(src[m], T, sh.K);
      const int64_t t = src_slot(src[m], T, sh.K) / K;
      ASSERT_EQ(bf16_to_float(got[m * D]), static_cast<float>(q + 1)) << "row " << m;
      ASSERT_EQ(bf16_to_float(got[m * D + 1]), static_cast<float>(t % 256 + 1)) << "row " << m;
    }
    // One read per (source rank, token), fanned out: every row equals the per-route copy of its
    // source row, bitwise.
    for (size_t m = 0; m < src.size(); ++m) {
      const int q = src_rank(src[m], T, sh.K);
      const int64_t t = src_slot(src[m], T, sh.K) / K;
      const auto want = p.gpu.read<bf16_t>(p.gpu.dispatch(q) + t * D, D);
      ASSERT_TRUE(same_bits(want, std::vector<bf16_t>(got.begin() + static_cast<int64_t>(m) * D,
                                                      got.begin() + static_cast<int64_t>(m + 1) * D)))
          << "row " << m << " vs its route's source row";
    }
    // Arrival counters: the rows stored per 128-row block, as the CPU twin counts them (zero
    // without a gated W13).
    const int64_t blocks = arrival_blocks(cap);
    EXPECT_TRUE(same_bits(p.cpu.read<uint32_t>(arrivals_B(p.cpu.step(r)), blocks),
                          p.gpu.read<uint32_t>(arrivals_B(p.gpu.step(r)), blocks)))
        << "arrival counters";
    const auto header = p.gpu.layout_header(r);
    std::printf("[ pulls    ] rank %d: %d source rows read for %d received rows\n", r,
                header[kLayoutPulls], header[kLayoutRows]);
  }

  for (int r = 0; r < R; ++r) {  // stands in for the W13 GEMM
    const auto h13 = rng.bf16s(cap * 2 * F);
    p.cpu.fill(p.cpu.step(r).h13_M2F, h13);
    p.gpu.fill(p.gpu.step(r).h13_M2F, h13);
  }
  p.all([](Backend& b, const Step& s) { b.swiglu_forward(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("swiglu_forward, rank " + std::to_string(r));
    EXPECT_TRUE(close_bf16(rows_of(p.cpu, p.cpu.step(r).h_MF, r, F), rows_of(p.gpu, p.gpu.step(r).h_MF, r, F)));
  }

  std::vector<std::vector<bf16_t>> w2_rows;
  for (int r = 0; r < R; ++r) {  // stands in for the W2 GEMM
    w2_rows.push_back(rng.bf16s(cap * D));
    p.cpu.fill(p.cpu.step(r).rows_MD, w2_rows.back());
    p.gpu.fill(p.gpu.step(r).rows_MD, w2_rows.back());
  }
  p.all([](Backend& b, const Step& s) { b.scatter_rows(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("scatter_rows, rank " + std::to_string(r));
    const auto slots = active_slots(p.gpu, r, live(r));
    const auto got = slot_rows(p.gpu, p.gpu.combine(r), slots);
    EXPECT_TRUE(same_bits(slot_rows(p.cpu, p.cpu.combine(r), slots), got));
    // Slot (t, k) holds row route_row[t, k] of its receiver's rows_MD.
    const auto route_row = p.gpu.read<int32_t>(p.gpu.step(r).layout.route_row_TK, T * K);
    const auto ids = p.gpu.read<int32_t>(p.gpu.routing(r) + routing_buffer_layout(T, sh.K).ids_offset, T * K);
    for (size_t j = 0; j < slots.size(); ++j) {
      const int q = ids[static_cast<size_t>(slots[j])] / sh.E;
      const int64_t row = route_row[static_cast<size_t>(slots[j])];
      const std::vector<bf16_t> want(w2_rows[static_cast<size_t>(q)].begin() + row * D,
                                     w2_rows[static_cast<size_t>(q)].begin() + (row + 1) * D);
      ASSERT_TRUE(same_bits(want, std::vector<bf16_t>(got.begin() + static_cast<int64_t>(j) * D,
                                                       got.begin() + static_cast<int64_t>(j + 1) * D)))
          << "slot " << slots[j];
    }
  }

  p.all([](Backend& b, const Step& s) { b.reduce_forward(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("reduce_forward, rank " + std::to_string(r));
    const auto y = p.gpu.read<bf16_t>(p.gpu.step(r).y_TD, tokens * D);
    EXPECT_TRUE(same_bits(p.cpu.read<bf16_t>(p.cpu.step(r).y_TD, tokens * D), y));
    for (int64_t i = live(r) * D; i < tokens * D; ++i) ASSERT_EQ(y[static_cast<size_t>(i)], 0) << "padding row";
    if (c.with_h3) {
      const auto slots = active_slots(p.gpu, r, live(r));
      EXPECT_TRUE(same_bits(slot_rows(p.cpu, p.cpu.step(r).h3_TKD, slots),
                            slot_rows(p.gpu, p.gpu.step(r).h3_TKD, slots)));
      EXPECT_TRUE(same_bits(slot_rows(p.gpu, p.gpu.combine(r), slots),
                            slot_rows(p.gpu, p.gpu.step(r).h3_TKD, slots)));
    }
  }

  // ---- backward ----
  p.cpu.sequence = p.gpu.sequence = 2;
  p.all([](Backend& b, const Step& s) { b.publish_backward(s); });
  p.all([](Backend& b, const Step& s) { b.grad_scores(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("grad_scores, rank " + std::to_string(r));
    // Same products, another fp32 summation order (warp tree vs sequential): fp32 rounding apart.
    const auto gs = p.gpu.read<float>(p.gpu.step(r).grad_scores_TK, tokens * K);
    const auto want = p.cpu.read<float>(p.cpu.step(r).grad_scores_TK, tokens * K);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(gs[i], want[i], 1e-5 * (1.0 + std::fabs(want[i]) + static_cast<double>(D) * 1e-2))
          << "route " << i;
      if (want[i] == 0.0f) {
        ASSERT_EQ(gs[i], 0.0f) << "inactive route " << i;
      }
    }
  }
  p.all([](Backend& b, const Step& s) { b.gather_grad(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("gather_grad, rank " + std::to_string(r));
    EXPECT_TRUE(same_bits(rows_of(p.cpu, p.cpu.step(r).grad_h3_MD, r, D),
                          rows_of(p.gpu, p.gpu.step(r).grad_h3_MD, r, D)));
  }
  for (int r = 0; r < R; ++r) {  // stands in for the W2 DGRAD GEMM
    const auto grad_h = rng.bf16s(cap * F);
    p.cpu.fill(p.cpu.step(r).grad_h_MF, grad_h);
    p.gpu.fill(p.gpu.step(r).grad_h_MF, grad_h);
  }
  p.all([](Backend& b, const Step& s) { b.swiglu_backward(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("swiglu_backward, rank " + std::to_string(r));
    EXPECT_TRUE(close_bf16(rows_of(p.cpu, p.cpu.step(r).grad_h13_M2F, r, 2 * F),
                           rows_of(p.gpu, p.gpu.step(r).grad_h13_M2F, r, 2 * F)));
    EXPECT_TRUE(close_bf16(rows_of(p.cpu, p.cpu.step(r).h_MF, r, F), rows_of(p.gpu, p.gpu.step(r).h_MF, r, F)));
  }
  for (int r = 0; r < R; ++r) {  // stands in for the W13 DGRAD GEMM
    const auto rows = rng.bf16s(cap * D);
    p.cpu.fill(p.cpu.step(r).rows_MD, rows);
    p.gpu.fill(p.gpu.step(r).rows_MD, rows);
  }
  p.all([](Backend& b, const Step& s) { b.scatter_rows(s); });
  p.all([](Backend& b, const Step& s) { b.reduce_backward(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("reduce_backward, rank " + std::to_string(r));
    const auto gx = p.gpu.read<bf16_t>(p.gpu.step(r).grad_x_TD, tokens * D);
    EXPECT_TRUE(same_bits(p.cpu.read<bf16_t>(p.cpu.step(r).grad_x_TD, tokens * D), gx));
    for (int64_t i = live(r) * D; i < tokens * D; ++i) ASSERT_EQ(gx[static_cast<size_t>(i)], 0) << "padding row";
    EXPECT_TRUE(same_bits(std::vector<Status>{p.cpu.status(r)}, std::vector<Status>{p.gpu.status(r)}));
  }

  // ---- backward with the score after the W2 DGRAD (the Context's; docs/memory.md) ----
  p.cpu.score_after_w2_dgrad = p.gpu.score_after_w2_dgrad = true;
  p.cpu.sequence = p.gpu.sequence = 3;
  p.all([](Backend& b, const Step& s) { b.publish_backward(s); });
  p.all([](Backend& b, const Step& s) { b.gather_grad(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("gather_grad with row scores, rank " + std::to_string(r));
    const auto got = rows_of(p.gpu, p.gpu.step(r).grad_h3_MD, r, D);
    EXPECT_TRUE(same_bits(rows_of(p.cpu, p.cpu.step(r).grad_h3_MD, r, D), got));
    EXPECT_TRUE(same_bits(p.cpu.read<float>(p.cpu.step(r).row_scores_M, p.cpu.rows(r)),
                          p.gpu.read<float>(p.gpu.step(r).row_scores_M, p.gpu.rows(r))));
    // Unscaled: row m is its route's grad_y row.
    const auto src = p.gpu.read<int32_t>(p.gpu.step(r).layout.recv_src_M, p.gpu.rows(r));
    for (size_t m = 0; m < src.size(); ++m) {
      const int q = src_rank(src[m], T, sh.K);
      const int64_t t = src_slot(src[m], T, sh.K) / K;
      const auto& g = in[static_cast<size_t>(q)].grad_y;
      ASSERT_TRUE(same_bits(std::vector<bf16_t>(g.begin() + t * D, g.begin() + (t + 1) * D),
                            std::vector<bf16_t>(got.begin() + static_cast<int64_t>(m) * D,
                                                got.begin() + static_cast<int64_t>(m + 1) * D)))
          << "row " << m;
    }
  }
  std::vector<std::vector<bf16_t>> dh_rows;
  for (int r = 0; r < R; ++r) {  // stands in for the W2 DGRAD GEMM: dh, unscaled
    dh_rows.push_back(rng.bf16s(cap * F));
    p.cpu.fill(p.cpu.step(r).grad_h_MF, dh_rows.back());
    p.gpu.fill(p.gpu.step(r).grad_h_MF, dh_rows.back());
  }
  p.all([](Backend& b, const Step& s) { b.swiglu_backward(s); });
  // Per (row, chunk): 2^-7 * sum |dh * bf16(act)| from the CPU's h13, a bound of what one-ulp
  // differences of bf16(act) between the host libm and the device can change in a partial.
  const int64_t chunks = score_chunks(F);
  std::vector<std::vector<double>> chunk_bound(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("swiglu_backward with row scores, rank " + std::to_string(r));
    const int64_t M = p.cpu.rows(r);
    EXPECT_TRUE(close_bf16(rows_of(p.cpu, p.cpu.step(r).grad_h13_M2F, r, 2 * F),
                           rows_of(p.gpu, p.gpu.step(r).grad_h13_M2F, r, 2 * F)));
    EXPECT_TRUE(close_bf16(rows_of(p.cpu, p.cpu.step(r).h_MF, r, F), rows_of(p.gpu, p.gpu.step(r).h_MF, r, F)));
    const auto h13 = p.cpu.read<bf16_t>(p.cpu.step(r).h13_M2F, M * 2 * F);
    const auto& dh = dh_rows[static_cast<size_t>(r)];
    std::vector<double>& bound = chunk_bound[static_cast<size_t>(r)];
    bound.assign(static_cast<size_t>(M * chunks), 0.0);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t f = 0; f < F; ++f) {
        const float gate = bf16_to_float(h13[static_cast<size_t>(m * 2 * F + f)]);
        const float up = bf16_to_float(h13[static_cast<size_t>(m * 2 * F + F + f)]);
        const float a = bf16_to_float(bf16(swiglu_forward(gate, up, p.cpu.act)));
        const double d = bf16_to_float(dh[static_cast<size_t>(m * F + f)]);
        bound[static_cast<size_t>(m * chunks + f / kScoreChunkCols)] += std::fabs(a * d) * 0x1p-7;
      }
    }
    const auto want = p.cpu.read<float>(p.cpu.step(r).score_parts_MC, M * chunks);
    const auto got = p.gpu.read<float>(p.gpu.step(r).score_parts_MC, M * chunks);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], bound[i] + 1e-6 * (1.0 + std::fabs(want[i])))
          << "row " << i / static_cast<size_t>(chunks) << " chunk " << i % static_cast<size_t>(chunks);
    }
  }
  p.all([](Backend& b, const Step& s) { b.grad_scores(s); });
  p.all([](Backend& b, const Step& s) { b.reduce_backward(s); });
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("grad_scores after the W2 DGRAD, rank " + std::to_string(r));
    const auto gs = p.gpu.read<float>(p.gpu.step(r).grad_scores_TK, tokens * K);
    const auto want = p.cpu.read<float>(p.cpu.step(r).grad_scores_TK, tokens * K);
    const auto route_row = p.gpu.read<int32_t>(p.gpu.step(r).layout.route_row_TK, T * K);
    const auto ids = p.gpu.read<int32_t>(p.gpu.routing(r) + routing_buffer_layout(T, sh.K).ids_offset, T * K);
    for (int64_t i = 0; i < tokens * K; ++i) {
      const size_t u = static_cast<size_t>(i);
      if (i >= live(r) * K || route_row[u] < 0) {
        ASSERT_EQ(gs[u], 0.0f) << "inactive route or padding row " << i;
        ASSERT_EQ(want[u], 0.0f) << "inactive route or padding row " << i;
        continue;
      }
      // The route's row on its expert rank q: the sum of that row's chunk bounds.
      const std::vector<double>& bound = chunk_bound[static_cast<size_t>(ids[u] / sh.E)];
      double b = 0.0;
      for (int64_t j = 0; j < chunks; ++j) b += bound[static_cast<size_t>(route_row[u] * chunks + j)];
      ASSERT_NEAR(gs[u], want[u], b + 1e-6 * (1.0 + std::fabs(want[u]))) << "route " << i;
    }
    EXPECT_TRUE(same_bits(std::vector<Status>{p.cpu.status(r)}, std::vector<Status>{p.gpu.status(r)}));
  }
}

ActivationParams clamped() {
  ActivationParams a;
  a.clamped = 1;
  a.alpha = 1.702f;
  a.limit = 1.5f;  // inputs reach past it on both sides
  return a;
}

TEST(GpuStages, MatchCpuReferenceThroughAStep) {
  EPMOE_REQUIRE_GPU();
  std::vector<StagesCase> cases = {
      stages_case("T=1 K=1 E=1 R=1", {1, 8, 8, 1, 1, 1, 0}, Pattern::duplicates),
      stages_case("T=19 K=2 E=3 R=1, live 13", {19, 24, 16, 2, 3, 1, 0}, Pattern::distinct, 0, 13),
      stages_case("R=2, D=72 (column tail), T'=60", {64, 72, 40, 4, 4, 2, 0}, Pattern::distinct, 4),
      // Duplicates can send all K routes of a token to one rank: capacity T*R*K.
      stages_case("R=3, K=8 > E, duplicates, D=136", {100, 136, 24, 8, 2, 3, 100 * 3 * 8}, Pattern::duplicates, 0, 77),
      stages_case("R=2, all routes to one expert", {50, 16, 8, 2, 3, 2, 0}, Pattern::one_expert),
      stages_case("R=2, zero-token experts, bf16 scores", {37, 32, 16, 3, 4, 2, 0}, Pattern::sparse, 0, 0,
       ActivationParams{}, DType::bf16),
      stages_case("R=2, clamped SwiGLU, no saved h3", {45, 40, 48, 2, 2, 2, 0}, Pattern::distinct, 1, 30, clamped(),
       DType::f32, false),
      stages_case("R=1, every route inactive", {12, 8, 8, 2, 2, 1, 0}, Pattern::inactive),
      stages_case("R=2, wide rows", {33, 2048, 64, 2, 2, 2, 0}, Pattern::distinct),
      // D = 1032: two column slices per pull (dispatch, gather_grad), the second one vector wide;
      // K = 9: the reduce's one-route-at-a-time loop (more than kLoadedRoutes).
      stages_case("R=2, D=1032, K=9", {24, 1032, 16, 9, 8, 2, 0}, Pattern::distinct, 2, 17),
      // F = 136: three grad_scores chunks of 64 columns, the last one 8 wide.
      stages_case("R=2, F=136", {40, 32, 136, 2, 4, 2, 0}, Pattern::distinct, 0, 29),
  };
  uint32_t seed = 20;
  for (const StagesCase& c : cases) run_stages(c, seed++);
}

// A skipped step (capacity overflow): outputs are zeros, nothing else is written.
TEST(GpuStages, SkippedStepWritesZerosAndNothingElse) {
  EPMOE_REQUIRE_GPU();
  Shape sh{30, 16, 8, 2, 2, 2, 0};
  sh.capacity = 20;
  Pair p(sh);
  Rng rng(30);
  for (int r = 0; r < sh.R; ++r) p.set_input(r, make_input(rng, sh, r, sh.T, std::nullopt, Pattern::one_expert));
  p.all([](Backend& b, const Step& s) { b.publish_forward(s); });
  p.all([](Backend& b, const Step& s) { b.route(s); });
  ASSERT_EQ(p.gpu.status(0).code, static_cast<int32_t>(StatusCode::capacity_overflow));
  for (int r = 0; r < sh.R; ++r) {
    const std::vector<bf16_t> rows = rng.bf16s(sh.cap() * sh.D);
    p.cpu.fill(p.cpu.step(r).rows_MD, rows);
    p.gpu.fill(p.gpu.step(r).rows_MD, rows);
  }
  p.all([](Backend& b, const Step& s) { b.dispatch(s); });
  p.all([](Backend& b, const Step& s) { b.swiglu_forward(s); });
  p.all([](Backend& b, const Step& s) { b.scatter_rows(s); });
  p.all([](Backend& b, const Step& s) { b.reduce_forward(s); });
  p.all([](Backend& b, const Step& s) { b.publish_backward(s); });
  p.all([](Backend& b, const Step& s) { b.grad_scores(s); });
  p.all([](Backend& b, const Step& s) { b.gather_grad(s); });
  p.all([](Backend& b, const Step& s) { b.swiglu_backward(s); });
  p.all([](Backend& b, const Step& s) { b.reduce_backward(s); });
  const int64_t TD = sh.T * sh.D, TKD = sh.T * sh.K * sh.D, capD = sh.cap() * sh.D;
  for (int r = 0; r < sh.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Step s = p.gpu.step(r);
    EXPECT_TRUE(same_bits(std::vector<bf16_t>(static_cast<size_t>(TD), 0), p.gpu.read<bf16_t>(s.y_TD, TD)));
    EXPECT_TRUE(same_bits(std::vector<bf16_t>(static_cast<size_t>(TD), 0), p.gpu.read<bf16_t>(s.grad_x_TD, TD)));
    EXPECT_TRUE(same_bits(std::vector<float>(static_cast<size_t>(sh.T * sh.K), 0.0f),
                          p.gpu.read<float>(s.grad_scores_TK, sh.T * sh.K)));
    const std::vector<bf16_t> zeros_cap(static_cast<size_t>(capD), 0);
    EXPECT_TRUE(same_bits(zeros_cap, p.gpu.read<bf16_t>(s.x_gathered_MD, capD))) << "dispatch wrote";
    EXPECT_TRUE(same_bits(zeros_cap, p.gpu.read<bf16_t>(s.grad_h3_MD, capD))) << "gather_grad wrote";
    EXPECT_TRUE(same_bits(std::vector<bf16_t>(static_cast<size_t>(sh.cap() * sh.F), 0),
                          p.gpu.read<bf16_t>(s.h_MF, sh.cap() * sh.F))) << "swiglu wrote";
    EXPECT_TRUE(same_bits(std::vector<bf16_t>(static_cast<size_t>(TKD), 0), p.gpu.read<bf16_t>(p.gpu.combine(r), TKD)))
        << "scatter wrote";
    EXPECT_TRUE(same_bits(std::vector<bf16_t>(static_cast<size_t>(TKD), 0), p.gpu.read<bf16_t>(s.h3_TKD, TKD)))
        << "reduce copied h3";
    EXPECT_TRUE(same_bits(std::vector<Status>{p.cpu.status(r)}, std::vector<Status>{p.gpu.status(r)}));
  }
}

}  // namespace
}  // namespace epmoe::test
