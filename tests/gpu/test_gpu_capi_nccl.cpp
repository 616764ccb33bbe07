// The C ABI of the NCCL transport (include/epmoe/c_api_nccl.h), as a foreign-function binding
// drives it: one unique id, two contexts made through the C ABI in two threads (one per GPU), one
// forward + backward through epmoe_forward / epmoe_backward, checked against the float64
// reference. Argument errors run everywhere; the two-GPU test skips with "fewer than 2 CUDA
// devices: EP tests skipped" where fewer than 2 GPUs exist.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "device_call.h"
#include "epmoe/c_api.h"
#include "epmoe/c_api_nccl.h"
#include "epmoe/cuda.h"
#include "moe_case.h"

namespace epmoe::test {
namespace {

// NVLink multicast stays off (NCCL_NVLS_ENABLE=0) unless the caller chose otherwise.
const bool kNvlsOff = [] { return setenv("NCCL_NVLS_ENABLE", "0", 0) == 0; }();

constexpr int kRanks = 2;

bool names(const std::string& text) {
  return std::string(epmoe_last_error()).find(text) != std::string::npos;
}

TEST(CApiNccl, ArgumentErrorsNameTheArgument) {
  unsigned char id[EPMOE_NCCL_UNIQUE_ID_BYTES] = {};
  EXPECT_NE(epmoe_nccl_unique_id(id, 16), 0);
  EXPECT_TRUE(names("len")) << epmoe_last_error();
  EXPECT_NE(epmoe_nccl_unique_id(nullptr, sizeof(id)), 0);
  EXPECT_TRUE(names("out")) << epmoe_last_error();

  const epmoe_config c = epmoe_config_default(64, 128, 96, 2, 8);
  epmoe_context* ctx = nullptr;
  EXPECT_NE(epmoe_context_create_nccl(&c, id, 16, 0, kRanks, 0, &ctx), 0);
  EXPECT_TRUE(names("unique_id")) << epmoe_last_error();
  EXPECT_NE(epmoe_context_create_nccl(&c, nullptr, sizeof(id), 0, kRanks, 0, &ctx), 0);
  EXPECT_TRUE(names("unique_id")) << epmoe_last_error();
  EXPECT_NE(epmoe_context_create_nccl(&c, id, sizeof(id), kRanks, kRanks, 0, &ctx), 0);
  EXPECT_TRUE(names("rank")) << epmoe_last_error();
  EXPECT_NE(epmoe_context_create_nccl(nullptr, id, sizeof(id), 0, kRanks, 0, &ctx), 0);
  EXPECT_TRUE(names("config")) << epmoe_last_error();
  epmoe_config bad = c;
  bad.top_k = 0;
  EXPECT_NE(epmoe_context_create_nccl(&bad, id, sizeof(id), 0, kRanks, 0, &ctx), 0);
  EXPECT_TRUE(names("Config.top_k")) << epmoe_last_error();
  EXPECT_EQ(ctx, nullptr);
  char buf[8];
  EXPECT_NE(epmoe_nccl_peer_access(nullptr, buf, sizeof(buf)), 0);
  EXPECT_TRUE(names("ctx")) << epmoe_last_error();
}

// One rank's forward + backward through the C ABI on the legacy default stream of its device.
// Returns "" or the first error.
std::string run_rank(const Problem& p, const RankInputs& in, const unsigned char* id, int rank,
                     RankOutputs& out, std::string& peer_access) {
  if (cudaSetDevice(rank) != cudaSuccess) return "cudaSetDevice failed";
  epmoe_config c = epmoe_config_default(p.max_tokens, p.hidden, p.intermediate, p.top_k,
                                        p.experts);
  c.capacity_factor = kRanks;  // every routing fits
  c.fuse_epilogues = p.fused ? 1 : 0;
  epmoe_context* ctx = nullptr;
  if (epmoe_context_create_nccl(&c, id, EPMOE_NCCL_UNIQUE_ID_BYTES, rank, kRanks, rank, &ctx) !=
      0) {
    return epmoe_last_error();
  }
  std::string error;
  {
    DeviceCall call(p, in, rank);
    char how[256] = {};
    if (epmoe_nccl_peer_access(ctx, how, sizeof(how)) == 0) peer_access = how;

    epmoe_forward_args f{};
    f.x_TD = call.x;
    f.tokens = in.tokens;
    f.num_tokens_1 = nullptr;
    f.topk_ids_TK = call.ids32;
    f.ids_int64 = 0;
    f.topk_scores_TK = call.scores32;
    f.scores_bf16 = 0;
    f.w13_EFD = call.w13;
    f.w2_EDF = call.w2;
    f.y_TD = call.y;
    f.save_for_backward = 1;
    f.slot = 0;
    f.stream = nullptr;
    epmoe_saved saved{};
    epmoe_backward_args b{};
    if (epmoe_forward(ctx, &f, &saved) != 0) {
      error = epmoe_last_error();
    } else {
      b.saved = saved;
      b.grad_y_TD = call.grad_y;
      b.num_tokens_1 = nullptr;
      b.topk_ids_TK = call.ids32;
      b.ids_int64 = 0;
      b.topk_scores_TK = call.scores32;
      b.scores_bf16 = 0;
      b.w13_EFD = call.w13;
      b.w2_EDF = call.w2;
      b.grad_x_TD = call.grad_x;
      b.grad_scores_TK = call.grad_scores;
      b.grad_w13_EFD = call.grad_w13;
      b.grad_w2_EDF = call.grad_w2;
      b.accumulate_wgrad = 0;
      b.stream = nullptr;
      if (epmoe_backward(ctx, &b) != 0 || epmoe_check(ctx) != 0) error = epmoe_last_error();
    }
    if (error.empty()) out = call.outputs();
  }
  epmoe_context_destroy(ctx);  // collective: both ranks get here
  return error;
}

TEST(CApiNccl, TwoContextsInTwoThreadsMatchTheReference) {
  (void)kNvlsOff;
  if (cuda_device_count() < kRanks) GTEST_SKIP() << "fewer than 2 CUDA devices: EP tests skipped";
  for (const bool fused : {true, false}) {
    Problem p;
    p.ranks = kRanks;
    p.max_tokens = 64;
    p.hidden = 128;
    p.intermediate = 96;
    p.top_k = 2;
    p.experts = 8;
    p.fused = fused;
    const std::vector<RankInputs> in = make_inputs(p, fused ? 41 : 42, p.max_tokens);

    unsigned char id[EPMOE_NCCL_UNIQUE_ID_BYTES] = {};
    ASSERT_EQ(epmoe_nccl_unique_id(id, sizeof(id)), 0) << epmoe_last_error();
    std::vector<RankOutputs> out(kRanks);
    std::vector<std::string> errors(kRanks), access(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] { errors[r] = run_rank(p, in[r], id, r, out[r], access[r]); });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_EQ(errors[r], "") << p.name() << ": rank " << r;
      EXPECT_FALSE(access[r].empty()) << "rank " << r << ": no peer access reported";
      std::printf("%s: rank %d reaches its peer through %s\n", p.name().c_str(), r,
                  access[r].c_str());
    }
    const OutputErrors e = measure(out, reference_layer(p, in), in);
    report_errors(p.name() + " C ABI ep2 gpu vs float64", e);
    expect_within_tolerance(e, p.name() + " (EP=2 through the C ABI vs float64)");
  }
}

}  // namespace
}  // namespace epmoe::test
