// Makes a CUDA device current for a scope and restores the previous one (several GPUs of one
// process each driven from its own thread, or one thread switching).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/check.h"

namespace epmoe::cuda {

class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) : ordinal_(ordinal) {
    EPMOE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != ordinal_) EPMOE_CUDA_CHECK(cudaSetDevice(ordinal_));
  }
  ~DeviceScope() {
    if (previous_ != ordinal_) cudaSetDevice(previous_);  // best effort: a destructor cannot throw
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int ordinal_;
  int previous_ = 0;
};

}  // namespace epmoe::cuda
