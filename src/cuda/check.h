// Checked CUDA calls. Every CUDA runtime call of the backend goes through EPMOE_CUDA_CHECK, and
// every kernel launch is followed by EPMOE_CUDA_LAUNCH_CHECK(): a failure throws
// Error(backend) whose argument is the call's text and whose message is "<name>: <string>".
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "epmoe/error.h"

namespace epmoe::cuda {

inline std::string cuda_error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

}  // namespace epmoe::cuda

#define EPMOE_CUDA_CHECK(call)                                                                  \
  do {                                                                                          \
    const cudaError_t epmoe_cuda_err_ = (call);                                                 \
    if (epmoe_cuda_err_ != cudaSuccess) {                                                       \
      ::epmoe::detail::throw_error(::epmoe::ErrorKind::backend, #call,                          \
                                   ::epmoe::cuda::cuda_error_text(epmoe_cuda_err_), __FILE__,   \
                                   __LINE__);                                                   \
    }                                                                                           \
  } while (0)

// After a <<<...>>> launch: configuration errors (and sticky errors of earlier work) surface here.
#define EPMOE_CUDA_LAUNCH_CHECK() EPMOE_CUDA_CHECK(cudaGetLastError())
