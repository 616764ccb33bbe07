// EP = 2 on two GPUs of one process: one thread per GPU, each with an NCCL transport
// (include/epmoe/nccl.h) made from an in-process unique id. The transport alone (host collectives
// with budgets, symmetric buffers in both peer-access modes, the stream barrier and its timeout
// status), then the whole layer against the CPU backend with 2 thread ranks on identical global
// inputs (tolerance tables), different live counts per rank, CUDA-graph capture and replay on both
// ranks (also at the minimum slot budget, every backward replaying its forward), a stack of layers
// in one activation slot whose recomputed results equal the saved ones bitwise, the fp8_block
// inference forward against the CPU backend, overflow on one rank reported on both with the step skipped on both, and a rank that
// never enters the call (the other rank gets a timeout naming it instead of hanging). Every test
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
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/slot_plan.h"
#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/nccl.h"
#include "epmoe/status.h"
#include "captured_step.h"
#include "device_call.h"
#include "fp8_exact_inputs.h"
#include "epmoe/memory_plan.h"
#include "moe_case.h"
#include "output_compare.h"
#include "slot_stack.h"
#include "tolerances.h"

namespace epmoe::test {
namespace {

// NVLink multicast stays off (NCCL_NVLS_ENABLE=0) unless the caller chose otherwise.
const bool kNvlsOff = [] { return setenv("NCCL_NVLS_ENABLE", "0", 0) == 0; }();

constexpr int kRanks = 2;

// The graph-replay tests' replays: a routing seed and each rank's live count.
struct Replay {
  uint64_t seed;
  int64_t live0, live1;
};
const std::vector<Replay> kReplays = {{2, 256, 256}, {3, 100, 200}, {4, 1, 0}, {5, 256, 17}};

#define EPMOE_REQUIRE_2GPUS()                                        \
  do {                                                               \
    (void)kNvlsOff;                                                  \
    if (cuda_device_count() < kRanks) {                              \
      GTEST_SKIP() << "fewer than 2 CUDA devices: EP tests skipped"; \
    }                                                                \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// fn(rank, transport) on one thread per GPU (rank r on cuda:r), each with an NCCL transport of
// one fresh in-process id. An exception on any rank is re-thrown here after every rank finished.
void run_on_gpus(const std::function<void(int rank, std::shared_ptr<Transport>)>& fn,
                 const NcclTransportOptions& options = {}) {
  const NcclUniqueId id = nccl_unique_id();
  std::vector<std::exception_ptr> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        if (cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
        std::shared_ptr<Transport> t =
            make_nccl_transport(id.data(), id.size(), r, kRanks, r, options);
        fn(r, t);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Spin-wait on a flag another rank thread sets (the test's own out-of-band signalling).
void wait_for(const std::atomic<bool>& flag) {
  while (!flag.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}


// The layer on 2 GPUs: every rank's outputs.
std::vector<RankOutputs> run_gpu_layer(const Problem& p, const std::vector<RankInputs>& in,
                                       const NcclTransportOptions& options = {}) {
  std::vector<RankOutputs> out(kRanks);
  run_on_gpus(
      [&](int r, std::shared_ptr<Transport> t) {
        auto ctx = Context::create(p.config(), t);
        DeviceCall call(p, in[r], r);
        out[r] = run_once(*ctx, call, nullptr);
        ctx->close();
      },
      options);
  return out;
}

void expect_matches_cpu(const Problem& p, const std::vector<RankInputs>& in,
                        const std::vector<RankOutputs>& gpu, const std::string& what) {
  const auto cpu = run_layer(p, in);
  const OutputErrors vs_cpu = compare(gpu, cpu);
  const OutputErrors vs_ref = measure(gpu, reference_layer(p, in), in);
  report_errors(what + " ep2 gpu vs cpu", vs_cpu);
  report_errors(what + " ep2 gpu vs float64", vs_ref);
  for (int o = 0; o < kNumOutputs; ++o) {
    const Output out = static_cast<Output>(o);
    EXPECT_LE(vs_cpu[out], backend_rel_l2_bound(Precision::bf16, out))
        << what << ": " << to_string(out) << " EP=2 CUDA vs CPU backend (" << vs_cpu.to_string()
        << ")";
  }
  expect_within_tolerance(vs_ref, what + " (EP=2 CUDA vs float64)");
}

Problem problem(int64_t T, int64_t D, int64_t F, int experts, int K) {
  return make_problem(kRanks, T, D, F, K, experts);
}

void expect_timeout_naming(const std::function<void()>& fn, const std::string& rank_text,
                           const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no timeout was reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::timeout) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(rank_text), std::string::npos)
        << what << ": the error does not name " << rank_text << ": " << e.what();
  }
}

// ---- the transport alone ----

TEST(NcclTransport, CollectivesAndSymmetricBuffersInBothPeerAccessModes) {
  EPMOE_REQUIRE_2GPUS();
  for (PeerAccess access : {PeerAccess::automatic, PeerAccess::cuda_ipc}) {
    NcclTransportOptions options;
    options.peer_access = access;
    run_on_gpus(
        [&](int r, std::shared_ptr<Transport> t) {
          EXPECT_EQ(t->rank(), r);
          EXPECT_EQ(t->size(), kRanks);
          EXPECT_EQ(t->device().index, r);
          const std::string how = nccl_peer_access(*t);
          std::printf("rank %d, requested %s: peers through %s\n", r, to_string(access),
                      how.c_str());
          if (access == PeerAccess::cuda_ipc) {
            EXPECT_EQ(how.rfind("cuda-ipc", 0), 0u) << how;
          }
          const int64_t mine[2] = {10 + r, 100 * r};
          int64_t all[2 * kRanks] = {};
          t->all_gather(mine, all, sizeof(mine), std::chrono::milliseconds(30000));
          for (int q = 0; q < kRanks; ++q) {
            EXPECT_EQ(all[2 * q], 10 + q);
            EXPECT_EQ(all[2 * q + 1], 100 * q);
          }
          // Zero-filled, distinct per rank, each rank's copy readable through the peer table.
          const size_t bytes = (1 << 20) + 48;
          SymmetricBuffer b = t->allocate_symmetric(bytes, "test");
          ASSERT_EQ(b.peers.size(), static_cast<size_t>(kRanks));
          EXPECT_EQ(b.peers[r], b.local);
          const std::vector<unsigned char> zeros =
              download(static_cast<unsigned char*>(b.local), bytes);
          EXPECT_TRUE(
              std::all_of(zeros.begin(), zeros.end(), [](unsigned char c) { return c == 0; }));
          EXPECT_EQ(cudaMemset(b.local, 0x30 + r, bytes), cudaSuccess);
          EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          t->barrier("written", std::chrono::milliseconds(30000));
          for (int q = 0; q < kRanks; ++q) {
            const auto got = download(static_cast<unsigned char*>(b.peers[q]), bytes);
            EXPECT_TRUE(
                std::all_of(got.begin(), got.end(), [&](unsigned char c) { return c == 0x30 + q; }))
                << "rank " << r << " reading rank " << q << "'s copy through " << how;
          }
          t->barrier("read", std::chrono::milliseconds(30000));
          t->release_symmetric(b);
          EXPECT_EQ(b.local, nullptr);
        },
        options);
  }
}

TEST(NcclTransport, HostBarrierTimeoutNamesMissingRankAndWithdraws) {
  EPMOE_REQUIRE_2GPUS();
  std::atomic<bool> timed_out{false};
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    if (r == 0) {
      const auto t0 = Clock::now();
      expect_timeout_naming([&] { t->barrier("alone", std::chrono::milliseconds(300)); },
                            "rank(s) 1", "host barrier without rank 1");
      EXPECT_LT(seconds_since(t0), 5.0) << "the 300 ms budget was not kept";
      timed_out = true;
    } else {
      wait_for(timed_out);
    }
    // Rank 0 withdrew: the next barrier of both ranks matches up, and so does an all-gather.
    t->barrier("together", std::chrono::milliseconds(30000));
    int32_t all[kRanks] = {};
    const int32_t mine = 7 * r;
    t->all_gather(&mine, all, sizeof(mine), std::chrono::milliseconds(30000));
    EXPECT_EQ(all[0], 0);
    EXPECT_EQ(all[1], 7);
  });
}

TEST(NcclTransport, MismatchedCollectivesFailOnEveryRank) {
  EPMOE_REQUIRE_2GPUS();
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    try {
      t->barrier(r == 0 ? "A" : "B", std::chrono::milliseconds(30000));
      ADD_FAILURE() << "rank " << r << ": mismatched barrier tags were not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::internal) << e.what();
    }
    // Payload sizes are compared before any payload moves.
    int64_t big[2] = {1, 2};
    int64_t out[2 * kRanks] = {};
    try {
      t->all_gather(big, out, r == 0 ? 8 : 16, std::chrono::milliseconds(30000));
      ADD_FAILURE() << "rank " << r << ": mismatched all_gather sizes were not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument) << e.what();
    }
    t->barrier("still usable", std::chrono::milliseconds(30000));
  });
}

