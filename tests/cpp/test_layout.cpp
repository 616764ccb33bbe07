// Routing layout: build_layout_reference on hand-worked cases and random invariants, and the CPU
// publish -> route -> dispatch stages moving rank-coded rows into the expert-grouped order.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "core/backend.h"
#include "core/layout.h"
#include "core/plan_terms.h"
#include "core/step.h"

namespace epmoe {
namespace {

// A layout with room for `capacity` rows, in its own aligned memory.
struct LayoutBuffer {
  LayoutBuffer(int64_t capacity, int64_t T, int K, int E, int R)
      : storage(static_cast<size_t>(layout_bytes(capacity, T, K, E, R).total) / 4 + 32, -7) {
    view = carve_layout(storage.data(), capacity, T, K, E, R);
  }
  std::vector<int32_t> storage;  // -7: "never written"
  LayoutView view;
};

int32_t enc(int rank, int64_t t, int k, int64_t T, int K) { return encode_src(rank, t, k, T, K); }

// R = 2 ranks, E = 2 local experts (4 global), T = 3, K = 2; worked by hand:
//   rank 0: t0 [1, 2]  t1 [0, 1]  t2 [3, -1]
//   rank 1: t0 [2, 3]  t1 [1, 1]  t2 [-1, 0]        (t1 picks expert 1 twice)
// receiver 0 (experts 0, 1): e0: (s0 t1 k0) (s1 t2 k1) | e1: (s0 t0 k0) (s0 t1 k1) (s1 t1 k0)
//                            (s1 t1 k1)                 -> M = 6, offsets [0, 2, 6]
// receiver 1 (experts 2, 3): e2: (s0 t0 k1) (s1 t0 k0) | e3: (s0 t2 k0) (s1 t0 k1)
//                                                       -> M = 4, offsets [0, 2, 4]
const std::vector<int32_t> kIds0 = {1, 2, 0, 1, 3, -1};
const std::vector<int32_t> kIds1 = {2, 3, 1, 1, -1, 0};

TEST(Layout, HandWorkedTwoRanks) {
  const int64_t T = 3;
  const int K = 2, E = 2, R = 2;
  const int32_t* ids[2] = {kIds0.data(), kIds1.data()};

  LayoutBuffer l0(8, T, K, E, R);
  EXPECT_EQ(build_layout_reference(ids, T, K, E, R, 0, 8, l0.view), 6);
  EXPECT_EQ(l0.view.header[kLayoutRows], 6);
  EXPECT_EQ(l0.view.header[kLayoutMaxRows], 6);
  EXPECT_EQ(std::vector<int32_t>(l0.view.expert_offsets_E1, l0.view.expert_offsets_E1 + 3),
            (std::vector<int32_t>{0, 2, 6}));
  EXPECT_EQ(std::vector<int32_t>(l0.view.recv_rows_R, l0.view.recv_rows_R + 2),
            (std::vector<int32_t>{6, 4}));
  EXPECT_EQ(std::vector<int32_t>(l0.view.recv_src_M, l0.view.recv_src_M + 6),
            (std::vector<int32_t>{enc(0, 1, 0, T, K), enc(1, 2, 1, T, K), enc(0, 0, 0, T, K),
                                  enc(0, 1, 1, T, K), enc(1, 1, 0, T, K), enc(1, 1, 1, T, K)}));
  // Rank 0's routes: row in their receiver (t0k1 -> receiver 1 row 0; t2k0 -> receiver 1 row 2).
  EXPECT_EQ(std::vector<int32_t>(l0.view.route_row_TK, l0.view.route_row_TK + 6),
            (std::vector<int32_t>{2, 0, 0, 3, 2, -1}));
  EXPECT_EQ(l0.view.recv_src_M[6], -7) << "rows past M must not be written";

  LayoutBuffer l1(8, T, K, E, R);
  EXPECT_EQ(build_layout_reference(ids, T, K, E, R, 1, 8, l1.view), 4);
  EXPECT_EQ(l1.view.header[kLayoutRows], 4);
  EXPECT_EQ(l1.view.header[kLayoutMaxRows], 6);
  EXPECT_EQ(std::vector<int32_t>(l1.view.expert_offsets_E1, l1.view.expert_offsets_E1 + 3),
            (std::vector<int32_t>{0, 2, 4}));
  EXPECT_EQ(std::vector<int32_t>(l1.view.recv_src_M, l1.view.recv_src_M + 4),
            (std::vector<int32_t>{enc(0, 0, 1, T, K), enc(1, 0, 0, T, K), enc(0, 2, 0, T, K),
                                  enc(1, 0, 1, T, K)}));
  EXPECT_EQ(std::vector<int32_t>(l1.view.route_row_TK, l1.view.route_row_TK + 6),
            (std::vector<int32_t>{1, 3, 4, 5, -1, 1}));
}

TEST(Layout, CapacityBoundsTheRowsWritten) {
  const int64_t T = 3;
  const int K = 2, E = 2, R = 2;
  const int32_t* ids[2] = {kIds0.data(), kIds1.data()};
  LayoutBuffer l0(4, T, K, E, R);
  // Receiver 0 needs 6 rows; only 4 fit. M is still reported in full, nothing past row 4 written.
  EXPECT_EQ(build_layout_reference(ids, T, K, E, R, 0, 4, l0.view), 6);
  EXPECT_EQ(l0.view.header[kLayoutRows], 6);
  EXPECT_EQ(l0.view.recv_src_M[3], enc(0, 1, 1, T, K));
  EXPECT_EQ(l0.view.recv_src_M[4], -7);
  EXPECT_EQ(l0.view.recv_src_M[5], -7);
}

TEST(Layout, NoActiveRoutes) {
  const int64_t T = 2;
  const int K = 2, E = 3, R = 2;
  const std::vector<int32_t> none(T * K, -1);
  const int32_t* ids[2] = {none.data(), none.data()};
  LayoutBuffer l(4, T, K, E, R);
  EXPECT_EQ(build_layout_reference(ids, T, K, E, R, 1, 4, l.view), 0);
  for (int e = 0; e <= E; ++e) EXPECT_EQ(l.view.expert_offsets_E1[e], 0);
  for (int i = 0; i < T * K; ++i) EXPECT_EQ(l.view.route_row_TK[i], -1);
  EXPECT_EQ(l.view.header[kLayoutMaxRows], 0);
}

// Random ids (with -1 and duplicates): every route lands exactly once, in expert-major /
// source-rank / token / k order, and route_row_TK points at the matching recv_src_M entry.
TEST(Layout, RandomRoutingInvariants) {
  for (auto [R, E, T, K] :
       {std::tuple{3, 2, 7, 3}, std::tuple{4, 1, 5, 2}, std::tuple{1, 5, 9, 4}}) {
    std::mt19937 rng(static_cast<unsigned>(R * 100 + T));
    std::uniform_int_distribution<int> id(-1, E * R - 1);
    std::vector<std::vector<int32_t>> ids(R, std::vector<int32_t>(T * K));
    std::vector<const int32_t*> ptrs(R);
    for (int s = 0; s < R; ++s) {
      for (auto& v : ids[s]) v = id(rng);
      ptrs[s] = ids[s].data();
    }
    const int64_t cap = static_cast<int64_t>(R) * T * K;
    std::vector<std::unique_ptr<LayoutBuffer>> layouts;
    for (int q = 0; q < R; ++q) {
      layouts.push_back(std::make_unique<LayoutBuffer>(cap, T, K, E, R));
      build_layout_reference(ptrs.data(), T, K, E, R, q, cap, layouts[q]->view);
    }
    int64_t active = 0;
    for (int s = 0; s < R; ++s)
      active += std::count_if(ids[s].begin(), ids[s].end(), [](int32_t v) { return v >= 0; });
    int64_t total = 0;
    for (int q = 0; q < R; ++q) {
      const LayoutView& v = layouts[q]->view;
      const int64_t M = v.header[kLayoutRows];
      total += M;
      EXPECT_EQ(v.recv_rows_R[q], M);
      EXPECT_EQ(v.expert_offsets_E1[0], 0);
      EXPECT_EQ(v.expert_offsets_E1[E], M);
      for (int e = 0; e < E; ++e) {
        EXPECT_LE(v.expert_offsets_E1[e], v.expert_offsets_E1[e + 1]);
        for (int64_t m = v.expert_offsets_E1[e]; m < v.expert_offsets_E1[e + 1]; ++m) {
          const int32_t src = v.recv_src_M[m];
          const int s = src_rank(src, T, K);
          const int64_t slot = src_slot(src, T, K);
          EXPECT_EQ(ids[s][slot], q * E + e) << "row " << m << " of receiver " << q;
          EXPECT_EQ(layouts[s]->view.route_row_TK[slot], m);
          if (m > v.expert_offsets_E1[e]) {
            EXPECT_LT(v.recv_src_M[m - 1], src) << "row order within expert " << e;
          }
        }
      }
      // Pulls: strictly increasing (s, t), each row m < M in exactly one pull at the slot of its
      // route k, and P = distinct (s, t) with a route here (<= M).
      const int64_t P = v.header[kLayoutPulls];
      std::vector<int> seen(static_cast<size_t>(M), 0);
      int64_t distinct = 0;
      for (int s = 0; s < R; ++s) {
        for (int64_t t = 0; t < T; ++t) {
          bool here = false;
          for (int k = 0; k < K; ++k) here = here || (ids[s][t * K + k] >= 0 && ids[s][t * K + k] / E == q);
          distinct += here ? 1 : 0;
        }
      }
      EXPECT_EQ(P, distinct) << "receiver " << q;
      EXPECT_LE(P, M);
      for (int64_t p = 0; p < P; ++p) {
        const int32_t src = v.pull_src_P[p];
        if (p > 0) {
          EXPECT_LT(v.pull_src_P[p - 1], src) << "pull order";
        }
        int rows = 0;
        for (int k = 0; k < K; ++k) {
          const int32_t m = v.pull_rows_PK[p * K + k];
          if (m < 0) continue;
          ++rows;
          ASSERT_LT(m, M);
          ++seen[static_cast<size_t>(m)];
          EXPECT_EQ(v.recv_src_M[m], encode_src(src / static_cast<int32_t>(T), src % T, k, T, K));
        }
        EXPECT_GE(rows, 1) << "a pull feeds at least one row";
      }
      for (int64_t m = 0; m < M; ++m) EXPECT_EQ(seen[static_cast<size_t>(m)], 1) << "row " << m;
    }
    EXPECT_EQ(total, active);
  }
}

// ---- CPU stages: publish -> route -> dispatch with rank-coded rows. Ranks run one after another:
// the stages of one rank are synchronous, so calling every rank's stage in turn is a barrier. ----

struct StageRig {
  StageRig(int R_, int E_, int64_t T_, int K_, int64_t D_, int64_t capacity)
      : backend(make_cpu_backend()), R(R_) {
    dims = Dims{T_, D_, 8, K_, E_, R_};
    routing.resize(R);
    dispatch.resize(R);
    combine.resize(R);
    for (int r = 0; r < R; ++r) {
      routing[r] = static_cast<char*>(backend->allocate(routing_buffer_layout(T_, K_).bytes));
      dispatch[r] = static_cast<bf16_t*>(backend->allocate(T_ * D_ * 2));
      combine[r] = static_cast<bf16_t*>(backend->allocate(T_ * K_ * D_ * 2));
    }
    for (int r = 0; r < R; ++r) {
      auto& st = steps.emplace_back();
      st.dims = dims;
      st.tokens = T_;
      st.rank = r;
      st.capacity_rows = capacity;
      st.routing_R = routing.data();
      st.dispatch_R = dispatch.data();
      st.combine_R = combine.data();
      layout_mem.push_back(backend->allocate(layout_bytes(capacity, T_, K_, E_, R_).total));
      st.layout = carve_layout(layout_mem.back(), capacity, T_, K_, E_, R_);
      st.x_gathered_MD = static_cast<bf16_t*>(backend->allocate(capacity * D_ * 2));
      st.route_scratch = static_cast<char*>(backend->allocate(route_scratch_layout(dims, capacity).total));
      st.status = static_cast<Status*>(backend->allocate(sizeof(Status)));
    }
  }
  ~StageRig() {
    for (int r = 0; r < R; ++r) {
      backend->release(routing[r]);
      backend->release(dispatch[r]);
      backend->release(combine[r]);
      backend->release(layout_mem[r]);
      backend->release(steps[r].x_gathered_MD);
      backend->release(steps[r].route_scratch);
      backend->release(steps[r].status);
    }
  }
  void publish_route_dispatch() {
    for (auto& s : steps) backend->publish_forward(s);
    for (auto& s : steps) backend->route(s);
    for (auto& s : steps) backend->dispatch(s);
  }

