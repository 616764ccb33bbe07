// EP = 2 on two GPUs of one process: the whole layer against the CPU backend with 2 thread ranks on
// identical global inputs (tolerance tables), the fp8_block forward and training, CUDA IPC peer
// access, NVFP4 weight-only and MXFP8 inference, edge routings with different live counts per rank, the arrival-gated W13, overflow on one
// rank reported on both with the step skipped on both, and a rank that never enters the call (the
// other rank gets a timeout naming it instead of hanging). Graph replay, the per-rank combine and
// recompute: test_gpu_ep2_replay.cpp; the transport alone: test_gpu_nccl_transport.cpp. Every test
// skips with "fewer than 2 CUDA devices: EP tests skipped" where fewer than 2 GPUs exist.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/nccl.h"
#include "epmoe/status.h"
#include "device_call.h"
#include "ep2_support.h"
#include "fp8_exact_inputs.h"
#include "harness.h"
#include "moe_case.h"
#include "mxfp8_weights.h"
#include "nvfp4_weights.h"
#include "output_compare.h"
#include "scoped_env.h"
#include "tolerances.h"

namespace epmoe::test {
namespace {

TEST(GpuEp2, MatchesCpuBackendAndReference) {
  EPMOE_REQUIRE_2GPUS();
  struct Case {
    Problem p;
    int64_t tokens;
  };
  std::vector<Case> cases;
  cases.push_back({problem(64, 128, 96, 8, 2), 64});      // ci-tiny
  cases.push_back({problem(333, 256, 520, 16, 4), 333});  // ragged tiles in every dimension
  cases.push_back({problem(1, 64, 64, 4, 2), 1});         // T = 1
  Problem clamped = problem(96, 192, 136, 8, 2);
  clamped.act = Activation::swiglu_clamped();
  cases.push_back({clamped, 96});
  Problem f32 = problem(80, 128, 64, 6, 3);
  f32.wgrad_dtype = DType::f32;
  cases.push_back({f32, 80});
  Problem unfused = problem(200, 256, 200, 8, 2);
  unfused.fused = false;
  cases.push_back({unfused, 200});
  uint64_t seed = 21;
  for (const Case& c : cases) {
    const auto in = make_inputs(c.p, seed++, c.tokens);
    expect_matches_cpu(c.p, in, run_gpu_layer(c.p, in), c.p.name());
  }
}

// The fp8_block forward of an inference context on 2 GPUs against 2 CPU thread ranks on the same
// inputs: bitwise on exact blocks (fp8_exact_inputs.h), within kBackendTolerances on random data;
// fused and unfused; different live counts per rank.
TEST(GpuEp2, Fp8InferenceForwardMatchesCpu) {
  EPMOE_REQUIRE_2GPUS();
  for (bool exact : {true, false}) {
    for (bool fused : {true, false}) {
      Problem p = problem(exact ? 200 : 333, 256, exact ? 160 : 528, 16, 4);
      p.precision = Precision::fp8_block;
      p.inference = true;
      p.fused = fused;
      std::vector<RankInputs> in = make_inputs(p, exact ? 41 : 42, p.max_tokens);
      in[1].live = p.max_tokens - 37;
      if (exact) {
        for (int r = 0; r < kRanks; ++r) make_exact(p, in[r], 43 + static_cast<uint64_t>(r));
      }
      std::vector<std::vector<bf16_t>> gpu(kRanks);
      run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
        auto ctx = Context::create(p.config(), t);
        DeviceCall call(p, in[r], r);
        ForwardArgs a = call.forward_args(nullptr);
        a.save_for_backward = false;
        ctx->forward(a);
        ctx->check();
        gpu[r] = download(call.y, call.host.y.size());
        ctx->close();
      });
      const std::vector<std::vector<bf16_t>> cpu = forward_y(p, in);
      double num = 0, den = 0;
      for (int r = 0; r < kRanks; ++r) {
        if (exact) {
          EXPECT_TRUE(gpu[r] == cpu[r]) << p.name() << ": rank " << r << " y differs (exact blocks)";
        }
        for (size_t i = 0; i < cpu[r].size(); ++i) {
          const double g = bf16_to_float(gpu[r][i]), c = bf16_to_float(cpu[r][i]);
          num += (g - c) * (g - c);
          den += c * c;
        }
      }
      const double rel = std::sqrt(num / std::max(den, 1e-300));
      if (std::getenv("EPMOE_REPORT_ERRORS") != nullptr) {
        std::printf("%s: y EP=2 CUDA vs CPU rel-L2 %.3e\n", p.name().c_str(), rel);
      }
      EXPECT_LE(rel, backend_rel_l2_bound(Precision::fp8_block, Output::y))
          << p.name() << ": y EP=2 CUDA vs CPU backend";
    }
  }
}

