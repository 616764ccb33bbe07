// Shared by the EP = 2 GPU test files (test_gpu_ep2*.cpp, test_gpu_nccl_transport.cpp): two GPUs
// of one process, one thread per GPU, each with an NCCL transport made from an in-process unique
// id; the layer run on both ranks and checked against the CPU backend with 2 thread ranks.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/cuda.h"
#include "epmoe/nccl.h"
#include "epmoe/transport.h"
#include "device_call.h"
#include "moe_case.h"

namespace epmoe::test {

// NVLink multicast stays off (NCCL_NVLS_ENABLE=0) unless the caller chose otherwise; set during
// static initialisation, before any NCCL communicator exists.
extern const bool kNvlsOff;

constexpr int kRanks = 2;

#define EPMOE_REQUIRE_2GPUS()                                        \
  do {                                                               \
    (void)::epmoe::test::kNvlsOff;                                   \
    if (cuda_device_count() < ::epmoe::test::kRanks) {               \
      GTEST_SKIP() << "fewer than 2 CUDA devices: EP tests skipped"; \
    }                                                                \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0);

// fn(rank, transport) on one thread per GPU (rank r on cuda:r), each with an NCCL transport of
// one fresh in-process id. An exception on any rank is re-thrown here after every rank finished.
void run_on_gpus(const std::function<void(int rank, std::shared_ptr<Transport>)>& fn,
                 const NcclTransportOptions& options = {});

// Spin-wait on a flag another rank thread sets (the test's own out-of-band signalling).
void wait_for(const std::atomic<bool>& flag);

// The layer on 2 GPUs: every rank's outputs.
std::vector<RankOutputs> run_gpu_layer(const Problem& p, const std::vector<RankInputs>& in,
                                       const NcclTransportOptions& options = {});

// gpu against the CPU backend on the same inputs (backend bound) and float64 (tolerance table).
void expect_matches_cpu(const Problem& p, const std::vector<RankInputs>& in,
                        const std::vector<RankOutputs>& gpu, const std::string& what);

// A problem of kRanks ranks.
Problem problem(int64_t T, int64_t D, int64_t F, int experts, int K);

// fn() throws a timeout Error whose text names rank_text.
void expect_timeout_naming(const std::function<void()>& fn, const std::string& rank_text,
                           const std::string& what);

}  // namespace epmoe::test