// Many stream barriers on both ranks: copy-engine writes into the peer's buffer before barrier
// channel 0 are seen by the peer after it; channel 1 keeps the next round from overwriting
// unread data. The status word stays clean.
TEST(NcclTransport, StreamBarriersOrderPeerWrites) {
  EPMOE_REQUIRE_2GPUS();
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    const int peer = 1 - r;
    constexpr size_t kBytes = 1 << 16;
    SymmetricBuffer b = t->allocate_symmetric(2 * kBytes, "rounds");  // [inbox | outbox]
    char* inbox = static_cast<char*>(b.local);
    char* outbox = inbox + kBytes;
    char* peer_inbox = static_cast<char*>(b.peers[peer]);
    Status* status = nullptr;
    CUDA_OK(cudaMalloc(&status, sizeof(Status)));
    CUDA_OK(cudaMemset(status, 0, sizeof(Status)));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    t->barrier("ready", std::chrono::milliseconds(30000));
    const std::chrono::milliseconds budget(10000);
    std::vector<unsigned char> got(kBytes);
    const int rounds = 300;
    const auto t0 = Clock::now();
    for (int i = 0; i < rounds; ++i) {
      const int value = (i * 7 + r) & 0xff;
      CUDA_OK(cudaMemsetAsync(outbox, value, kBytes, stream));
      CUDA_OK(cudaMemcpyAsync(peer_inbox, outbox, kBytes, cudaMemcpyDeviceToDevice, stream));
      t->barrier_on_stream(stream, 0, budget, status);
      CUDA_OK(cudaMemcpyAsync(got.data(), inbox, kBytes, cudaMemcpyDeviceToHost, stream));
      t->barrier_on_stream(stream, 1, budget, status);
      CUDA_OK(cudaStreamSynchronize(stream));
      const int want = (i * 7 + peer) & 0xff;
      ASSERT_TRUE(std::all_of(got.begin(), got.end(), [&](unsigned char c) { return c == want; }))
          << "rank " << r << " round " << i << ": peer data not visible after the barrier";
    }
    std::printf("rank %d: %d rounds of (64 KiB copy + 2 stream barriers) in %.3f ms each\n", r,
                rounds, 1e3 * seconds_since(t0) / rounds);
    Status st;
    CUDA_OK(cudaMemcpy(&st, status, sizeof(Status), cudaMemcpyDeviceToHost));
    EXPECT_TRUE(st.ok()) << st.to_string();
    CUDA_OK(cudaStreamDestroy(stream));
    CUDA_OK(cudaFree(status));
    t->barrier("done", std::chrono::milliseconds(30000));
    t->release_symmetric(b);
  });
}