// Weight-only inference (NVFP4, MXFP8) on 2 GPUs against 2 CPU thread ranks on the same inputs
// and the same prepared weights (each rank's own experts, prepared on the host): y within
// kBackendTolerances of the precision; fused and unfused, different live counts per rank.
// DeviceWeights(p, in, r): both weights on rank r's GPU; HostWeight(w, E, rows, cols): one on the
// host; config(p): the precision's config of the problem.
template <class DeviceWeights, class HostWeight>
void expect_weight_only_forward_matches_cpu(Problem p, uint64_t seed,
                                            Config (*config)(const Problem&), Precision precision,
                                            const char* what) {
  for (bool fused : {true, false}) {
    p.inference = true;
    p.fused = fused;
    const Config cfg = config(p);
    std::vector<RankInputs> in = make_inputs(p, seed, p.max_tokens);
    in[1].live = p.max_tokens - 37;
    std::vector<std::vector<bf16_t>> gpu(kRanks), cpu(kRanks);
    run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
      auto ctx = Context::create(cfg, t);
      DeviceCall call(p, in[r], r);
      const DeviceWeights w(p, in[r], r);
      ForwardArgs a = call.forward_args(nullptr);
      a.save_for_backward = false;
      a.w13_prepared = &w.w13.device;
      a.w2_prepared = &w.w2.device;
      ctx->forward(a);
      ctx->check();
      gpu[r] = download(call.y, call.host.y.size());
      ctx->close();
    });
    run_on_ranks(kRanks, [&](int r, std::shared_ptr<Transport> t) {
      auto ctx = Context::create(cfg, std::move(t));
      RankCall call(p, in[r]);
      const HostWeight w13(in[r].w13_EFD, p.local_experts(), 2 * p.intermediate, p.hidden);
      const HostWeight w2(in[r].w2_EDF, p.local_experts(), p.hidden, p.intermediate);
      ForwardArgs a = call.forward_args();
      a.save_for_backward = false;
      a.w13_prepared = &w13.host;
      a.w2_prepared = &w2.host;
      ctx->forward(a);
      cpu[r] = call.y;
      ctx->close();
    });
    double num = 0, den = 0;
    for (int r = 0; r < kRanks; ++r) {
      for (size_t i = 0; i < cpu[r].size(); ++i) {
        const double g = bf16_to_float(gpu[r][i]), c = bf16_to_float(cpu[r][i]);
        num += (g - c) * (g - c);
        den += c * c;
      }
    }
    const double rel = std::sqrt(num / std::max(den, 1e-300));
    if (std::getenv("EPMOE_REPORT_ERRORS") != nullptr) {
      std::printf("%s %s: y EP=2 CUDA vs CPU rel-L2 %.3e\n", p.name().c_str(), what, rel);
    }
    EXPECT_LE(rel, backend_rel_l2_bound(precision, Output::y))
        << p.name() << " " << what << ": y EP=2 CUDA vs CPU backend";
  }
}

TEST(GpuEp2, Nvfp4InferenceForwardMatchesCpu) {
  EPMOE_REQUIRE_2GPUS();
  expect_weight_only_forward_matches_cpu<Nvfp4Weights, Nvfp4Weight>(
      problem(128, 448, 320, 16, 4), 47, nvfp4_config, Precision::nvfp4, "nvfp4");
}

