// Driver API calls without linking libcuda (libepmoe loads on machines without a driver): each
// entry point comes from the runtime's cudaGetDriverEntryPointByVersion (CUDA 12.0 signatures).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/check.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

// fn = the driver's `symbol`; Error(backend) naming it when the driver has none.
template <class Fn>
void load_driver_entry(Fn*& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  EPMOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found));
  EPMOE_EXPECT(found == cudaDriverEntryPointSuccess && p != nullptr, backend, symbol,
               "a driver entry point (CUDA 12.0 version)", "none found");
  fn = reinterpret_cast<Fn*>(p);
}

}  // namespace epmoe::cuda
