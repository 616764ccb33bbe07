// Kernels of formats_hw_check.h: one thread per input, mismatches counted with atomics (the
// smallest differing input kept with atomicMin, then its two results recomputed on the host side
// of the kernel's output).
#include "formats_hw_check.h"

#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "core/formats/e2m1.h"
#include "core/formats/e4m3.h"

namespace epmoe::test {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

struct DeviceResult {
  unsigned long long count;
  uint32_t first;
  uint32_t ours, theirs;
};

__device__ uint32_t half_bits_to_float_bits(__half_raw h) { return __float_as_uint(__half2float(__half(h))); }

template <int kWhich>
__device__ void results(uint32_t input, uint32_t& ours, uint32_t& theirs) {
  const float x = __uint_as_float(input);
  if constexpr (kWhich == 0) {
    ours = e4m3_from_float(x);
    theirs = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  } else if constexpr (kWhich == 1) {
    ours = e2m1_from_float(x);
    theirs = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
  } else {
    // input < 256: an E4M3 code; 256 + c: an E2M1 code. NaN == NaN.
    float a, b;
    if (input < 256) {
      a = e4m3_to_float(static_cast<uint8_t>(input));
      b = __uint_as_float(half_bits_to_float_bits(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(input), __NV_E4M3)));
    } else {
      a = e2m1_to_float(static_cast<uint8_t>(input - 256));
      b = __uint_as_float(half_bits_to_float_bits(__nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(input - 256), __NV_E2M1)));
    }
    ours = __float_as_uint(a);
    theirs = (isnan(a) && isnan(b)) ? ours : __float_as_uint(b);
  }
}

template <int kWhich>
__global__ void compare_kernel(uint64_t count, DeviceResult* out) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long local = 0;
  uint32_t first = 0xffffffffu;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    uint32_t ours, theirs;
    results<kWhich>(static_cast<uint32_t>(i), ours, theirs);
    if (ours != theirs) {
      ++local;
      if (static_cast<uint32_t>(i) < first) first = static_cast<uint32_t>(i);
    }
  }
  if (local != 0) {
    atomicAdd(&out->count, local);
    atomicMin(&out->first, first);
  }
}

template <int kWhich>
__global__ void first_kernel(DeviceResult* out) {
  if (out->count != 0) results<kWhich>(out->first, out->ours, out->theirs);
}

template <int kWhich>
HwMismatches run(uint64_t count) {
  DeviceResult* d = nullptr;
  check(cudaMalloc(&d, sizeof(DeviceResult)), "cudaMalloc");
  DeviceResult init{0, 0xffffffffu, 0, 0};
  check(cudaMemcpy(d, &init, sizeof(init), cudaMemcpyHostToDevice), "cudaMemcpy");
  compare_kernel<kWhich><<<4096, 256>>>(count, d);
  first_kernel<kWhich><<<1, 1>>>(d);
  check(cudaGetLastError(), "launch");
  DeviceResult r{};
  check(cudaMemcpy(&r, d, sizeof(r), cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaFree(d), "cudaFree");
  return HwMismatches{r.count, r.first, r.ours, r.theirs};
}

}  // namespace

HwMismatches e4m3_encode_vs_cuda_all_floats() { return run<0>(1ull << 32); }
HwMismatches e2m1_encode_vs_cuda_all_floats() { return run<1>(1ull << 32); }
HwMismatches e4m3_e2m1_decode_vs_cuda() { return run<2>(256 + 16); }

}  // namespace epmoe::test