TEST(GpuEp2, Mxfp8InferenceForwardMatchesCpu) {
  EPMOE_REQUIRE_2GPUS();
  expect_weight_only_forward_matches_cpu<Mxfp8Weights, Mxfp8Weight>(
      problem(128, 416, 288, 16, 4), 48, mxfp8_config, Precision::mxfp8, "mxfp8");
}

// fp8_block training on 2 GPUs against 2 CPU thread ranks: y and every gradient within
// kBackendTolerances (fp8_block); fused and unfused, both combines, different live counts per rank;
// and Config.fp8_wgrad = bf16 (fused, per-route: x decoded from the received E4M3 rows).
TEST(GpuEp2, Fp8TrainingMatchesCpu) {
  EPMOE_REQUIRE_2GPUS();
  for (Fp8Wgrad wgrad : {Fp8Wgrad::fp8, Fp8Wgrad::bf16}) {
    for (bool fused : {true, false}) {
      for (CombineMode combine : {CombineMode::per_route, CombineMode::per_rank}) {
        if (wgrad == Fp8Wgrad::bf16 && (!fused || combine != CombineMode::per_route)) continue;
        Problem p = problem(333, 256, 528, 16, 4);
        p.precision = Precision::fp8_block;
        p.fused = fused;
        p.combine = combine;
        p.fp8_wgrad = wgrad;
        std::vector<RankInputs> in = make_inputs(p, 44, p.max_tokens);
        in[1].live = p.max_tokens - 37;
        const auto gpu = run_gpu_layer(p, in);
        const OutputErrors vs_cpu = compare(gpu, run_layer(p, in));
        report_errors(p.name() + " fp8 ep2 gpu vs cpu", vs_cpu);
        for (int o = 0; o < kNumOutputs; ++o) {
          const Output out = static_cast<Output>(o);
          EXPECT_LE(vs_cpu[out], backend_rel_l2_bound(Precision::fp8_block, out))
              << p.name() << ": " << to_string(out) << " EP=2 CUDA vs CPU backend ("
              << vs_cpu.to_string() << ")";
        }
      }
    }
  }
}

// fp8_block training on 2 GPUs: grad_h3 and grad_h13 quantized by the kernels that write them
// (the pull reads the peer's rows) give y and every gradient bitwise as the separate quantization.
TEST(GpuEp2, Fp8RowQuantizationInProducersEqualsSeparateBitwise) {
  EPMOE_REQUIRE_2GPUS();
  for (bool fused : {true, false}) {
    Problem p = problem(300, 384, 256, 16, 4);  // F % 128 == 0: both producers quantize
    p.precision = Precision::fp8_block;
    p.fused = fused;
    std::vector<RankInputs> in = make_inputs(p, 45, p.max_tokens);
    in[0].live = p.max_tokens - 41;
    std::vector<RankOutputs> separate;
    {
      const ScopedEnv env("EPMOE_FP8_ROW_QUANT", "separate");
      separate = run_gpu_layer(p, in);
    }
    expect_bitwise_equal(run_gpu_layer(p, in), separate,
                         p.name() + (fused ? " fused" : " unfused") +
                             ": EP=2 quantized by the producers vs separately");
  }
}

TEST(GpuEp2, CudaIpcPeerAccessMatchesCpu) {
  EPMOE_REQUIRE_2GPUS();
  const Problem p = problem(128, 256, 128, 8, 2);
  const auto in = make_inputs(p, 31, 128);
  NcclTransportOptions options;
  options.peer_access = PeerAccess::cuda_ipc;
  expect_matches_cpu(p, in, run_gpu_layer(p, in, options), p.name() + " cuda_ipc");
}

