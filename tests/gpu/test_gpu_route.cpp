// route on the GPU: R simulated ranks publish into routing buffers in device memory; every rank's
// route must reproduce build_layout_reference() bitwise and agree with the CPU backend on the
// layout header, the skip flag and the status word (input errors, T' mismatch, capacity). Every
// case runs on the chunked launches and, where the shape allows it, on the one-CTA route.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "cuda/route.h"
#include "epmoe/error.h"
#include "scoped_env.h"
#include "step_builder.h"

namespace epmoe::test {
namespace {

// One rank's layout read back to the host; recv_src up to min(M, capacity) rows.
struct HostLayout {
  std::vector<int32_t> header, offsets, recv_rows, recv_src, route_row;
  std::vector<int32_t> pull_src, pull_rows;  // min(P, pull capacity) pulls
};

int64_t pulls_held(const std::vector<int32_t>& header, const Shape& sh) {
  const int64_t P = std::max<int32_t>(header[kLayoutPulls], 0);
  return std::min<int64_t>(P, pull_capacity(sh.cap(), sh.T, sh.R));
}

HostLayout read_layout(World& w, int r) {
  const Step s = w.step(r);
  const Shape& sh = w.shape();
  HostLayout l;
  l.header = w.read<int32_t>(s.layout.header, kLayoutHeaderInts);
  l.offsets = w.read<int32_t>(s.layout.expert_offsets_E1, sh.E + 1);
  l.recv_rows = w.read<int32_t>(s.layout.recv_rows_R, sh.R);
  const int64_t M = std::min<int64_t>(std::max<int32_t>(l.header[kLayoutRows], 0), sh.cap());
  l.recv_src = w.read<int32_t>(s.layout.recv_src_M, M);
  l.route_row = w.read<int32_t>(s.layout.route_row_TK, sh.T * sh.K);
  const int64_t P = pulls_held(l.header, sh);
  l.pull_src = w.read<int32_t>(s.layout.pull_src_P, P);
  l.pull_rows = w.read<int32_t>(s.layout.pull_rows_PK, P * sh.K);
  return l;
}

// The published ids [T, K] of every rank, read from the world.
std::vector<std::vector<int32_t>> published_ids(World& w) {
  const Shape& sh = w.shape();
  const int64_t off = routing_buffer_layout(sh.T, sh.K).ids_offset;
  std::vector<std::vector<int32_t>> ids;
  for (int r = 0; r < sh.R; ++r) ids.push_back(w.read<int32_t>(w.routing(r) + off, sh.T * sh.K));
  return ids;
}

// build_layout_reference for receiver `self` on host copies of the published ids.
HostLayout reference_layout(const Shape& sh, const std::vector<std::vector<int32_t>>& ids, int self,
                            int64_t* rows_out = nullptr) {
  std::vector<int32_t> storage(
      static_cast<size_t>(layout_bytes(sh.cap(), sh.T, sh.K, sh.E, sh.R).total / 4), 0);
  const LayoutView v = carve_layout(storage.data(), sh.cap(), sh.T, sh.K, sh.E, sh.R);
  std::vector<const int32_t*> ids_R;
  for (const auto& i : ids) ids_R.push_back(i.data());
  const int64_t M = build_layout_reference(ids_R.data(), sh.T, sh.K, sh.E, sh.R, self, sh.cap(), v);
  if (rows_out != nullptr) *rows_out = M;
  HostLayout l;
  l.header.assign(v.header, v.header + kLayoutHeaderInts);
  l.offsets.assign(v.expert_offsets_E1, v.expert_offsets_E1 + sh.E + 1);
  l.recv_rows.assign(v.recv_rows_R, v.recv_rows_R + sh.R);
  l.recv_src.assign(v.recv_src_M, v.recv_src_M + std::min(M, sh.cap()));
  l.route_row.assign(v.route_row_TK, v.route_row_TK + sh.T * sh.K);
  const int64_t P = pulls_held(l.header, sh);
  l.pull_src.assign(v.pull_src_P, v.pull_src_P + P);
  l.pull_rows.assign(v.pull_rows_PK, v.pull_rows_PK + P * sh.K);
  return l;
}

void expect_same_layout(const HostLayout& want, const HostLayout& got, bool full_header) {
  if (full_header) {
    EXPECT_TRUE(same_bits(want.header, got.header)) << "layout header";
  } else {
    EXPECT_EQ(want.header[kLayoutRows], got.header[kLayoutRows]) << "header rows";
    EXPECT_EQ(want.header[kLayoutMaxRows], got.header[kLayoutMaxRows]) << "header max rows";
    EXPECT_EQ(want.header[kLayoutPulls], got.header[kLayoutPulls]) << "header pulls";
  }
  EXPECT_TRUE(same_bits(want.offsets, got.offsets)) << "expert_offsets_E1";
  EXPECT_TRUE(same_bits(want.recv_rows, got.recv_rows)) << "recv_rows_R";
  EXPECT_TRUE(same_bits(want.recv_src, got.recv_src)) << "recv_src_M";
  EXPECT_TRUE(same_bits(want.route_row, got.route_row)) << "route_row_TK";
  EXPECT_TRUE(same_bits(want.pull_src, got.pull_src)) << "pull_src_P";
  EXPECT_TRUE(same_bits(want.pull_rows, got.pull_rows)) << "pull_rows_PK";
}

// The route kernel choices that apply to the shape: chunked always, single where
// select_route_kernels takes it unforced.
std::vector<const char*> route_kernels_for(const Shape& sh) {
  std::vector<const char*> kernels{"chunked"};
  ScopedEnv unset("EPMOE_ROUTE_KERNELS", nullptr);
  if (cuda::select_route_kernels(sh.dims()) == cuda::RouteKernels::single) kernels.push_back("single");
  return kernels;
}

// f() once per route kernel choice of the shape, with EPMOE_ROUTE_KERNELS set for it.
template <class F>
void for_each_route_kernels(const Shape& sh, F&& f) {
  for (const char* k : route_kernels_for(sh)) {
    SCOPED_TRACE(std::string("EPMOE_ROUTE_KERNELS=") + k);
    ScopedEnv env("EPMOE_ROUTE_KERNELS", k);
    f();
  }
}

void publish_and_route(Pair& p) {
  p.all([](Backend& b, const Step& s) { b.publish_forward(s); });
  p.all([](Backend& b, const Step& s) { b.route(s); });
}

struct RouteCase {
  std::string name;
  Shape shape;
  Pattern pattern;
  int64_t tokens_minus = 0;           // T' = T - tokens_minus on every rank
  std::optional<int32_t> live_rank1;  // live count of rank 1 (others: all live)
};
RouteCase route_case(std::string name, const Shape& shape, Pattern pattern, int64_t tokens_minus = 0,
                     std::optional<int32_t> live_rank1 = std::nullopt) {
  return RouteCase{std::move(name), shape, pattern, tokens_minus, live_rank1};
}

void run_route_case_once(const RouteCase& c, uint32_t seed) {
  Pair p(c.shape);
  Rng rng(seed);
  const int64_t tokens = c.shape.T - c.tokens_minus;
  for (int r = 0; r < c.shape.R; ++r) {
    const std::optional<int32_t> live = r == 1 ? c.live_rank1 : std::nullopt;
    p.set_input(r, make_input(rng, c.shape, r, tokens, live, c.pattern));
  }
  publish_and_route(p);
  const auto ids_gpu = published_ids(p.gpu);
  EXPECT_EQ(ids_gpu, published_ids(p.cpu)) << "published ids";
  for (int self = 0; self < c.shape.R; ++self) {
    SCOPED_TRACE("self = " + std::to_string(self));
    const HostLayout want = reference_layout(c.shape, ids_gpu, self);
    const HostLayout gpu = read_layout(p.gpu, self);
    const HostLayout cpu = read_layout(p.cpu, self);
    expect_same_layout(want, gpu, false);
    expect_same_layout(cpu, gpu, true);
    EXPECT_EQ(gpu.header[kLayoutSkip], 0);
    EXPECT_EQ(gpu.header[kLayoutTokens], tokens);
    EXPECT_TRUE(same_bits(std::vector<Status>{p.cpu.status(self)},
                          std::vector<Status>{p.gpu.status(self)}));
    EXPECT_EQ(p.gpu.status(self).code, 0) << p.gpu.status(self).to_string();
  }
}

void run_route_case(const RouteCase& c, uint32_t seed) {
  SCOPED_TRACE(c.name);
  for_each_route_kernels(c.shape, [&] { run_route_case_once(c, seed); });
}

TEST(GpuRoute, MatchesReferenceBuilder) {
  EPMOE_REQUIRE_GPU();
  const std::vector<RouteCase> cases = {
      route_case("T=1 K=1 E=1 R=1", {1, 8, 8, 1, 1, 1, 0}, Pattern::duplicates),
      route_case("T=19 K=2 E=3 R=1", {19, 8, 8, 2, 3, 1, 0}, Pattern::distinct),
      route_case("T=19 K=4 E=5 R=3, T'=17, rank 1 live 11", {19, 8, 8, 4, 5, 3, 0}, Pattern::distinct, 2, 11),
      route_case("two chunks: T=1000 K=4 E=8 R=2", {1000, 8, 8, 4, 8, 2, 0}, Pattern::distinct, 0, 999),
      route_case("chunk edge: T*K = 2048", {512, 8, 8, 4, 4, 2, 0}, Pattern::duplicates),
      route_case("chunk edge: T*K = 2049", {2049, 8, 8, 1, 3, 2, 0}, Pattern::distinct),
      route_case("E*R = 256, 16 chunks", {4096, 8, 8, 8, 32, 8, 4096 * 8 * 2}, Pattern::distinct),
      route_case("E*R = 4096 (route limit)", {64, 8, 8, 8, 512, 8, 0}, Pattern::distinct),
      route_case("all routes to one expert", {300, 8, 8, 2, 4, 2, 0}, Pattern::one_expert),
      route_case("zero-token experts", {200, 8, 8, 3, 6, 2, 0}, Pattern::sparse, 0, 0),
      route_case("every route inactive", {33, 8, 8, 2, 2, 2, 0}, Pattern::inactive),
      // Duplicates can send all K routes of a token to one rank: capacity T*R*K.
      route_case("duplicates, K > E", {77, 8, 8, 6, 2, 3, 77 * 3 * 6}, Pattern::duplicates, 5, 40),
      // Decode sizes (the one-CTA route): qwen3-like, deepseek-like at EP = 2, its E*R limit.
      route_case("decode: T=128 K=8 E=128 R=1", {128, 8, 8, 8, 128, 1, 0}, Pattern::distinct, 3, 100),
      route_case("decode: T=128 K=8 E=128 R=2", {128, 8, 8, 8, 128, 2, 0}, Pattern::distinct),
      route_case("single limits: T=256 K=8 E=256 R=2", {256, 8, 8, 8, 256, 2, 0}, Pattern::duplicates),
      route_case("single limits: T=1024 K=2 E=4 R=2", {1024, 8, 8, 2, 4, 2, 0}, Pattern::sparse, 1, 1000),
  };
  uint32_t seed = 1;
  for (const RouteCase& c : cases) run_route_case(c, seed++);
}

// A status word's code, rank, argument and the required / available values (and the index where
// one is given).
void expect_status(const Status& st, StatusCode code, int rank, StatusArg arg, int64_t required,
                   int64_t available, std::optional<int64_t> index = std::nullopt) {
  EXPECT_EQ(st.code, static_cast<int32_t>(code));
  EXPECT_EQ(st.rank, rank);
  EXPECT_EQ(st.arg, static_cast<int32_t>(arg));
  EXPECT_EQ(st.required, required);
  EXPECT_EQ(st.available, available);
  if (index) {
    EXPECT_EQ(st.index, *index);
  }
}

// Runs route on every rank and expects the same status (and the skip flag) on all of them, on
// both backends; returns it.
Status expect_consistent_failure(Pair& p) {
  const Status first = p.gpu.status(0);
  for (int r = 0; r < p.gpu.shape().R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(same_bits(std::vector<Status>{p.cpu.status(r)}, std::vector<Status>{p.gpu.status(r)}));
    EXPECT_TRUE(same_bits(std::vector<Status>{first}, std::vector<Status>{p.gpu.status(r)}));
    EXPECT_EQ(p.gpu.layout_header(r)[kLayoutSkip], 1);
    EXPECT_TRUE(same_bits(p.cpu.layout_header(r), p.gpu.layout_header(r))) << "layout header";
  }
  return first;
}

TEST(GpuRoute, TokenCountMismatchAgainstRankZero) {
  EPMOE_REQUIRE_GPU();
  const Shape sh{19, 8, 8, 2, 3, 3, 0};
  for_each_route_kernels(sh, [&] {
    Pair p(sh);
    Rng rng(7);
    p.set_input(0, make_input(rng, sh, 0, 19, std::nullopt, Pattern::distinct));
    p.set_input(1, make_input(rng, sh, 1, 19, std::nullopt, Pattern::distinct));
    p.set_input(2, make_input(rng, sh, 2, 18, std::nullopt, Pattern::distinct));
    publish_and_route(p);
    expect_status(expect_consistent_failure(p), StatusCode::token_count_mismatch, 2, StatusArg::x_TD, 18, 19);
    EXPECT_EQ(p.gpu.layout_header(2)[kLayoutRows], 0);
  });
}

TEST(GpuRoute, FirstRankWithAnInputErrorWins) {
  EPMOE_REQUIRE_GPU();
  const Shape sh{19, 8, 8, 2, 3, 4, 0};
  for_each_route_kernels(sh, [&] {
    Pair p(sh);
    Rng rng(8);
    std::vector<RankInput> in;
    for (int r = 0; r < 4; ++r) in.push_back(make_input(rng, sh, r, 19, std::nullopt, Pattern::distinct));
    in[3].ids[5] = sh.experts();  // out of range on rank 3
    in[1].live = 20;              // live > T' on rank 1: reported, as the lower rank
    in[2].scores[0] = NAN;
    in[2].ids[0] = 0;             // active route with a NaN score on rank 2
    for (int r = 0; r < 4; ++r) p.set_input(r, in[static_cast<size_t>(r)]);
    publish_and_route(p);
    expect_status(expect_consistent_failure(p), StatusCode::token_count_mismatch, 1, StatusArg::num_tokens_1,
                  20, 19, 0);
  });
}

TEST(GpuRoute, CapacityOverflowIsReportedByEveryRank) {
  EPMOE_REQUIRE_GPU();
  // Rank 1 owns the busy expert: every route of both ranks goes to global expert E*R/2 = 2.
  Shape sh{40, 8, 8, 2, 2, 2, 0};
  sh.capacity = 100;  // receiver 1 needs 2 * 40 * 2 = 160 rows
  for_each_route_kernels(sh, [&] {
    Pair p(sh);
    Rng rng(9);
    for (int r = 0; r < 2; ++r) p.set_input(r, make_input(rng, sh, r, 40, std::nullopt, Pattern::one_expert));
    publish_and_route(p);
    expect_status(expect_consistent_failure(p), StatusCode::capacity_overflow, 1, StatusArg::topk_ids_TK, 160,
                  100);
    // The layout is still built (recv_src up to the capacity), as by the reference builder.
    const auto ids = published_ids(p.gpu);
    for (int self = 0; self < 2; ++self) {
      const HostLayout want = reference_layout(sh, ids, self);
      expect_same_layout(want, read_layout(p.gpu, self), false);
    }
    EXPECT_EQ(p.gpu.layout_header(1)[kLayoutRows], 160);
    EXPECT_EQ(p.gpu.layout_header(0)[kLayoutMaxRows], 160);
  });
}

TEST(GpuRoute, AnEarlierStatusIsKept) {
  EPMOE_REQUIRE_GPU();
  Shape sh{40, 8, 8, 2, 2, 1, 0};
  sh.capacity = 10;
  for_each_route_kernels(sh, [&] {
    Pair p(sh);
    Rng rng(10);
    p.set_input(0, make_input(rng, sh, 0, 40, std::nullopt, Pattern::duplicates));
    Status earlier;
    earlier.code = static_cast<int32_t>(StatusCode::slot_overflow);
    earlier.rank = 0;
    earlier.required = 123;
    earlier.available = 45;
    p.cpu.set_status(0, earlier);
    p.gpu.set_status(0, earlier);
    publish_and_route(p);
    EXPECT_TRUE(same_bits(std::vector<Status>{earlier}, std::vector<Status>{p.gpu.status(0)}));
    EXPECT_EQ(p.gpu.layout_header(0)[kLayoutSkip], 1) << "the step is skipped all the same";
    EXPECT_TRUE(same_bits(p.cpu.layout_header(0), p.gpu.layout_header(0)));
  });
}

void repeated_routes(const Shape& sh) {
  Pair p(sh);
  Rng rng(11);
  // Call 1: an invalid id on rank 0 skips the step.
  std::vector<RankInput> in;
  for (int r = 0; r < 2; ++r) in.push_back(make_input(rng, sh, r, sh.T, std::nullopt, Pattern::duplicates));
  RankInput bad = in[0];
  bad.ids[17] = -5;
  p.set_input(0, bad);
  p.set_input(1, in[1]);
  publish_and_route(p);
  EXPECT_EQ(p.gpu.layout_header(0)[kLayoutSkip], 1);
  EXPECT_EQ(p.gpu.status(0).index, 17);
  EXPECT_EQ(p.gpu.status(0).required, -5);
  // Call 2: good inputs; the status is cleared by the host (as Context::check does).
  p.cpu.set_status(0, Status{});
  p.gpu.set_status(0, Status{});
  p.cpu.set_status(1, Status{});
  p.gpu.set_status(1, Status{});
  p.set_input(0, in[0]);
  publish_and_route(p);
  const HostLayout first = read_layout(p.gpu, 0);
  EXPECT_EQ(first.header[kLayoutSkip], 0);
  EXPECT_TRUE(same_bits(read_layout(p.cpu, 0).header, first.header));
  for (int again = 0; again < 3; ++again) {
    publish_and_route(p);
    const HostLayout l = read_layout(p.gpu, 0);
    EXPECT_TRUE(same_bits(first.recv_src, l.recv_src));
    EXPECT_TRUE(same_bits(first.route_row, l.route_row));
  }
}

TEST(GpuRoute, RepeatedRoutesAreDeterministicAndClearTheSkipFlag) {
  EPMOE_REQUIRE_GPU();
  for (const Shape sh : {Shape{1500, 8, 8, 4, 16, 2, 0}, Shape{200, 8, 8, 4, 16, 2, 0}}) {
    SCOPED_TRACE("T = " + std::to_string(sh.T));
    for_each_route_kernels(sh, [&] { repeated_routes(sh); });
  }
}

// The choice itself (no GPU needed): one CTA exactly where every source's routes fit one chunk,
// its tokens one pull chunk, and E * R and the scratch the one-CTA route's shared memory; forcing
// it elsewhere is an error that names the switch.
TEST(GpuRoute, SingleKernelWhereEverySourceFitsOneChunk) {
  ScopedEnv unset("EPMOE_ROUTE_KERNELS", nullptr);
  auto choice = [](int64_t T, int K, int E, int R) {
    return cuda::select_route_kernels(Dims{T, 8, 8, K, E, R});
  };
  EXPECT_EQ(choice(128, 8, 128, 1), cuda::RouteKernels::single);   // qwen3 decode
  EXPECT_EQ(choice(128, 8, 256, 1), cuda::RouteKernels::single);   // deepseek-v3 decode
  EXPECT_EQ(choice(256, 8, 256, 2), cuda::RouteKernels::single);   // T * K = 2048, E * R = 512
  EXPECT_EQ(choice(257, 8, 8, 1), cuda::RouteKernels::chunked);    // T * K > 2048
  EXPECT_EQ(choice(1025, 1, 8, 1), cuda::RouteKernels::chunked);   // T > 1024
  EXPECT_EQ(choice(128, 8, 256, 4), cuda::RouteKernels::chunked);  // E * R > 512
  // 64 sources' ids alone, 64 x 2048 ints, pass the one-CTA route's 200 KiB of shared memory.
  EXPECT_EQ(choice(256, 8, 1, 64), cuda::RouteKernels::chunked);
  EXPECT_EQ(choice(256, 8, 1, 8), cuda::RouteKernels::single);     // 8 x 2048 ints
  EXPECT_EQ(choice(8192, 8, 128, 1), cuda::RouteKernels::chunked);
  {
    ScopedEnv force("EPMOE_ROUTE_KERNELS", "chunked");
    EXPECT_EQ(choice(128, 8, 128, 1), cuda::RouteKernels::chunked);
  }
  ScopedEnv force("EPMOE_ROUTE_KERNELS", "single");
  EXPECT_THROW(choice(8192, 8, 128, 1), epmoe::Error);
  ScopedEnv bad("EPMOE_ROUTE_KERNELS", "fused");
  EXPECT_THROW(choice(128, 8, 128, 1), epmoe::Error);
}

}  // namespace
}  // namespace epmoe::test