TEST(NcclTransport, StreamBarrierTimeoutRecordsStatusAndNeverHangs) {
  EPMOE_REQUIRE_2GPUS();
  std::atomic<bool> rank0_done{false};
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    Status* status = nullptr;
    CUDA_OK(cudaMalloc(&status, sizeof(Status)));
    CUDA_OK(cudaMemset(status, 0, sizeof(Status)));
    auto take = [&] {
      Status st;
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(&st, status, sizeof(Status), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaMemset(status, 0, sizeof(Status)), cudaSuccess);
      return st;
    };
    if (r == 0) {
      const auto t0 = Clock::now();
      t->barrier_on_stream(nullptr, 2, std::chrono::milliseconds(200), status);
      const Status st = take();
      EXPECT_LT(seconds_since(t0), 5.0);
      EXPECT_EQ(st.code, static_cast<int32_t>(StatusCode::barrier_timeout)) << st.to_string();
      EXPECT_EQ(st.rank, 1) << st.to_string();
      EXPECT_EQ(st.index, 2) << st.to_string();
      EXPECT_EQ(st.required, 1) << st.to_string();
      EXPECT_EQ(st.available, 0) << st.to_string();
      EXPECT_NE(st.to_string().find("waiting for rank 1"), std::string::npos) << st.to_string();
      // Broken from now on: the next barrier returns at once and says why.
      const auto t1 = Clock::now();
      t->barrier_on_stream(nullptr, 0, std::chrono::milliseconds(60000), status);
      const Status again = take();
      EXPECT_LT(seconds_since(t1), 5.0);
      EXPECT_EQ(again.code, static_cast<int32_t>(StatusCode::barrier_timeout));
      EXPECT_EQ(again.available, -2) << again.to_string();
      rank0_done = true;
    } else {
      wait_for(rank0_done);
      // Rank 0 gave up and said so in rank 1's flags: no wait for the (long) budget.
      const auto t0 = Clock::now();
      t->barrier_on_stream(nullptr, 2, std::chrono::milliseconds(60000), status);
      const Status st = take();
      EXPECT_LT(seconds_since(t0), 5.0);
      EXPECT_EQ(st.code, static_cast<int32_t>(StatusCode::barrier_timeout)) << st.to_string();
      EXPECT_EQ(st.rank, 0) << st.to_string();
      EXPECT_EQ(st.available, -1) << st.to_string();
    }
    CUDA_OK(cudaFree(status));
    // Host collectives are unaffected.
    t->barrier("after the timeout", std::chrono::milliseconds(30000));
  });
}