TEST(GpuEp2, EdgeRoutingsAndDifferentLiveCountsPerRank) {
  EPMOE_REQUIRE_2GPUS();
  const Problem base_problem = problem(130, 128, 96, 8, 2);
  struct Edge {
    const char* name;
    Router router;
    int64_t live0, live1;
  };
  const std::vector<Edge> edges = {
      {"different live counts", distinct_router(8, 2), 100, 37},
      {"one rank with no live tokens", distinct_router(8, 2), 0, 130},
      {"all routes to one expert", [](int, int64_t, int, std::mt19937_64&) -> int64_t { return 3; },
       -1, -1},
      {"every route to the other rank",
       [](int rank, int64_t t, int k, std::mt19937_64&) -> int64_t {
         return (1 - rank) * 4 + (t + k) % 4;
       },
       77, 120},
      {"inactive routes",
       [](int, int64_t t, int k, std::mt19937_64&) -> int64_t {
         return (t % 3 == 0 || k == 1) ? -1 : t % 8;
       },
       -1, 50},
  };
  for (const CombineMode combine : {CombineMode::per_route, CombineMode::per_rank}) {
    Problem p = base_problem;
    p.combine = combine;
    SCOPED_TRACE(p.name());
    uint64_t seed = 60;
    for (const Edge& e : edges) {
      auto in = make_inputs(p, seed++, 130, e.router);
      in[0].live = e.live0;
      in[1].live = e.live1;
      const auto gpu = run_gpu_layer(p, in);
      const auto cpu = run_layer(p, in);
      const OutputErrors err = compare(gpu, cpu);
      for (int o = 0; o < kNumOutputs; ++o) {
        const Output out = static_cast<Output>(o);
        if (std::isnan(err[out])) continue;  // all-zero outputs: 0 / 0
        EXPECT_LE(err[out], backend_rel_l2_bound(Precision::bf16, out))
            << e.name << " " << to_string(out);
      }
      for (int r = 0; r < kRanks; ++r) {
        const int64_t live = in[r].live;
        if (live < 0) continue;
        for (int64_t t = live; t < 130; ++t) {  // padding rows are exactly zero
          for (int64_t d = 0; d < p.hidden; ++d) {
            ASSERT_EQ(gpu[r].y_TD[t * p.hidden + d], 0)
                << e.name << " rank " << r << " y row " << t;
            ASSERT_EQ(gpu[r].grad_x_TD[t * p.hidden + d], 0)
                << e.name << " rank " << r << " grad_x row " << t;
          }
        }
      }
    }
  }
}

// Over NVLink: one read per (source rank, token) and W13 gated on arrivals give the same bits as
// the staged sequence, forward and backward, including tokens whose K routes all land on one rank.
TEST(GpuEp2, ArrivalGatedEqualsStagedBitwise) {
  EPMOE_REQUIRE_2GPUS();
  struct Edge {
    const char* name;
    Problem p;
    Router router;
    int64_t live0, live1;
  };
  const Problem base = problem(130, 128, 96, 8, 2);
  const Problem k4 = problem(257, 256, 192, 8, 4);
  const std::vector<Edge> edges = {
      {"balanced", problem(1024, 512, 256, 16, 4), distinct_router(16, 4), -1, -1},
      {"K routes to experts of the same rank", k4,
       [](int rank, int64_t t, int k, std::mt19937_64&) -> int64_t {
         return ((rank + t) % 2) * 4 + k;  // all 4 experts of one rank, alternating ranks
       },
       -1, 200},
      {"all routes of a token to the other rank", base,
       [](int rank, int64_t t, int k, std::mt19937_64&) -> int64_t {
         return (1 - rank) * 4 + (t + k) % 4;
       },
       77, 120},
      {"zero-token experts", base,
       [](int, int64_t t, int k, std::mt19937_64&) -> int64_t { return (t + k) % 2 ? 6 : 1; }, -1,
       -1},
      {"T = 1", problem(1, 64, 64, 4, 2), distinct_router(4, 2), -1, -1},
      {"one rank with no live tokens", base, distinct_router(8, 2), 0, 130},
  };
  uint64_t seed = 90;
  for (const Edge& e : edges) {
    auto in = make_inputs(e.p, seed++, e.p.max_tokens, e.router);
    in[0].live = e.live0;
    in[1].live = e.live1;
    Problem gated = e.p, staged = e.p;
    gated.arrival_gated_w13 = true;
    staged.arrival_gated_w13 = false;
    expect_bitwise_equal(run_gpu_layer(gated, in), run_gpu_layer(staged, in),
                         std::string(e.name) + ": gated vs staged");
  }
}