  std::unique_ptr<Backend> backend;
  int R;
  Dims dims;
  std::vector<char*> routing;
  std::vector<bf16_t*> dispatch, combine;
  std::vector<void*> layout_mem;
  std::vector<Step> steps;
};

// Column d of x row t on rank r: 64*r + t (+ 0.5 in odd columns), exact in bf16 for r < 2 and
// t < 64, so a received row tells which (rank, token) it came from.
bf16_t code(int r, int64_t t, int64_t d) {
  return float_to_bf16(static_cast<float>(64 * r + t) + static_cast<float>(d % 2) * 0.5f);
}

TEST(LayoutStages, RankCodedRowsArriveInLayoutOrder) {
  const int R = 2, E = 2, K = 2;
  const int64_t T = 3, D = 5;
  StageRig rig(R, E, T, K, D, /*capacity=*/12);
  const std::vector<int64_t> ids64_0(kIds0.begin(), kIds0.end());  // rank 0 passes int64 ids
  std::vector<std::vector<bf16_t>> x(R, std::vector<bf16_t>(T * D));
  std::vector<float> scores(T * K, 0.5f);
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t d = 0; d < D; ++d) x[r][t * D + d] = code(r, t, d);
    }
    Step& s = rig.steps[r];
    s.x_TD = x[r].data();
    s.ids_TK = r == 0 ? static_cast<const void*>(ids64_0.data()) : kIds1.data();
    s.ids_dtype = r == 0 ? DType::i64 : DType::i32;
    s.scores_TK = scores.data();
    s.arrival_gated_w13 = r == 0;  // rank 0 counts arrivals for a gated W13, rank 1 does not
  }
  rig.publish_route_dispatch();

  // Receiver 0 gets (s0 t1) (s1 t2) | (s0 t0) (s0 t1) (s1 t1) (s1 t1); receiver 1
  // (s0 t0) (s1 t0) | (s0 t2) (s1 t0): the hand-worked order above.
  const std::vector<std::vector<std::pair<int, int64_t>>> expected = {
      {{0, 1}, {1, 2}, {0, 0}, {0, 1}, {1, 1}, {1, 1}}, {{0, 0}, {1, 0}, {0, 2}, {1, 0}}};
  for (int q = 0; q < R; ++q) {
    const Step& s = rig.steps[q];
    EXPECT_EQ(s.status->code, 0);
    EXPECT_EQ(s.layout.header[kLayoutSkip], 0);
    ASSERT_EQ(s.layout.header[kLayoutRows], static_cast<int32_t>(expected[q].size()));
    for (size_t m = 0; m < expected[q].size(); ++m) {
      for (int64_t d = 0; d < D; ++d) {
        EXPECT_EQ(s.x_gathered_MD[m * D + d], code(expected[q][m].first, expected[q][m].second, d))
            << "receiver " << q << " row " << m << " column " << d;
      }
    }
  }
  // One read per (source rank, token): receiver 0 pulls (s0 t0) -> {2}, (s0 t1) -> {0, 3},
  // (s1 t1) -> {4, 5}, (s1 t2) -> {1}: 4 reads for 6 routes; receiver 1 pulls (s0 t0) -> {0},
  // (s0 t2) -> {2}, (s1 t0) -> {1, 3}: 3 reads for 4 routes.
  const std::vector<std::vector<std::pair<int32_t, std::vector<int32_t>>>> pulls = {
      {{encode_pull(0, 0, T), {2}}, {encode_pull(0, 1, T), {0, 3}}, {encode_pull(1, 1, T), {4, 5}},
       {encode_pull(1, 2, T), {1}}},
      {{encode_pull(0, 0, T), {0}}, {encode_pull(0, 2, T), {2}}, {encode_pull(1, 0, T), {1, 3}}}};
  for (int q = 0; q < R; ++q) {
    const LayoutView& v = rig.steps[q].layout;
    ASSERT_EQ(v.header[kLayoutPulls], static_cast<int32_t>(pulls[q].size())) << "receiver " << q;
    uint32_t arrived = 0;
    for (size_t p = 0; p < pulls[q].size(); ++p) {
      EXPECT_EQ(v.pull_src_P[p], pulls[q][p].first) << "receiver " << q << " pull " << p;
      std::vector<int32_t> rows;
      for (int k = 0; k < K; ++k) {
        if (v.pull_rows_PK[p * K + k] >= 0) rows.push_back(v.pull_rows_PK[p * K + k]);
      }
      std::sort(rows.begin(), rows.end());
      EXPECT_EQ(rows, pulls[q][p].second) << "receiver " << q << " pull " << p;
    }
    arrived = arrivals_B(rig.steps[q])[0];  // one 128-row block: every received row counted once
    EXPECT_EQ(arrived, q == 0 ? expected[q].size() : 0u) << "receiver " << q;
  }
}

