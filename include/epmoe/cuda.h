// CUDA entry points of the public API (no CUDA types). In a build without the CUDA backend,
// cuda_device_count() returns 0 and the factories throw Error(backend).
#pragma once

#include <memory>

#include "epmoe/transport.h"

namespace epmoe {

// Number of CUDA devices epmoe can use (0 without a driver, a GPU or the CUDA backend).
int cuda_device_count();

// EP = 1 on one GPU: a transport whose single rank computes on cuda:device. Symmetric buffers
// are plain device allocations; barriers are no-ops.
std::shared_ptr<Transport> make_single_gpu_transport(int device);

}  // namespace epmoe