// ---- the whole layer ----

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

// fp8_block training on 2 GPUs against 2 CPU thread ranks: y and every gradient within
// kBackendTolerances (fp8_block); fused and unfused, both combines, different live counts per rank.
TEST(GpuEp2, Fp8TrainingMatchesCpu) {
  EPMOE_REQUIRE_2GPUS();
  for (bool fused : {true, false}) {
    for (CombineMode combine : {CombineMode::per_route}) {  // Config refuses fp8_block per_rank
      Problem p = problem(333, 256, 528, 16, 4);
      p.precision = Precision::fp8_block;
      p.fused = fused;
      p.combine = combine;
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

TEST(GpuEp2, GraphReplayOnBothRanksEqualsEager) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 2.0;
  // Same x, weights, grad_y every time; fresh ids and scores per seed; live counts per rank.
  auto routing = [&](uint64_t seed, int64_t live0, int64_t live1) {
    return rerouted(p, 100, seed, 256, {live0, live1});
  };
  const std::vector<Replay>& replays = kReplays;
  const auto first = routing(1, 256, 256);
  std::vector<std::vector<RankOutputs>> replayed(replays.size(), std::vector<RankOutputs>(kRanks));
  std::vector<std::vector<RankOutputs>> eager(replays.size(), std::vector<RankOutputs>(kRanks));
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    auto graph_ctx = Context::create(p.config(), t);
    auto eager_ctx = Context::create(p.config(), t);  // same transport: same stream order below
    DeviceCall call(p, first[r], r);
    CapturedStep step(*graph_ctx, call);
    for (size_t i = 0; i < replays.size(); ++i) {
      const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
      replayed[i][r] = step.replay(in[r]);
      DeviceCall eager_call(p, in[r], r);
      eager[i][r] = run_once(*eager_ctx, eager_call, step.stream());
    }
    graph_ctx->close();
    eager_ctx->close();
  });
  for (size_t i = 0; i < replays.size(); ++i) {
    expect_bitwise_equal(replayed[i], eager[i],
                         "graph replay, routing seed " + std::to_string(replays[i].seed));
    const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
    const OutputErrors err = compare(eager[i], run_layer(p, in));
    EXPECT_LE(err[Output::y], backend_rel_l2_bound(Precision::bf16, Output::y)) << err.to_string();
  }
}

