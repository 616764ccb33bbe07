// GPU test support: a device buffer of a test's lifetime, filled from a host vector or with a
// byte pattern, read back after the stream's work is done. Failures are test failures.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace epmoe::test {

// Device copy of a host vector, or n elements of 0xA5 bytes (an element the kernel misses, or a
// stray write, shows).
template <class T>
struct Dev {
  explicit Dev(size_t n) : size(n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    ptr = static_cast<T*>(p);
    EXPECT_EQ(cudaMemset(ptr, 0xA5, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  explicit Dev(const std::vector<T>& host) : Dev(host.size()) {
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~Dev() { cudaFree(ptr); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  // Waits for the device, then copies the whole buffer back.
  std::vector<T> get() const {
    std::vector<T> host(size);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (size != 0) {
      EXPECT_EQ(cudaMemcpy(host.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }
  T* ptr = nullptr;
  size_t size = 0;
};

}  // namespace epmoe::test
