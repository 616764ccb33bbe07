#include "activation_hw_check.h"

#include <cuda_runtime.h>

#include <cstring>

namespace epmoe::test {
namespace {

__device__ bool same_bits(float a, float b) {
  return (a != a && b != b) || __float_as_uint(a) == __float_as_uint(b);
}

// mismatch_N[i] = 1 where the two ways differ.
__global__ void both_ways_kernel(const float* gate_N, const float* up_N, const float* dh_N, int64_t n,
                                 ActivationParams p, int* mismatch_N) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float d_gate, d_up, d_gate1, d_up1;
    swiglu_backward(gate_N[i], up_N[i], dh_N[i], p, d_gate, d_up);
    const float h = swiglu_forward(gate_N[i], up_N[i], p);
    const float h1 = swiglu_backward_and_forward(gate_N[i], up_N[i], dh_N[i], p, d_gate1, d_up1);
    mismatch_N[i] = same_bits(h, h1) && same_bits(d_gate, d_gate1) && same_bits(d_up, d_up1) ? 0 : 1;
  }
}

}  // namespace

ActivationMismatch swiglu_both_ways_on_device(const std::vector<float>& gate, const std::vector<float>& up,
                                              const std::vector<float>& dh, const ActivationParams& p) {
  ActivationMismatch out;
  const int64_t n = static_cast<int64_t>(gate.size());
  float* d_in = nullptr;
  int* d_mismatch = nullptr;
  auto fail = [&](cudaError_t e) {
    out.error = cudaGetErrorString(e);
    cudaFree(d_in);
    cudaFree(d_mismatch);
    return out;
  };
  cudaError_t e = cudaMalloc(&d_in, 3 * n * sizeof(float));
  if (e != cudaSuccess) return fail(e);
  e = cudaMalloc(&d_mismatch, n * sizeof(int));
  if (e != cudaSuccess) return fail(e);
  const std::vector<float>* parts[3] = {&gate, &up, &dh};
  for (int k = 0; k < 3; ++k) {
    e = cudaMemcpy(d_in + k * n, parts[k]->data(), n * sizeof(float), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) return fail(e);
  }
  both_ways_kernel<<<256, 256>>>(d_in, d_in + n, d_in + 2 * n, n, p, d_mismatch);
  e = cudaGetLastError();
  if (e != cudaSuccess) return fail(e);
  std::vector<int> mismatch(static_cast<size_t>(n));
  e = cudaMemcpy(mismatch.data(), d_mismatch, n * sizeof(int), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return fail(e);
  for (int64_t i = 0; i < n; ++i) {
    if (mismatch[static_cast<size_t>(i)] == 0) continue;
    if (out.first < 0) out.first = i;
    ++out.count;
  }
  cudaFree(d_in);
  cudaFree(d_mismatch);
  return out;
}

}  // namespace epmoe::test
