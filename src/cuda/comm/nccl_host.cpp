#include "cuda/comm/nccl_host.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

#include "cuda/check.h"
#include "cuda/comm/nccl_check.h"

namespace epmoe::nccl {

bool wait_stream(cudaStream_t stream, Clock::time_point deadline, ncclComm_t comm) {
  auto pause = std::chrono::microseconds(2);
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) EPMOE_CUDA_CHECK(q);
    if (comm != nullptr) {
      ncclResult_t async = ncclSuccess;
      EPMOE_NCCL_CHECK(ncclCommGetAsyncError(comm, &async));
      if (async != ncclInProgress) EPMOE_NCCL_CHECK(async);
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(500));
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

bool env_is_zero(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

uint64_t host_hash() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return std::hash<std::string>{}(name);
}

}  // namespace epmoe::nccl