// Per-rank combine (Config.combine = per_rank, inference) at EP = 2: y against the CPU backend's
// per-rank y with 2 thread ranks (tolerance table; the send and reduce kernels sum in the CPU's
// order, the GEMMs differ in accumulation order) and the float64 reference, close to the
// per-route combine, repeat calls bitwise, and a captured forward replayed with new routings and
// live counts equal to eager on both ranks.
// Training with the per-rank combine at EP = 2: every output against the CPU backend's per-rank
// outputs and the float64 reference (tolerance tables); grad_scores and both weight gradients
// bitwise equal to the per-route combine's (the same dots and GEMMs, now on the expert side).
TEST(GpuEp2, PerRankCombineTrainingMatchesCpuAndPerRoute) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 2.0;
  p.combine = CombineMode::per_rank;
  const auto in = make_inputs(p, 31, 256);
  const auto gpu = run_gpu_layer(p, in);
  expect_matches_cpu(p, in, gpu, "per_rank");
  Problem q = p;
  q.combine = CombineMode::per_route;
  const auto route = run_gpu_layer(q, in);
  for (int r = 0; r < kRanks; ++r) {
    const size_t i = static_cast<size_t>(r);
    EXPECT_EQ(gpu[i].grad_scores_TK, route[i].grad_scores_TK) << "grad_scores rank " << r;
    EXPECT_EQ(gpu[i].grad_w13_EFD, route[i].grad_w13_EFD) << "grad_w13 rank " << r;
    EXPECT_EQ(gpu[i].grad_w2_EDF, route[i].grad_w2_EDF) << "grad_w2 rank " << r;
  }
}