TEST(GpuEp2, OverflowOnOneRankIsReportedOnBothAndTheStepSkipped) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(128, 128, 64, 8, 2);
  p.capacity_factor = 0.25;  // 64 rows of capacity per rank
  // Rank 1 sends every route to rank 0's experts 0 and 1 (256 rows > 64); rank 0 sends 16 to
  // rank 1.
  const auto heavy =
      make_inputs(p, 3, 128, [](int rank, int64_t t, int k, std::mt19937_64&) -> int64_t {
        return rank == 1 ? k : (t < 8 ? 4 + k : -1);
      });
  // Then a call that fits: 32 rows each way.
  const auto light =
      make_inputs(p, 4, 128, [](int rank, int64_t t, int k, std::mt19937_64&) -> int64_t {
        return t < 16 ? (1 - rank) * 4 + k : -1;
      });
  std::vector<RankOutputs> good(kRanks);
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    auto ctx = Context::create(p.config(), t);
    DeviceCall bad(p, heavy[r], r);
    const SavedLayer saved = ctx->forward(bad.forward_args(nullptr));
    ctx->backward(bad.backward_args(saved, nullptr));
    try {
      ctx->check();
      ADD_FAILURE() << "rank " << r << ": the overflow of rank 0 was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::capacity_overflow) << e.what();
      const std::string msg = e.what();
      EXPECT_NE(msg.find("on rank 0"), std::string::npos) << "rank " << r << ": " << msg;
      EXPECT_NE(msg.find("256"), std::string::npos) << msg;  // required
      EXPECT_NE(msg.find("64"), std::string::npos) << msg;   // available
    }
    // Skipped on both ranks: y is zero, never garbage.
    const RankOutputs skipped = bad.outputs();
    for (bf16_t v : skipped.y_TD) ASSERT_EQ(v, 0) << "rank " << r;
    DeviceCall ok(p, light[r], r);
    good[r] = run_once(*ctx, ok, nullptr);
    ctx->close();
  });
  const OutputErrors err = compare(good, run_layer(p, light));
  for (int o = 0; o < kNumOutputs; ++o) {
    const Output out = static_cast<Output>(o);
    EXPECT_LE(err[out], backend_rel_l2_bound(Precision::bf16, out))
        << to_string(out) << " " << err.to_string();
  }
}

TEST(GpuEp2, RankThatNeverEntersTheCallIsNamedInATimeout) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(64, 128, 96, 8, 2);
  p.barrier_timeout_ms = 1000;
  const auto in = make_inputs(p, 9, 64);
  std::atomic<bool> rank0_done{false}, rank1_done{false};
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    auto ctx = Context::create(p.config(), t);
    DeviceCall call(p, in[r], r);
    if (r == 0) {
      const auto t0 = Clock::now();
      expect_timeout_naming(
          [&] {
            const SavedLayer saved = ctx->forward(call.forward_args(nullptr));
            ctx->backward(call.backward_args(saved, nullptr));
            ctx->check();
          },
          "waiting for rank 1", "rank 1 never calls forward");
      EXPECT_LT(seconds_since(t0), 20.0) << "the 1 s budget was not kept";
      // y of the skipped step is zero.
      const RankOutputs skipped = call.outputs();
      for (bf16_t v : skipped.y_TD) ASSERT_EQ(v, 0);
      // The barriers stay broken: the next call reports at once instead of waiting again.
      const auto t1 = Clock::now();
      expect_timeout_naming([&] { run_once(*ctx, call, nullptr); }, "rank 1", "the next call");
      EXPECT_LT(seconds_since(t1), 5.0);
      rank0_done = true;
      wait_for(rank1_done);
    } else {
      wait_for(rank0_done);
      // Rank 0 gave up: rank 1's first call learns it at once.
      const auto t0 = Clock::now();
      expect_timeout_naming([&] { run_once(*ctx, call, nullptr); }, "waiting for rank 0",
                            "rank 1 after rank 0 gave up");
      EXPECT_LT(seconds_since(t0), 5.0);
      rank1_done = true;
    }
    ctx->close();  // host collectives still work
  });
}

}  // namespace
}  // namespace epmoe::test