TEST(LayoutStages, PaddingRowsAndBadIdsArePublishedInactive) {
  // Rank 0 has 2 live rows of 3 and an out-of-range id in a live row: the bad id is published as
  // -1 (never used as an index) and reported; ids of the padding row are ignored entirely.
  const int R = 2, E = 1, K = 1;
  const int64_t T = 3, D = 2;
  StageRig rig(R, E, T, K, D, 6);
  const std::vector<int32_t> ids0 = {1, 9, 77}, ids1 = {0, 0, 1};
  const int32_t live0 = 2;
  std::vector<bf16_t> x(T * D, float_to_bf16(1.0f));
  std::vector<float> scores(T * K, 1.0f);
  for (int r = 0; r < R; ++r) {
    Step& s = rig.steps[r];
    s.x_TD = x.data();
    s.ids_TK = r == 0 ? ids0.data() : ids1.data();
    s.scores_TK = scores.data();
    s.check_inputs = true;
  }
  rig.steps[0].num_tokens_1 = &live0;
  rig.publish_route_dispatch();
  const auto* published =
      reinterpret_cast<const int32_t*>(rig.routing[0] + routing_buffer_layout(T, K).ids_offset);
  EXPECT_EQ(published[0], 1);
  EXPECT_EQ(published[1], -1);
  EXPECT_EQ(published[2], -1);
  for (int q = 0; q < R; ++q) {
    const Status& st = *rig.steps[q].status;
    EXPECT_EQ(st.code, static_cast<int32_t>(StatusCode::expert_id_out_of_range));
    EXPECT_EQ(st.rank, 0);
    EXPECT_EQ(st.arg, static_cast<int32_t>(StatusArg::topk_ids_TK));
    EXPECT_EQ(st.required, 9);
    EXPECT_EQ(st.available, 2);
    EXPECT_EQ(st.index, 1);
    EXPECT_EQ(rig.steps[q].layout.header[kLayoutSkip], 1);
  }
}

}  // namespace
}  // namespace epmoe