TEST(GpuEp2, PerRankCombineMatchesCpuAndGraphReplays) {
  EPMOE_REQUIRE_2GPUS();
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 2.0;
  p.inference = true;
  p.combine = CombineMode::per_rank;
  auto routing = [&](uint64_t seed, int64_t live0, int64_t live1) {
    return rerouted(p, 100, seed, 256, {live0, live1});
  };
  auto y_error = [](const std::vector<std::vector<bf16_t>>& a,
                    const std::vector<std::vector<bf16_t>>& b) {
    std::vector<RankOutputs> x(kRanks), z(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      x[r].y_TD = a[r];
      z[r].y_TD = b[r];
    }
    return compare(x, z)[Output::y];
  };
  auto gpu_forward = [&](const Problem& q, const std::vector<RankInputs>& in) {
    std::vector<std::vector<bf16_t>> y(kRanks);
    run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
      auto ctx = Context::create(q.config(), t);
      DeviceCall call(q, in[r], r);
      y[r] = run_forward_once(*ctx, call, nullptr);
      EXPECT_EQ(run_forward_once(*ctx, call, nullptr), y[r]) << "repeat call, rank " << r;
      ctx->close();
    });
    return y;
  };
  auto cpu_forward = [&](const Problem& q, const std::vector<RankInputs>& in) {
    std::vector<std::vector<bf16_t>> y(kRanks);
    with_contexts(q, [&](int r, Context& ctx) {
      RankCall call(q, in[r]);
      ForwardArgs a = call.forward_args();
      a.save_for_backward = false;
      ctx.forward(a);
      y[r] = call.y;
    });
    return y;
  };
  const auto first = routing(1, 256, 256);
  const auto gpu = gpu_forward(p, first);
  const double vs_cpu = y_error(gpu, cpu_forward(p, first));
  EXPECT_LE(vs_cpu, backend_rel_l2_bound(Precision::bf16, Output::y)) << "per_rank CUDA vs CPU";
  std::vector<RankOutputs> got(kRanks);
  for (int r = 0; r < kRanks; ++r) got[r].y_TD = gpu[r];
  const auto ref = reference_layer(p, first);
  std::vector<double> g, f;
  for (int r = 0; r < kRanks; ++r) {
    const auto w = widen(gpu[r]);
    g.insert(g.end(), w.begin(), w.end());
    f.insert(f.end(), ref[r].y_TD.begin(), ref[r].y_TD.end());
  }
  EXPECT_LE(reference::rel_l2(f, g), rel_l2_bound(Precision::bf16, Output::y)) << "vs float64";
  Problem q = p;
  q.combine = CombineMode::per_route;
  EXPECT_LE(y_error(gpu, gpu_forward(q, first)), backend_rel_l2_bound(Precision::bf16, Output::y))
      << "per_rank vs per_route on CUDA";

  const std::vector<Replay>& replays = kReplays;
  std::vector<std::vector<std::vector<bf16_t>>> replayed(
      replays.size(), std::vector<std::vector<bf16_t>>(kRanks));
  std::vector<std::vector<std::vector<bf16_t>>> eager(replays.size(),
                                                      std::vector<std::vector<bf16_t>>(kRanks));
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    auto graph_ctx = Context::create(p.config(), t);
    auto eager_ctx = Context::create(p.config(), t);  // same transport: same stream order below
    DeviceCall call(p, first[r], r);
    CapturedStep step(*graph_ctx, call, Pass::forward);
    for (size_t i = 0; i < replays.size(); ++i) {
      const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
      replayed[i][r] = step.replay_y(in[r]);
      DeviceCall eager_call(p, in[r], r);
      eager[i][r] = run_forward_once(*eager_ctx, eager_call, step.stream());
    }
    graph_ctx->close();
    eager_ctx->close();
  });
  for (size_t i = 0; i < replays.size(); ++i) {
    EXPECT_EQ(replayed[i], eager[i]) << "per_rank graph replay, seed " << replays[i].seed;
    const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
    EXPECT_LE(y_error(eager[i], cpu_forward(p, in)),
              backend_rel_l2_bound(Precision::bf16, Output::y))
        << "per_rank CUDA vs CPU, seed " << replays[i].seed;
  }
}

