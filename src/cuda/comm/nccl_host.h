// Host-side helpers of the NCCL transport: bounded stream waits and small utilities.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace epmoe::nccl {

using Clock = std::chrono::steady_clock;

// Waits for the work of `stream` until `deadline`; false when it is still running then.
// `comm` (nullable): NCCL's asynchronous errors end the wait with Error(backend).
bool wait_stream(cudaStream_t stream, Clock::time_point deadline, ncclComm_t comm = nullptr);

// "0, 2, 5"
std::string rank_list(const std::vector<int>& ranks);

// The environment variable is set to "0".
bool env_is_zero(const char* name);

// Hash of this host's name (ranks on one host can use CUDA IPC).
uint64_t host_hash();

}  // namespace epmoe::nccl
