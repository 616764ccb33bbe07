// The NCCL transport alone on two GPUs of one process (one thread per GPU): host collectives with
// budgets, symmetric buffers in both peer-access modes, the stream barrier and its timeout status.
// Skips with "fewer than 2 CUDA devices: EP tests skipped" where fewer than 2 GPUs exist.
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

#include "epmoe/error.h"
#include "epmoe/nccl.h"
#include "epmoe/status.h"
#include "ep2_support.h"

namespace epmoe::test {
namespace {

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

}  // namespace
}  // namespace epmoe::test