// Packed activation slots at EP = 2: a stack of 4 layers at the minimum and at a mixed budget
// equals the full save bitwise on both ranks (the replay re-runs dispatch and the W2 scatter
// across ranks, with barriers), and both ranks take the decisions the rule gives from the
// fullest rank's rows.
TEST(GpuEp2, RecomputeStackEqualsFullSaveBitwise) {
  EPMOE_REQUIRE_2GPUS();
  const int64_t tokens[kStackLayers] = {96, 29, 96, 61};
  struct Variant {
    bool fused;
    CombineMode combine;
  };
  for (const Variant v : {Variant{true, CombineMode::per_route},
                          Variant{false, CombineMode::per_route},
                          Variant{true, CombineMode::per_rank}}) {
    Problem p = problem(96, 136, 104, 8, 2);  // 2D = 272: granule 2176; h13 rows of 416 bytes
    p.fused = v.fused;
    p.combine = v.combine;
    p.layers_per_slot = kStackLayers;
    SCOPED_TRACE(p.name());
    std::vector<std::vector<RankInputs>> in;  // [layer][rank]
    for (int l = 0; l < kStackLayers; ++l) {
      in.push_back(make_inputs(p, 700 + static_cast<uint64_t>(l), tokens[l]));
    }
    const MemoryPlan plan = plan_memory(stack_config(p, -1), kRanks);
    const int64_t G = plan.packing_granule_bytes;
    const auto rows = stack_rows(p, in);
    const int64_t mixed_packed = stack_mixed_packed(p, rows, G);
    const std::vector<bool> expected = stack_decisions(p, rows, mixed_packed, G);
    ASSERT_NE(std::count(expected.begin(), expected.end(), true), 0);
    ASSERT_NE(std::count(expected.begin(), expected.end(), false), 0);
    auto run = [&](int64_t slot_bytes) {
      std::vector<StackResult> res(kRanks);
      run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
        auto ctx = Context::create(stack_config(p, slot_bytes), t);
        std::vector<RankInputs> mine;
        for (int l = 0; l < kStackLayers; ++l) mine.push_back(in[static_cast<size_t>(l)][static_cast<size_t>(r)]);
        auto calls = stack_calls(p, mine, r);
        res[static_cast<size_t>(r)] = run_stack(*ctx, calls, nullptr);
        ctx->close();
      });
      return res;
    };
    const std::vector<StackResult> saved = run(-1);
    const std::vector<StackResult> minimum = run(plan.minimum_slot_bytes);
    const std::vector<StackResult> mixed = run(plan.slot_metadata_bytes + mixed_packed);
    for (int r = 0; r < kRanks; ++r) {
      const size_t i = static_cast<size_t>(r);
      const std::string rank = "rank " + std::to_string(r);
      EXPECT_EQ(saved[i].recomputed, std::vector<bool>(kStackLayers, false)) << rank;
      EXPECT_EQ(minimum[i].recomputed, std::vector<bool>(kStackLayers, true)) << rank;
      EXPECT_EQ(mixed[i].recomputed, expected) << rank;
      EXPECT_EQ(mixed[i].peak, mixed[0].peak) << rank << ": the ranks' slot accounts differ";
      EXPECT_LE(mixed[i].peak, mixed_packed) << rank;
      expect_stack_bitwise_equal(saved[i], minimum[i], rank + " minimum budget vs full save");
      expect_stack_bitwise_equal(saved[i], mixed[i], rank + " mixed budget vs full save");
    }
    // The saved results are right: each layer's both ranks against the CPU backend.
    for (int l = 0; l < kStackLayers; ++l) {
      const std::vector<RankOutputs> gpu{saved[0].out[static_cast<size_t>(l)],
                                         saved[1].out[static_cast<size_t>(l)]};
      expect_matches_cpu(p, in[static_cast<size_t>(l)], gpu, "stack layer " + std::to_string(l));
    }
  }
}

