// Shared by the CUDA benchmark binaries: a checked-call macro (benchmarks exit on a CUDA error),
// the MEASURE.md shapes at EP = 1, a counter hash for device-side fills (E4M3 codes), a bitwise
// difference count, device allocation and
// CUDA-event timing (3 warm-up launches, then the median and min-max of `iters`).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define BENCH_CHECK(call)                                                                     \
  do {                                                                                        \
    const cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace epmoe::bench {

struct ModelShape {
  const char* name;
  int64_t D, F;
  int E, K;
  int64_t T;
};

inline constexpr const ModelShape kShapes[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8, 8192},
    {"deepseek-v3", 7168, 2048, 256, 8, 4096},
    {"gpt-oss-120b", 2880, 2880, 128, 4, 8192},
    {"mixtral-8x7b", 4096, 14336, 8, 2, 8192},
};

__device__ inline uint32_t mix(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint32_t>(x);
}

// Random finite E4M3 codes: exponent bits 6 and 3 cleared (|x| < 1, never the NaN codes 0x7F /
// 0xFF).
__global__ inline void fill_e4m3(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<uint8_t>(mix(static_cast<uint64_t>(i), seed) & 0xB7u);
  }
}

// Adds to *count the elements where the 16-bit a and b differ (bitwise).
__global__ inline void count_differences(const uint16_t* a, const uint16_t* b, int64_t n,
                                         unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    local += a[i] != b[i] ? 1u : 0u;
  }
  if (local != 0) atomicAdd(count, local);
}

template <class T>
T* alloc(int64_t n) {
  void* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T)));
  return static_cast<T*>(p);
}

template <class T>
T* upload(const std::vector<T>& host) {
  T* p = alloc<T>(static_cast<int64_t>(host.size()));
  BENCH_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

struct Timing {
  double median_ms, min_ms, max_ms;
};

inline Timing time_launches(const std::function<void()>& launch, int iters) {
  for (int i = 0; i < 3; ++i) launch();
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    BENCH_CHECK(cudaEventRecord(start));
    launch();
    BENCH_CHECK(cudaEventRecord(stop));
    BENCH_CHECK(cudaEventSynchronize(stop));
    float t = 0.0f;
    BENCH_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

}  // namespace epmoe::bench
