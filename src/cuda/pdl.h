// Programmatic dependent launch (PDL) of the forward chain's kernels (publish, route, plan, pull,
// the bf16 grouped GEMMs, reduce). Launched with it, a kernel may start while the previous kernel
// of its stream still runs: its CTAs take SMs as the previous grid's CTAs retire, run their
// prologue (barrier init, descriptor prefetch), and pdl_wait() until the previous grid has
// completed and its writes are visible. Every kernel launched through launch_dependent() calls
// pdl_wait() before its first global access (read or write) that another kernel orders, then
// pdl_release_dependents() so that the next one may launch in turn. Without the launch attribute
// both are no-ops. EPMOE_PDL=0|1 (read per launch, unset: 0) switches the attribute.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "cuda/check.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// EPMOE_PDL: 1 launches the chain's kernels with the programmatic attribute.
inline bool pdl_selected() {
  const char* env = std::getenv("EPMOE_PDL");
  if (env == nullptr) return false;
  EPMOE_CHECK_ARG(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, "EPMOE_PDL", "0 or 1", env);
  return env[0] == '1';
}

// The launch attribute of a programmatic dependent launch.
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}

// kernel<<<grid, block, smem, stream>>>(args...), programmatic where pdl_selected(). Only for
// kernels that pdl_wait() before their first ordered global access.
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), unsigned grid, unsigned block, size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute = pdl_attribute();
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  const bool pdl = pdl_selected();
  config.attrs = pdl ? &attribute : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace epmoe::cuda