// One layer at the minimum slot budget, captured once and replayed with new routings and live
// counts: equal to eager on a second context group with the same budget, on both ranks. The
// minimum fits one input x [T, D]; a full save fits only when it is no larger on the fullest rank
// (slot_plan.h). Per-route, h3 [T, K, D] alone exceeds x, so every backward replays the forward;
// per-rank, h3 is [rows, D] and a replay with few live tokens saves everything.
void graph_replay_with_recompute(CombineMode combine) {
  Problem p = problem(256, 256, 192, 16, 4);
  p.capacity_factor = 2.0;
  p.combine = combine;
  SCOPED_TRACE(p.name());
  const MemoryPlan plan = plan_memory(p.config(), kRanks);
  ConfigFields f = p.config().fields();
  f.slots.slot_bytes = plan.minimum_slot_bytes;
  const Config config(f);
  auto routing = [&](uint64_t seed, int64_t live0, int64_t live1) {
    return rerouted(p, 100, seed, 256, {live0, live1});
  };
  const std::vector<Replay>& replays = kReplays;
  const auto first = routing(1, 256, 256);
  std::vector<std::vector<RankOutputs>> replayed(replays.size(), std::vector<RankOutputs>(kRanks));
  std::vector<std::vector<RankOutputs>> eager(replays.size(), std::vector<RankOutputs>(kRanks));
  std::vector<int> replayed_layers(kRanks, 0);
  run_on_gpus([&](int r, std::shared_ptr<Transport> t) {
    auto graph_ctx = Context::create(config, t);
    auto eager_ctx = Context::create(config, t);  // same transport: same stream order below
    DeviceCall call(p, first[static_cast<size_t>(r)], r);
    CapturedStep step(*graph_ctx, call);
    for (size_t i = 0; i < replays.size(); ++i) {
      const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
      step.launch(in[static_cast<size_t>(r)]);
      replayed_layers[static_cast<size_t>(r)] += graph_ctx->recomputes(step.saved()) ? 1 : 0;
      replayed[i][static_cast<size_t>(r)] = call.outputs();
      DeviceCall eager_call(p, in[static_cast<size_t>(r)], r);
      eager[i][static_cast<size_t>(r)] = run_once(*eager_ctx, eager_call, step.stream());
    }
    graph_ctx->close();
    eager_ctx->close();
  });
  // The planner's rule for the first layer of an empty slot of the minimum budget: save
  // everything only if the fullest rank's full save fits the packed region (L inputs) with the
  // L - 1 later layers' inputs. Rows a rank receives: the live routes to its experts.
  auto recomputes = [&](const std::vector<RankInputs>& in) {
    std::vector<int64_t> rows_R(kRanks, 0);
    for (const RankInputs& src : in) {
      const int64_t live = src.live < 0 ? src.tokens : src.live;
      for (int64_t i = 0; i < live * p.top_k; ++i) {
        const int64_t id = src.ids_TK[static_cast<size_t>(i)];
        if (id >= 0) ++rows_R[static_cast<size_t>(id / p.local_experts())];
      }
    }
    const int64_t packed = plan.minimum_slot_bytes - plan.slot_metadata_bytes;
    const int64_t later_inputs = (plan.layers_per_slot - 1) * plan.saved_input_bytes_per_layer;
    for (const int64_t rows : rows_R) {
      const int64_t full = full_save_layout(rows, p.max_tokens, p.hidden, p.intermediate, p.top_k,
                                            plan.packing_granule_bytes,
                                            combine == CombineMode::per_rank)
                               .total;
      if (full + later_inputs > packed) return true;
    }
    return false;
  };
  int expected_recomputes = 0;
  for (const Replay& rp : replays) {
    expected_recomputes += recomputes(routing(rp.seed, rp.live0, rp.live1)) ? 1 : 0;
  }
  // Per-route: all 4. Per-rank: 3 (the replay with live 1 and 0 receives at most K rows a rank).
  EXPECT_EQ(expected_recomputes, combine == CombineMode::per_rank
                                     ? static_cast<int>(replays.size()) - 1
                                     : static_cast<int>(replays.size()));
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(replayed_layers[static_cast<size_t>(r)], expected_recomputes)
        << "rank " << r << ": replays that recompute at the minimum budget";
  }
  for (size_t i = 0; i < replays.size(); ++i) {
    expect_bitwise_equal(replayed[i], eager[i],
                         "graph replay with recompute, routing seed " + std::to_string(replays[i].seed));
    const auto in = routing(replays[i].seed, replays[i].live0, replays[i].live1);
    const OutputErrors err = compare(eager[i], run_layer(p, in));
    EXPECT_LE(err[Output::y], backend_rel_l2_bound(Precision::bf16, Output::y)) << err.to_string();
    EXPECT_LE(err[Output::grad_x], backend_rel_l2_bound(Precision::bf16, Output::grad_x))
        << err.to_string();
  }
}

TEST(GpuEp2, GraphReplayWithRecomputeEqualsEager) {
  EPMOE_REQUIRE_2GPUS();
  graph_replay_with_recompute(CombineMode::per_route);
}

// The same with the per-rank combine: the replay rebuilds h3 on the expert side (no send), and
// gather_grad's grad_scores read it from the call scratch.
TEST(GpuEp2, PerRankGraphReplayWithRecomputeEqualsEager) {
  EPMOE_REQUIRE_2GPUS();
  graph_replay_with_recompute(CombineMode::per_rank);
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
